"""What the plugin's models need from vLLM's engine config, checked when the config is built (vLLM's per-architecture
hooks, `MODELS_CONFIG_MAP`), before any engine or worker process starts.

- Refused, each with its reason: vLLM features that would corrupt a model's state rather than serve it exactly.
  Laplace's recurrent state advances with every token a step feeds it, so speculative decoding (whose rejected
  drafts vLLM rolls back only in attention caches) would leave it past the accepted tokens. MLA-Trinity keeps a
  key-scale store beside vLLM's latent blocks (model_executors/latent_attention.py), so anything that moves or
  copies blocks outside the model's forward (KV connectors, KV offloading, disaggregated prefill) would move
  latents without their scales; and its speculative decoding has not been verified against the latent cache.
- Added: the plugin's stateful custom ops as vLLM splitting ops. They read the forward context and branch on it
  (profiling runs have no metadata) and choose experts on the host, so a piecewise CUDA graph must never capture
  them: vLLM runs splitting ops eagerly between the captured pieces, as it does its own attention ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.model_executor.models.config import MambaModelConfig, VerifyAndUpdateConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Opaque ops whose work depends on runtime metadata or data (defined in model_executors/).
STATEFUL_OPS = ("vllm::trn_laplace_mixer", "vllm::trn_latent_attention", "vllm::trn_fp8_experts")


def _add_splitting_ops(vllm_config: VllmConfig) -> None:
    from vllm.config.compilation import CompilationConfig

    cc = vllm_config.compilation_config
    ops = list(CompilationConfig._attention_ops) if cc.splitting_ops is None else list(cc.splitting_ops)
    cc.splitting_ops = ops + [op for op in STATEFUL_OPS if op not in ops]


def _refuse_state_corrupting(vllm_config: VllmConfig, arch: str, speculative: str, block_movers: str) -> None:
    """Raise, naming the option and why (`speculative`, `block_movers`), for the features `arch` cannot honour."""
    option, why = None, None
    if vllm_config.speculative_config is not None:
        option, why = "--speculative-config (speculative decoding)", speculative
    elif vllm_config.cache_config.kv_offloading_size is not None:
        option, why = "--kv-offloading-size (KV offloading)", block_movers
    elif vllm_config.kv_transfer_config is not None:  # offloading sets one too, later
        option, why = "--kv-transfer-config (KV connectors, disaggregated prefill)", block_movers
    if option is not None:
        raise ValueError(f"{arch} cannot be served with {option}: {why}")


class LaplaceEngineChecks(MambaModelConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config: VllmConfig) -> None:
        _refuse_state_corrupting(
            vllm_config,
            "LaplaceForCausalLM",
            speculative="the recurrent state advances with every draft token a step verifies, and vLLM does not "
            "roll a state back past rejected drafts",
            block_movers="the recurrent-state pages are not supported by vLLM's KV connectors",
        )
        _add_splitting_ops(vllm_config)
        super().verify_and_update_config(vllm_config)


class TrinityMLAEngineChecks(VerifyAndUpdateConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config: VllmConfig) -> None:
        _refuse_state_corrupting(
            vllm_config,
            "TrinityMLAForCausalLM",
            speculative="not verified with the latent cache and its key-scale store",
            block_movers="each latent layer keeps its key scales in a store beside vLLM's blocks, which a "
            "connector would not move with them",
        )
        _add_splitting_ops(vllm_config)


ENGINE_CHECKS: dict[str, type[VerifyAndUpdateConfig]] = {
    "LaplaceForCausalLM": LaplaceEngineChecks,
    "TrinityMLAForCausalLM": TrinityMLAEngineChecks,
}
