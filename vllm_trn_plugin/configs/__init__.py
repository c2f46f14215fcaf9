from vllm_trn_plugin.configs.laplace import LaplaceConfig

__all__ = ["LaplaceConfig"]
