"""vLLM plugin for MLA-Trinity and Laplace 3B on AWS Trainium2 (and vLLM's CPU build).

`register()` is the `vllm.general_plugins` entry point: vLLM calls it in every process it
starts (API server, engine core, workers), so it is idempotent and imports nothing heavy.
"""

from __future__ import annotations

ARCHITECTURES = {
    "LaplaceForCausalLM": "vllm_trn_plugin.model_executors.laplace:LaplaceForCausalLM",
    "TrinityMLAForCausalLM": "vllm_trn_plugin.model_executors.trinity_mla:TrinityMLAForCausalLM",
}

_registered = False


def _init_cpu_amx() -> None:
    # vLLM's CPU bf16 kernels use AMX tiles; a spawned worker that never asked the kernel for
    # tile permission dies with SIGILL. Asking is per process, so it belongs here.
    import torch

    cpu = getattr(torch, "cpu", None)
    if cpu is not None and getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        torch._C._cpu._init_amx()


def register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, MambaModelConfig

    import vllm_trn_plugin.quantization  # noqa: F401  (registers the trn-mxfp4-fp8 method)
    from vllm_trn_plugin.configs import LaplaceConfig

    _init_cpu_amx()
    AutoConfig.register("laplace", LaplaceConfig, exist_ok=True)
    supported = set(ModelRegistry.get_supported_archs())
    for arch, path in ARCHITECTURES.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, path)
    # One state page per sequence, sized to max_model_len (vLLM fills this only for the state
    # models it knows).
    MODELS_CONFIG_MAP.setdefault("LaplaceForCausalLM", MambaModelConfig)
    _registered = True
