"""What the plugin's models need from vLLM's engine config, checked when the config is built (vLLM's per-architecture
hooks, `MODELS_CONFIG_MAP`), before any engine or worker process starts.

- Refused, each with its reason: vLLM features a model cannot serve exactly. Laplace serves n-gram speculation (its
  mixer keeps the drafts' recurrence inputs in the page and moves the state over those vLLM accepted, one step
  later); the other methods are unverified, and beside --enable-prefix-caching vLLM would copy and keep pages
  whose state does not yet cover the tokens they hold. MLA-Trinity keeps a key-scale store beside vLLM's latent
  blocks (model_executors/latent_attention.py), so anything that moves or copies blocks outside the model's forward
  (KV connectors, KV offloading, disaggregated prefill) would move latents without their scales. Of the speculative
  methods it serves n-gram (prompt lookup) and EAGLE3 (its model returns the residual stream after the layers the
  draft names): a verification step's k + 1 tokens per request run the latent layers' prefill path over the cached
  context, and a rejected draft's latent and key scale sit in slots the next step writes again; the other methods,
  and every method at tensor parallelism or under vLLM Neuron's runner, are refused (unverified). LoRA
  (--enable-lora): Laplace does not implement vLLM's LoRA interface; MLA-Trinity inherits it from vLLM's AFMoE, but
  its latent layers read kv_b_proj as a plain matrix inside the attention math, where vLLM's LoRA layers never
  apply, and on vLLM's CPU build LoRA moves the routed experts to a Triton kernel that build cannot run.
- Refused, each with its reason: parallel layouts a model does not have. Laplace is served one replica per core
  (3.0B parameters and its states fit one 24 GiB core; more cores serve more replicas, behind the router or with
  --data-parallel-size), so it has no tensor-parallel layout. MLA-Trinity's routed experts under
  --enable-expert-parallel need the plugin's FP8 experts on vLLM's CPU build: vLLM's unquantized CPU experts
  (cpu_fused_moe) index their local weights with global expert ids, past the end under an expert map (a
  segfault, vLLM's own AFMoE alike).
- Set on CPU when the user has not: a thread binding for several local workers (tensor parallelism on one NUMA
  node). vLLM's automatic binding gives each worker a NUMA node of its own and fails with fewer nodes than workers
  (a 2-core host at --tensor-parallel-size 2); the plugin then splits the allowed cores evenly among the workers.
- Set for Laplace under --enable-prefix-caching: the interval between its state checkpoints (vLLM's mamba_block_size,
  default LAPLACE_CHECKPOINT_TOKENS) and vLLM's block size with it; an interval off the GLA chunk grid is refused.
- Added: the plugin's stateful custom ops as vLLM splitting ops. They read the forward context and branch on it
  (profiling runs have no metadata) and choose experts on the host, so a piecewise CUDA graph must never capture
  them: vLLM runs splitting ops eagerly between the captured pieces, as it does its own attention ops.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.model_executor.models.config import MambaModelConfig, VerifyAndUpdateConfig

from vllm_trn_plugin.envs import neuron_runner_active
from vllm_trn_plugin.models import MODELS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Under vLLM's logger tree: vLLM configures only that one, so an INFO line elsewhere is dropped.
logger = init_logger(f"vllm.{__name__}")

# Opaque ops whose work depends on runtime metadata or data (defined in model_executors/), every model's.
STATEFUL_OPS = tuple(op for m in MODELS.values() for op in m.splitting_ops)


def _add_splitting_ops(vllm_config: VllmConfig) -> None:
    from vllm.config.compilation import CompilationConfig

    cc = vllm_config.compilation_config
    ops = list(CompilationConfig._attention_ops) if cc.splitting_ops is None else list(cc.splitting_ops)
    cc.splitting_ops = ops + [op for op in STATEFUL_OPS if op not in ops]


THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
_bound: list[str] = []  # the binding this process set (recomputed for each engine config it builds)


def bind_cpu_workers(vllm_config: VllmConfig) -> None:
    """Set VLLM_CPU_OMP_THREADS_BIND (read when the engine starts its workers, in processes started after this) to
    the allowed cores split evenly among the local workers, where vLLM's automatic per-NUMA-node binding cannot
    place them. A binding the user set is kept as it is."""
    from vllm.platforms import current_platform
    from vllm.utils import cpu_resource_utils

    if not current_platform.is_cpu() or os.environ.get(THREADS_BIND) not in (None, *_bound[-1:]):
        return
    if _bound:  # ours, from an earlier engine config: this one decides afresh
        os.environ.pop(THREADS_BIND, None)
        _bound.clear()
    p = vllm_config.parallel_config
    workers = p.local_world_size * max(1, p.data_parallel_size_local)  # vLLM slices the list per local DP rank
    if workers == 1 or len(cpu_resource_utils.get_visible_memory_node()) >= workers:
        return
    cpus = sorted(c.id for c in cpu_resource_utils.get_allowed_cpu_list())
    if len(cpus) < workers:
        raise ValueError(
            f"{workers} CPU workers (--tensor-parallel-size x --pipeline-parallel-size x local data-parallel size) "
            f"need a core each, and this process may use {len(cpus)}; set {THREADS_BIND} yourself or use fewer"
        )
    n = len(cpus) // workers
    mask = "|".join(",".join(map(str, cpus[i * n : (i + 1) * n])) for i in range(workers))
    os.environ[THREADS_BIND] = mask
    _bound.append(mask)
    logger.info("%s=%r: %d CPU workers, %d cores each (fewer NUMA nodes than workers)", THREADS_BIND, mask, workers, n)


def _refuse_features(
    vllm_config: VllmConfig,
    arch: str,
    *,
    speculative: str,
    block_movers: str,
    lora: str,
    speculative_served: tuple[str, ...] = (),
) -> None:
    """Raise, naming the option and why, for the features `arch` cannot honour: `speculative` for every speculative
    method but those in `speculative_served`, `block_movers` for KV offloading and connectors, `lora` for LoRA
    adapters."""
    option, why = None, None
    spec = vllm_config.speculative_config
    if spec is not None and spec.method not in speculative_served:
        option = f"--speculative-config (speculative decoding, method {spec.method!r})"
        why = speculative
    elif vllm_config.cache_config.kv_offloading_size is not None:
        option, why = "--kv-offloading-size (KV offloading)", block_movers
    elif vllm_config.kv_transfer_config is not None:  # offloading sets one too, later
        option, why = "--kv-transfer-config (KV connectors, disaggregated prefill)", block_movers
    elif vllm_config.lora_config is not None:
        option, why = "--enable-lora (LoRA adapters)", lora
    if option is not None:
        raise ValueError(f"{arch} cannot be served with {option}: {why}")


def _refuse_layout(vllm_config: VllmConfig, arch: str) -> None:
    from vllm.platforms import current_platform

    from vllm_trn_plugin.loaders.packed import QUANT_NAME

    p = vllm_config.parallel_config
    if arch == "LaplaceForCausalLM" and p.tensor_parallel_size > 1:
        raise ValueError(
            "LaplaceForCausalLM has no tensor-parallel layout (--tensor-parallel-size must be 1): it is served one "
            "replica per core (3.0B parameters and 20 sequences' 29 MB states fit a 24 GiB Trainium2 core); serve "
            "more cores as more replicas, behind the router (deploy/trn2) or with --data-parallel-size"
        )
    if p.pipeline_parallel_size > 1:
        raise ValueError(f"{arch} has no pipeline stages: --pipeline-parallel-size must be 1")
    hf = vllm_config.model_config.hf_config
    if arch == "TrinityMLAForCausalLM":
        heads, kv_heads = getattr(hf, "num_attention_heads", None), getattr(hf, "num_key_value_heads", None)
        if not (isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads >= 1 and heads % kv_heads == 0):
            raise ValueError(
                f"TrinityMLAForCausalLM: config.json num_attention_heads={heads!r} must be a positive multiple of "
                f"num_key_value_heads={kv_heads!r} (each KV head serves a whole group of query heads)"
            )
    if (
        arch == "TrinityMLAForCausalLM"
        and p.enable_expert_parallel
        and current_platform.is_cpu()
        and vllm_config.model_config.quantization != QUANT_NAME
    ):
        raise ValueError(
            "TrinityMLAForCausalLM: --enable-expert-parallel on vLLM's CPU build needs a packed (MXFP4/FP8) "
            "checkpoint: vLLM's unquantized CPU experts ignore the expert map and read past their weights"
        )


class LaplaceEngineChecks(MambaModelConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config: VllmConfig) -> None:
        _refuse_layout(vllm_config, "LaplaceForCausalLM")
        spec_why, spec_served = _laplace_speculation(vllm_config)
        _refuse_features(
            vllm_config,
            "LaplaceForCausalLM",
            speculative=spec_why,
            speculative_served=spec_served,
            block_movers="the recurrent-state pages are not supported by vLLM's KV connectors",
            lora="the model does not implement vLLM's LoRA interface (SupportsLoRA); no adapter has been verified "
            "against merged weights through its stateful mixer",
        )
        _add_splitting_ops(vllm_config)
        bind_cpu_workers(vllm_config)
        _laplace_checkpoint_interval(vllm_config)
        super().verify_and_update_config(vllm_config)


# Tokens between Laplace's state checkpoints under --enable-prefix-caching (vLLM's mamba_block_size), unless the user
# sets --mamba-block-size or --block-size: docs/models.md "Prefix caching" has what it costs and buys.
LAPLACE_CHECKPOINT_TOKENS = 256


def _laplace_checkpoint_interval(vllm_config: VllmConfig) -> None:
    """Under --enable-prefix-caching vLLM keeps Laplace's state at block boundaries (its "align" mode) and a prefix hit
    restores the last one: the block size is the checkpoint interval.

    - Its size: --mamba-block-size, else --block-size if given, else the plugin's default. (vLLM would take
      --block-size, which on the CPU build is still its generic 16 when this hook runs: a page copy every 16 tokens.)
    - --block-size is set to it as well. vLLM's scheduler ends align-mode prefill chunks on multiples of the cache
      config's block size, and keeps the state at a prompt's last boundary only if a chunk ends there; its own copy of
      the config keeps the platform's block size (128 on the CPU build) even where the engine core later raises the
      pool's to the checkpoint interval. Chunks then end off the checkpoint grid and a prompt's last checkpoint is
      never written (measured: a chat's hits one turn behind with 256-token checkpoints).
    - A size off the GLA prefill's 128-token chunk grid is refused: a restored prefix would leave the remainder
      chunked differently from the same prompt without the cache."""
    from vllm_trn_plugin.kernels.simple_gla import CHUNK_SIZE

    cache = vllm_config.cache_config
    if not cache.enable_prefix_caching:
        return
    if cache.mamba_block_size is None:
        cache.mamba_block_size = cache.block_size if cache.user_specified_block_size else LAPLACE_CHECKPOINT_TOKENS
    elif cache.user_specified_block_size and cache.block_size != cache.mamba_block_size:
        raise ValueError(
            f"LaplaceForCausalLM with --enable-prefix-caching: --block-size {cache.block_size} and --mamba-block-size "
            f"{cache.mamba_block_size} differ; Laplace's only cache is its state, so give one of them (the interval "
            "between state checkpoints)"
        )
    if cache.mamba_block_size % CHUNK_SIZE:
        raise ValueError(
            f"LaplaceForCausalLM with --enable-prefix-caching: --mamba-block-size (or --block-size) "
            f"{cache.mamba_block_size} is not a multiple of {CHUNK_SIZE}, the GLA prefill's chunk: state checkpoints "
            "must fall on its chunk grid"
        )
    cache.block_size = cache.mamba_block_size
    cache.user_specified_block_size = True  # so that the platform keeps it
    logger.info("Laplace prefix caching: a state checkpoint every %d tokens", cache.mamba_block_size)


def _laplace_speculation(vllm_config: VllmConfig) -> tuple[str, tuple[str, ...]]:
    """Laplace's speculative methods served in this configuration, and why the others are refused."""
    if neuron_runner_active():
        return "under vLLM Neuron's runner the contract adapter's decode step takes one token per request", ()
    if vllm_config.cache_config.enable_prefix_caching:
        return (
            "with --enable-prefix-caching vLLM copies and keeps state pages at block boundaries, and under "
            "speculation a page also holds tokens not yet in its state; serve one or the other",
            (),
        )
    return (
        "of vLLM's methods only n-gram (prompt lookup) is served, verified against the recurrent state; the others "
        "(EAGLE, a separate draft model, Medusa, ...) have not been",
        ("ngram",),
    )


def _trinity_speculation(vllm_config: VllmConfig) -> tuple[str, tuple[str, ...]]:
    """MLA-Trinity's speculative methods served in this configuration, and why the others are refused."""
    if neuron_runner_active():
        return "under vLLM Neuron's runner the contract adapter's decode step takes one token per request", ()
    if vllm_config.parallel_config.tensor_parallel_size > 1:
        return "speculation has been verified at --tensor-parallel-size 1 only", ()
    return (
        "of vLLM's methods only n-gram (prompt lookup) and EAGLE3 are served, each verified against the latent "
        "cache; the others (a separate draft model, EAGLE, Medusa, DFlash, ...) have not been",
        ("ngram", "eagle3"),
    )


class TrinityMLAEngineChecks(VerifyAndUpdateConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm_trn_plugin.model_executors.latent_cache import latent_cache_dtype

        _refuse_layout(vllm_config, "TrinityMLAForCausalLM")
        latent_cache_dtype(vllm_config)  # an unknown --additional-config latent_cache_dtype fails here, not in a worker
        spec_why, spec_served = _trinity_speculation(vllm_config)
        _refuse_features(
            vllm_config,
            "TrinityMLAForCausalLM",
            speculative=spec_why,
            speculative_served=spec_served,
            block_movers="each latent layer keeps its key scales in a store beside vLLM's blocks, which a "
            "connector would not move with them",
            lora="the latent layers read kv_b_proj as a plain matrix inside the attention math (folded into the "
            "decode query and the stored key scales), where vLLM's LoRA layers never apply, and have no k_proj or "
            "v_proj for an adapter of the original model's attention; on vLLM's CPU build LoRA also moves the routed "
            "experts to vLLM's Triton fused-MoE kernel, which that build cannot run (the engine dies at its first "
            "step)",
        )
        _add_splitting_ops(vllm_config)
        bind_cpu_workers(vllm_config)
