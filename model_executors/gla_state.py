"""Recurrent-state cache manager for Laplace's GLA mixers, inside vLLM's state pool.

The model is attention-free: every mixer is a `MambaBase` layer whose states (fp32 GLA state
[H, d_k, d_v] and the conv window [conv_size-1, D]) vLLM packs into one fixed page (`MambaSpec`).

- Prefix caching off (vLLM's `mamba_cache_mode="none"`): one page per sequence (block size =
  max_model_len), `block_table[:, 0]`.
- Prefix caching on (`"align"`, engine_checks.py sets the block size): a request's block table has one
  column per `mamba_block_size` tokens, and the page a step reads and writes is the column of its
  last token, `(seq_len - 1) // block_size` (vLLM's `mamba_get_block_table_tensor`). Before the step vLLM
  copies the state the request had (or the cached checkpoint a prefix hit found) into that page
  (`preprocess_mamba`, through the model's copy functions); the page the request leaves behind at a block
  boundary holds the state after exactly that many tokens, and vLLM keeps it, hashed, as the checkpoint a
  later prompt with the same prefix restores. The mixer reads and writes one page per step either way.

vLLM does not clear a page when it hands it to a new request, so the metadata marks which rows
start from zero state (no computed tokens: no history, and no copy into the page).

Rows are ordered decodes first (query length 1, `reorder_batch_threshold = 1`). A brand-new
one-token prompt also lands among the "decodes"; `decode_fresh` marks it so the step starts
from zero instead of the page's previous owner's state.

Under speculative decoding the mixer reads every row alike (`LaplaceMixer.mix_speculative`): where a
row's drafts are is not in the metadata (vLLM can send a new one-token prompt with drafts, among the
prefills), only that they are among its last k tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor, split_decodes_and_prefills
from vllm.v1.kv_cache_interface import MambaSpec


@dataclass
class GLAStateMetadata:
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_actual_tokens: int
    decode_slots: torch.Tensor  # [num_decodes] page per decode row (-1 = padding)
    decode_fresh: torch.Tensor  # [num_decodes] bool: no history yet, start from zero state
    prefill_cu_seqlens: torch.Tensor  # [num_prefills + 1] host int64, token offsets after the decode rows
    prefill_slots: torch.Tensor  # [num_prefills]
    prefill_has_state: torch.Tensor  # [num_prefills] bool: continues a chunked prefill
    context_lens: torch.Tensor  # [num_decodes + num_prefills] tokens before this step's (vLLM's computed tokens)
    query_cu_seqlens: torch.Tensor  # [num_decodes + num_prefills + 1] host int64: every row's token offsets
    # Every tensor but the cu_seqlens (read on the host to split the packed tokens) is on the model's device.


class GLAStateMetadataBuilder(AttentionMetadataBuilder[GLAStateMetadata]):
    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: MambaSpec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.mamba_cache_mode = vllm_config.cache_config.mamba_cache_mode
        self._init_reorder_batch_threshold(1)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> GLAStateMetadata:
        m = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(m, decode_threshold=1)
        qsl = m.query_start_loc_cpu[: m.num_reqs + 1].long()
        context_lens = m.compute_num_computed_tokens()[: m.num_reqs]  # on the device: no host sync
        table = mamba_get_block_table_tensor(
            m.block_table_tensor[: m.num_reqs], m.seq_lens[: m.num_reqs], self.kv_cache_spec, self.mamba_cache_mode
        )
        slots = table[:, 0].long()
        return GLAStateMetadata(
            num_decodes=num_decodes,
            num_prefills=num_prefills,
            num_decode_tokens=num_decode_tokens,
            num_actual_tokens=int(qsl[-1]),
            decode_slots=slots[:num_decodes],
            decode_fresh=context_lens[:num_decodes] == 0,
            prefill_cu_seqlens=qsl[num_decodes:] - num_decode_tokens,
            prefill_slots=slots[num_decodes:],
            prefill_has_state=context_lens[num_decodes:] > 0,
            context_lens=context_lens,
            query_cu_seqlens=qsl,
        )


class GLAStateBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TRN_GLA_STATE"

    @staticmethod
    def get_builder_cls() -> type[GLAStateMetadataBuilder]:
        return GLAStateMetadataBuilder

    @classmethod
    def is_ssm(cls) -> bool:
        return True
