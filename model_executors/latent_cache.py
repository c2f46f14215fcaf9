"""MLA-Trinity's latent cache inside vLLM's cache machinery, the twin of gla_state.py: the attention backend and
metadata its layers read (one r-wide latent row per token in vLLM's blocks, decodes first), the cache's dtype
(`latent_cache_dtype`, from --additional-config), and the share of an explicit KV cache budget the per-token scale
stores take (`reserve_key_scale_budget`). The layer that reads and writes the cache is latent_attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import KVCacheSpec

from vllm_trn_plugin.kernels.fp8 import FP8_DTYPE

logger = init_logger(f"vllm.{__name__}")


def kv_heads_of_rank(num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """The KV heads a tensor-parallel rank serves, as vLLM's QKVParallelLinear places them: contiguous groups when
    the heads divide among the ranks, one head replicated over tp_size / num_kv_heads ranks when there are fewer."""
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"--tensor-parallel-size {tp_size} does not divide the {num_kv_heads} KV heads")
        n = num_kv_heads // tp_size
        return range(tp_rank * n, (tp_rank + 1) * n)
    if tp_size % num_kv_heads:
        raise ValueError(f"--tensor-parallel-size {tp_size} is not a multiple of the {num_kv_heads} KV heads")
    head = tp_rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


LATENT_CACHE_DTYPE = "latent_cache_dtype"  # the --additional-config key
LATENT_CACHE_DTYPES = ("auto", "fp8", "model")


def latent_cache_dtype(vllm_config: VllmConfig) -> torch.dtype:
    """The latent cache's dtype, from ``--additional-config '{"latent_cache_dtype": ...}'``: "fp8" puts the latent in
    Trainium2's FP8 (E4M3, per-token scales) whatever --kv-cache-dtype says; "model" keeps it in the model dtype;
    "auto" (the default) follows --kv-cache-dtype: FP8 when that is an FP8 type (the sliding layers then FP8 too),
    else the model dtype. ("fp8" alone is for hosts where vLLM refuses an FP8 cache for the sliding layers, as its
    CPU attention does without AVX-512.)"""
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    choice = extra.get(LATENT_CACHE_DTYPE, "auto")
    if choice not in LATENT_CACHE_DTYPES:
        raise ValueError(
            f"--additional-config {LATENT_CACHE_DTYPE}={choice!r}: expected one of {', '.join(LATENT_CACHE_DTYPES)}"
        )
    fp8_kv = str(vllm_config.cache_config.cache_dtype).startswith("fp8")
    return FP8_DTYPE if choice == "fp8" or (choice == "auto" and fp8_kv) else vllm_config.model_config.dtype


def key_scale_bytes_per_latent_byte(config, dtype: torch.dtype, tp_size: int = 1) -> float:  # noqa: ANN001
    """The side stores' bytes per byte of latent cache (in `dtype`) on one rank: one fp32 key scale per KV head of the
    rank per r-wide latent row (every rank caches the whole latent), and for an FP8 latent its fp32 dequantization
    scale."""
    per_row = len(kv_heads_of_rank(config.num_key_value_heads, tp_size, 0)) * 4 + (4 if dtype == FP8_DTYPE else 0)
    return per_row / (config.kv_lora_rank * dtype.itemsize)


def reserve_key_scale_budget(vllm_config: VllmConfig) -> None:
    """Shrink an explicit KV cache budget (--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE) so that vLLM's cache
    plus the key-scale stores fit in it.

    Runs in the worker, when the model is built (before the worker reports its cache memory). vLLM sizes the
    pool from the budget; the stores hold ratio x the latent layers' share of it, which is at most the whole
    pool, so budget / (1 + ratio) always fits (exactly when every cache tensor also holds a latent layer, as in
    Trinity-Mini's hybrid layout and the demo's). A budget vLLM derives itself (memory utilisation) is not
    changed: there the stores come on top of it (logged at bind).
    """
    cache = vllm_config.cache_config
    budget = cache.kv_cache_memory_bytes
    if not budget or _reserved.get(id(cache), (None, None))[1] == budget:  # already reserved for this config
        return
    ratio = key_scale_bytes_per_latent_byte(
        vllm_config.model_config.hf_config,
        latent_cache_dtype(vllm_config),
        vllm_config.parallel_config.tensor_parallel_size,
    )
    cache.kv_cache_memory_bytes = int(budget / (1 + ratio))
    _reserved[id(cache)] = (cache, cache.kv_cache_memory_bytes)
    logger.info(
        "MLA-Trinity: %d of the %d B KV cache budget reserved for the latent layers' scale stores (%.2f%% of the "
        "latent bytes)",
        budget - cache.kv_cache_memory_bytes,
        budget,
        100 * ratio,
    )


# The budgets already reserved, by config (a model built twice under one config must not shrink it twice); the config
# is held so that its id cannot pass to another one.
_reserved: dict[int, tuple[object, int]] = {}


@dataclass
class LatentMetadata:
    num_decodes: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] CPU int64
    seq_lens: torch.Tensor  # [num_reqs] CPU int64, context + new tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks] int64
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, -1 = padding
    block_size: int


class LatentMetadataBuilder(AttentionMetadataBuilder[LatentMetadata]):
    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(
        self, kv_cache_spec: KVCacheSpec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> LatentMetadata:
        m = common_attn_metadata
        num_decodes, _, _, _ = split_decodes_and_prefills(m, decode_threshold=1)
        qsl = m.query_start_loc_cpu[: m.num_reqs + 1].long()
        return LatentMetadata(
            num_decodes=num_decodes,
            num_actual_tokens=int(qsl[-1]),
            query_start_loc=qsl,
            seq_lens=m.seq_lens[: m.num_reqs].cpu().long(),
            block_table=m.block_table_tensor[: m.num_reqs].long(),
            slot_mapping=m.slot_mapping[: int(qsl[-1])].long(),
            block_size=self.kv_cache_spec.block_size,
        )


class LatentAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TRN_LATENT"

    @staticmethod
    def get_builder_cls() -> type[LatentMetadataBuilder]:
        return LatentMetadataBuilder
