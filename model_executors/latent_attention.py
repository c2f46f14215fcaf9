"""MLA-Trinity's global-layer attention: a 256-wide latent is the only thing cached.

Per KV head g with key/value up-projections W_k,g, W_v,g (rows of kv_b_proj) and the original
per-head key RMSNorm weight gamma, token i's key and value are::

    k_g,i = gamma * (W_k,g c_i) / rms(W_k,g c_i)        v_g,i = W_v,g c_i

Prefill rebuilds K and V from the cached latents and runs ordinary GQA attention. Decode is
absorbed: for query head h in group g, q~_h = W_k,g^T (gamma * q_h) (r-wide), the score of key i
is scale * (q~_h . c_i) * s_g,i with s_g,i = 1 / rms(W_k,g c_i), the softmax-weighted sum stays
in latent space (u_h = sum_i p_i c_i) and W_v,g is applied once, after. The key scale s is
data-dependent (the key norm is kept), so it cannot fold into a matrix: it is recomputed from
each latent in the decode path (see docs in README for the measured alternative).

The cache is vLLM's `MLAAttentionSpec(num_kv_heads=1, head_size=r)`: one r-wide row per token,
managed by vLLM's full-attention block manager beside the sliding-window groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import KVCacheSpec, MLAAttentionSpec


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


def gather_latents(cache: torch.Tensor, block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The first `length` cached latents of one request: [length, r]."""
    pos = torch.arange(length, device=cache.device)
    slots = block_table[pos // block_size] * block_size + pos % block_size
    return cache[slots]


class TrinityLatentAttention(nn.Module, AttentionLayerBase):
    """Gated GQA attention whose keys and values come from a cached r-wide latent (no RoPE)."""

    def __init__(self, config, prefix: str = "") -> None:  # noqa: ANN001  (AfmoeConfig + kv_lora_rank)
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scaling = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.prefix = prefix
        H, Hkv, hd, r = self.num_heads, self.num_kv_heads, self.head_dim, self.kv_lora_rank

        self.q_proj = ColumnParallelLinear(config.hidden_size, H * hd, bias=False, prefix=f"{prefix}.q_proj")
        self.kv_a_proj = ReplicatedLinear(config.hidden_size, r, bias=False, prefix=f"{prefix}.kv_a_proj")
        # Read as a matrix by the attention math itself (split per head, folded into q and the
        # output), so a plain parameter: vLLM's CPU linear methods may repack theirs.
        self.kv_b_proj = nn.Linear(r, 2 * Hkv * hd, bias=False)
        self.gate_proj = ColumnParallelLinear(config.hidden_size, H * hd, bias=False, prefix=f"{prefix}.gate_proj")
        self.o_proj = RowParallelLinear(H * hd, config.hidden_size, bias=False, prefix=f"{prefix}.o_proj")
        self.q_norm = RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, eps=config.rms_norm_eps)
        self.kv_cache = torch.tensor([])

        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return LatentAttentionBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        # The latent is kept in the model dtype whatever --kv-cache-dtype says (that applies to the
        # sliding layers): one r-wide row per token.
        return MLAAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=1,
            head_size=self.kv_lora_rank,
            dtype=vllm_config.model_config.dtype,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        T = hidden_states.shape[0]
        q = self.q_proj(hidden_states)[0].view(T, self.num_heads, self.head_dim)
        q = self.q_norm(q)
        latent = self.kv_a_proj(hidden_states)[0]
        out = torch.empty(T, self.num_heads * self.head_dim, dtype=hidden_states.dtype, device=hidden_states.device)
        torch.ops.vllm.trn_latent_attention(q, latent, out, self.prefix)
        gate = self.gate_proj(hidden_states)[0]
        return self.o_proj(out * torch.sigmoid(gate))[0]

    # --- the cached part, run eagerly inside the custom op ---
    def _kv_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        Hkv, hd, r = self.num_kv_heads, self.head_dim, self.kv_lora_rank
        w = self.kv_b_proj.weight.float()
        return w[: Hkv * hd].view(Hkv, hd, r), w[Hkv * hd :].view(Hkv, hd, r)

    def attend(self, q: torch.Tensor, latent: torch.Tensor, output: torch.Tensor) -> None:
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None
        if meta is None:  # profiling / compile warm-up
            output.zero_()
            return
        assert isinstance(meta, LatentMetadata)
        T = meta.num_actual_tokens
        cache = self.kv_cache.view(-1, self.kv_lora_rank)
        valid = meta.slot_mapping >= 0
        cache[meta.slot_mapping[valid]] = latent[:T][valid].to(cache.dtype)

        Wk, Wv = self._kv_weights()
        out = output[:T].view(T, self.num_heads, self.head_dim)
        qsl, seq_lens, bs = meta.query_start_loc, meta.seq_lens, meta.block_size
        nd = meta.num_decodes
        if nd:
            lat = [gather_latents(cache, meta.block_table[b], int(seq_lens[b]), bs) for b in range(nd)]
            out[:nd] = self._absorbed_decode(q[:nd], lat, Wk, Wv).to(out.dtype)
        for b in range(nd, len(seq_lens)):
            s, e, L = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
            c = gather_latents(cache, meta.block_table[b], L, bs)
            out[s:e] = self._prefill(q[s:e], c, Wk, Wv).to(out.dtype)
        output[T:] = 0

    def _prefill(self, q: torch.Tensor, c: torch.Tensor, Wk: torch.Tensor, Wv: torch.Tensor) -> torch.Tensor:
        """Rebuild K, V from latents c [L, r]; causal GQA for the last q.shape[0] positions."""
        n, L = q.shape[0], c.shape[0]
        cf = c.float()
        k = self.k_norm(torch.einsum("lr,gdr->lgd", cf, Wk).to(c.dtype)).float()  # [L, Hkv, hd]
        v = torch.einsum("lr,gdr->lgd", cf, Wv)
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, 1).transpose(0, 1)  # [H, L, hd]
        v = v.repeat_interleave(group, 1).transpose(0, 1)
        qf = q.float().transpose(0, 1)  # [H, n, hd]
        mask = torch.arange(L)[None, :] <= (torch.arange(n) + L - n)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=self.scaling)
        return o.transpose(0, 1)

    def _absorbed_decode(
        self, q: torch.Tensor, latents: list[torch.Tensor], Wk: torch.Tensor, Wv: torch.Tensor
    ) -> torch.Tensor:
        """One query per sequence; the history is read as latents, never expanded to K or V."""
        B, H, hd = q.shape
        Hkv = self.num_kv_heads
        group = H // Hkv
        Lmax = max(x.shape[0] for x in latents)
        C = q.new_zeros(B, Lmax, self.kv_lora_rank, dtype=torch.float32)
        pad = torch.ones(B, Lmax, dtype=torch.bool, device=q.device)
        for b, x in enumerate(latents):
            C[b, : x.shape[0]] = x.float()
            pad[b, : x.shape[0]] = False
        gamma = self.k_norm.weight.float()
        qg = (q.float() * gamma).view(B, Hkv, group, hd)
        q_lat = torch.einsum("bgjd,gdr->bgjr", qg, Wk)  # W_k,g^T (gamma * q_h)
        # Exact per-key norm scale, recomputed from each latent: 1 / rms(W_k,g c_i).
        kk = torch.einsum("blr,gdr->blgd", C, Wk)
        inv_rms = torch.rsqrt(kk.pow(2).mean(-1) + self.eps)  # [B, L, Hkv]
        scores = torch.einsum("bgjr,blr->bgjl", q_lat, C) * inv_rms.permute(0, 2, 1)[:, :, None, :]
        scores = (scores * self.scaling).masked_fill(pad[:, None, None, :], float("-inf"))
        p = torch.softmax(scores, -1)
        u = torch.einsum("bgjl,blr->bgjr", p, C)  # sum in latent space
        return torch.einsum("bgjr,gdr->bgjd", u, Wv).reshape(B, H, hd)


def _latent_attention_op(q: torch.Tensor, latent: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    get_forward_context().no_compile_layers[layer_name].attend(q, latent, output)


def _latent_attention_fake(q: torch.Tensor, latent: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


direct_register_custom_op(
    op_name="trn_latent_attention",
    op_func=_latent_attention_op,
    mutates_args=["output"],
    fake_impl=_latent_attention_fake,
)
