"""MLA-Trinity's global-layer attention: a 256-wide latent is the only thing cached.

Per KV head g with key/value up-projections W_k,g, W_v,g (rows of kv_b_proj) and the original
per-head key RMSNorm weight gamma, token i's key and value are::

    k_g,i = gamma * (W_k,g c_i) / rms(W_k,g c_i)        v_g,i = W_v,g c_i

Prefill rebuilds K and V from the cached latents and runs ordinary GQA attention. Decode is
absorbed: for query head h in group g, q~_h = W_k,g^T (gamma * q_h) (r-wide), the score of key i
is scale * (q~_h . c_i) * s_g,i with s_g,i = 1 / rms(W_k,g c_i), the softmax-weighted sum stays
in latent space (u_h = sum_i p_i c_i) and W_v,g is applied once, after. The key scale s is
data-dependent (the key norm is kept), so it cannot fold into a matrix: it is computed once, when
the latent is written, and kept in a per-layer side store indexed by the same slots (4 fp32 per
token; docs/mla-trinity.md has the measurements behind this choice).

The cache is vLLM's `MLAAttentionSpec(num_kv_heads=1, head_size=r)`: one r-wide row per token,
managed by vLLM's full-attention block manager beside the sliding-window groups. In the model dtype, or in
Trainium2's FP8 (E4M3, |x| <= 240) with one fp32 dequantization scale per token in a second side store
(`latent_cache_dtype`; kernels/latent_decode.py has the math): half the latent bytes at bf16.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.kv_cache_interface import KVCacheSpec, MLAAttentionSpec

from vllm_trn_plugin.kernels import dispatch
from vllm_trn_plugin.kernels.fp8 import FP8_DTYPE, quantize_per_token
from vllm_trn_plugin.kernels.latent_decode import dequantize_latents
from vllm_trn_plugin.model_executors.latent_cache import (
    LatentAttentionBackend,
    LatentMetadata,
    kv_heads_of_rank,
    latent_cache_dtype,
)


# Under vLLM's logger tree: vLLM configures only that one, so an INFO line elsewhere is dropped.
class TrinityLatentAttention(nn.Module, AttentionLayerBase):
    """Gated GQA attention whose keys and values come from a cached r-wide latent (no RoPE).

    Under tensor parallelism every rank computes and caches the whole latent (kv_a_proj replicated) and serves its
    own query heads (q, gate: column-parallel) and the KV heads they read (its rows of kv_b_proj, its columns of the
    key-scale store); o_proj is row-parallel, one all-reduce, as in vLLM's attention layers.
    """

    def __init__(self, config, prefix: str = "") -> None:  # noqa: ANN001  (AfmoeConfig + kv_lora_rank)
        super().__init__()
        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        if config.num_attention_heads % tp_size:
            raise ValueError(
                f"--tensor-parallel-size {tp_size} does not divide the {config.num_attention_heads} attention heads"
            )
        self.num_heads = config.num_attention_heads // tp_size
        self.kv_heads = kv_heads_of_rank(config.num_key_value_heads, tp_size, tp_rank)
        self.num_kv_heads = len(self.kv_heads)
        self.total_num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scaling = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.prefix = prefix
        H, Hkv, hd, r = config.num_attention_heads, self.num_kv_heads, self.head_dim, self.kv_lora_rank

        # Column- and row-parallel layers take the total head width and keep this rank's part.
        self.q_proj = ColumnParallelLinear(config.hidden_size, H * hd, bias=False, prefix=f"{prefix}.q_proj")
        self.kv_a_proj = ReplicatedLinear(config.hidden_size, r, bias=False, prefix=f"{prefix}.kv_a_proj")
        # Read as a matrix by the attention math itself (split per head, folded into q and the
        # output), so a plain parameter: vLLM's CPU linear methods may repack theirs.
        self.kv_b_proj = nn.Linear(r, 2 * Hkv * hd, bias=False)
        self.kv_b_proj.weight.weight_loader = self._load_kv_b_proj
        self.gate_proj = ColumnParallelLinear(config.hidden_size, H * hd, bias=False, prefix=f"{prefix}.gate_proj")
        self.o_proj = RowParallelLinear(H * hd, config.hidden_size, bias=False, prefix=f"{prefix}.o_proj")
        self.q_norm = RMSNorm(hd, eps=config.rms_norm_eps)
        # k_norm's weight is only read by the absorbed attention, in float32: held so (converted once, as loaded), so
        # no step converts it. Nothing calls k_norm as a module: the keys it normalises are never materialised.
        self.k_norm = nn.Module()
        self.k_norm.weight = nn.Parameter(torch.ones(hd, dtype=torch.float32))
        vllm_config = get_current_vllm_config()
        self.latent_dtype = latent_cache_dtype(vllm_config)
        self.max_model_len = vllm_config.model_config.max_model_len if vllm_config.model_config else 0
        self.key_scales: torch.Tensor | None = None  # [cache rows, Hkv] fp32, beside kv_cache
        self.latent_scales: torch.Tensor | None = None  # [cache rows] fp32, beside an FP8 kv_cache
        self.kv_cache = torch.tensor([])
        # W_k, W_v [Hkv, hd, r] fp32: kv_b_proj's rows as the attention math reads them, converted once when the
        # weights are loaded (`finish_loading`), so no step converts a weight.
        self.register_buffer("w_k", torch.empty(0), persistent=False)
        self.register_buffer("w_v", torch.empty(0), persistent=False)

        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return LatentAttentionBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        # One r-wide row per token, in `latent_cache_dtype` (an FP8 row is half a bf16 one, and vLLM's pool and
        # concurrency follow the spec's page size; the scale stores come out of the budget at build).
        return MLAAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=1,
            head_size=self.kv_lora_rank,
            dtype=latent_cache_dtype(vllm_config),
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        T = hidden_states.shape[0]
        q, latent = self.project(hidden_states)
        out = torch.empty(T, self.num_heads * self.head_dim, dtype=hidden_states.dtype, device=hidden_states.device)
        torch.ops.trn.latent_attention(q, latent, out, self.prefix)
        return self.gated_output(out, hidden_states)

    # --- the layer's pieces (also the Neuron adapter's static step, vllm_trn_plugin/neuron/trinity_mla.py) ---

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries after q_norm [T, H, hd] and the latents [T, r] of hidden states [T, D]."""
        T = hidden_states.shape[0]
        q = self.q_norm(self.q_proj(hidden_states)[0].view(T, self.num_heads, self.head_dim))
        return q, self.kv_a_proj(hidden_states)[0]

    def gated_output(self, out: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The layer's output from the attention output [T, H * hd]: sigmoid-gated, then o_proj (all-reduced)."""
        return self.o_proj(out * torch.sigmoid(self.gate_proj(hidden_states)[0]))[0]

    def _load_kv_b_proj(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The checkpoint's kv_b_proj ([keys of all KV heads; their values], r columns): this rank's heads' rows."""
        Hkv, hd, r = self.total_num_kv_heads, self.head_dim, self.kv_lora_rank
        if tuple(loaded.shape) != (2 * Hkv * hd, r):
            raise ValueError(
                f"checkpoint tensor {self.prefix}.kv_b_proj.weight: shape {tuple(loaded.shape)}, "
                f"model expects {(2 * Hkv * hd, r)}"
            )
        heads = loaded.view(2, Hkv, hd, r)[:, self.kv_heads.start : self.kv_heads.stop]
        param.data.copy_(heads.reshape(param.shape))

    def finish_loading(self) -> None:
        """After the checkpoint is loaded: W_k, W_v in fp32 (`kv_weights`)."""
        Hkv, hd, r = self.num_kv_heads, self.head_dim, self.kv_lora_rank
        wf = self.kv_b_proj.weight.detach().float()
        self.w_k = wf[: Hkv * hd].reshape(Hkv, hd, r).clone()
        self.w_v = wf[Hkv * hd :].reshape(Hkv, hd, r).clone()

    def kv_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_k, W_v as fp32 [Hkv, hd, r] (the rows of kv_b_proj, converted once at load)."""
        if self.w_k.dim() != 3:
            raise RuntimeError(f"{self.prefix}: kv_b_proj not loaded (finish_loading() has not run)")
        return self.w_k, self.w_v

    def key_scale(self, c: torch.Tensor, Wk: torch.Tensor) -> torch.Tensor:
        """s_g,i = 1 / rms(W_k,g c_i) for latents c [n, r]: [n, Hkv] fp32."""
        return torch.rsqrt(torch.einsum("nr,gdr->ngd", c.float(), Wk).pow(2).mean(-1) + self.eps)

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, kv_cache: torch.Tensor) -> None:
        """vLLM's latent cache for this layer, and the key-scale store beside it, allocated here so that it is in
        memory from start-up (its bytes come out of the cache budget: `reserve_key_scale_budget`). NaN: a read
        of a slot never written shows. A setter, not only `bind_kv_cache`: vLLM's runner assigns an empty tensor to
        unbind."""
        if self.__dict__.get("_kv_cache") is kv_cache:
            return
        rows = kv_cache.numel() // self.kv_lora_rank
        if rows and kv_cache.dtype != self.latent_dtype:
            raise ValueError(
                f"{self.prefix}: latent cache of dtype {kv_cache.dtype}, the layer's spec is {self.latent_dtype}"
            )
        self.__dict__["_kv_cache"] = kv_cache

        def store(*shape: int) -> torch.Tensor | None:
            return torch.full((rows, *shape), float("nan"), device=kv_cache.device) if rows else None

        self.key_scales = store(self.num_kv_heads)
        self.latent_scales = store() if self.latent_dtype == FP8_DTYPE else None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def attend(self, q: torch.Tensor, latent: torch.Tensor, output: torch.Tensor) -> None:
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None
        if meta is None:  # profiling / compile warm-up
            self.profile_attend(q, latent, output)
            return
        assert isinstance(meta, LatentMetadata)
        T, bs = meta.num_actual_tokens, meta.block_size
        valid = meta.slot_mapping >= 0
        self.write_latents(latent[:T][valid], meta.slot_mapping[valid])

        out = output[:T].view(T, self.num_heads, self.head_dim)
        qsl, seq_lens, nd = meta.query_start_loc, meta.seq_lens, meta.num_decodes
        if nd:
            out[:nd] = self.decode(q[:nd], meta.block_table[:nd], seq_lens[:nd], bs).to(out.dtype)
        for b in range(nd, len(seq_lens)):
            L = int(seq_lens[b])
            s, e = int(qsl[b]), int(qsl[b + 1])
            i = torch.arange(L, device=q.device)
            c, ks = self.read_latents(meta.block_table[b, i // bs] * bs + i % bs)
            Wk, Wv = self.kv_weights()
            # lower-right causal bias: torch's CPU flash kernel, no [H, n, L] mask or score tensor in memory
            o = self.rebuilt_attention(q[s:e], c, ks, Wk, Wv, causal_lower_right(e - s, L))
            out[s:e] = o.to(out.dtype)
        output[T:] = 0

    def profile_attend(self, q: torch.Tensor, latent: torch.Tensor, output: torch.Tensor) -> None:
        """vLLM's profile run (no attention metadata): the prefill of the step's tokens as one sequence, with the
        transient a real step has at worst beside it, the keys and values rebuilt for a max_model_len context (a
        chunked prefill's last chunk rebuilds its whole context), so the cache budget leaves room for both."""
        T = q.shape[0]
        Wk, Wv = self.kv_weights()
        rows, dequant = self.stored_latents(latent)
        c = self.latent_values(rows, dequant)
        longest = torch.zeros(2, self.num_kv_heads, max(self.max_model_len - T, 0), self.head_dim, device=q.device)
        o = self.rebuilt_attention(q, c, self.key_scale(c, Wk), Wk, Wv, causal_lower_right(T, T))
        del longest
        output[:T] = o.reshape(T, -1).to(output.dtype)
        output[T:] = 0

    # --- the cache as both runners use it (vLLM's, above; the device step, vllm_trn_plugin/neuron/trinity_mla.py) ---

    def write_latents(self, latent: torch.Tensor, slots: torch.Tensor) -> None:
        """Store latents [n, r] at cache rows `slots` [n] (every one a real row; rows count across blocks): the
        latent as the cache keeps it, an FP8 latent's dequantization scale, and the key scales computed from the
        latent as stored."""
        cache = self.kv_cache.view(-1, self.kv_lora_rank)  # a view (never a copy): the write lands in the cache
        if self.key_scales is None or self.key_scales.shape[0] != cache.shape[0]:
            raise RuntimeError(f"{self.prefix}: the latent cache was set without bind_kv_cache (no key-scale store)")
        slots = slots.long()
        rows, dequant = self.stored_latents(latent)
        cache.index_put_((slots,), rows)
        if dequant is not None:
            self.latent_scales.index_put_((slots,), dequant)
        self.key_scales.index_put_((slots,), self.key_scale(self.latent_values(rows, dequant), self.kv_weights()[0]))

    def read_latents(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latents (dequantized: an FP8 row's codes times its scale) [n, r] and key scales [n, Hkv] at cache rows
        `rows` [n]. A row never written reads whatever it holds (NaN in a fresh store): callers select it away."""
        rows = rows.long()
        stored = self.kv_cache.view(-1, self.kv_lora_rank).index_select(0, rows)
        dequant = None if self.latent_scales is None else self.latent_scales.index_select(0, rows)
        return self.latent_values(stored, dequant), self.key_scales.index_select(0, rows)

    def decode(
        self, q: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """Absorbed decode of one query per sequence (q [B, H, hd] after q_norm) over the first seq_lens[b] >= 1
        positions of each sequence's blocks (of `block_size` rows): [B, H, hd] fp32, by the kernel op
        `dispatch.latent_decode`."""
        Wk, Wv = self.kv_weights()
        return dispatch.latent_decode(
            q,
            self.k_norm.weight,
            Wk,
            Wv,
            self.kv_cache,
            self.key_scales,
            block_table,
            seq_lens,
            self.scaling,
            block_size,
            self.latent_scales,
        )

    def stored_latents(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Latents [n, r] as the cache stores them: (rows to write, their dequantization scales [n] fp32 or None).
        FP8: Trainium2 E4M3 codes with one scale per token (kernels/fp8.quantize_per_token); else the rows in
        the cache dtype."""
        if self.latent_dtype == FP8_DTYPE:
            return quantize_per_token(latent)
        return latent.to(self.latent_dtype), None

    @staticmethod
    def latent_values(rows: torch.Tensor, dequant: torch.Tensor | None) -> torch.Tensor:
        """The latents that stored cache rows [n, r] hold: the rows themselves, or FP8 codes times their per-token
        dequantization scales [n] (fp32). Prefill, the key scales and decode all read these values."""
        return rows if dequant is None else dequantize_latents(rows, dequant)

    def rebuilt_attention(
        self,
        q: torch.Tensor,
        c: torch.Tensor,
        s: torch.Tensor,
        Wk: torch.Tensor,
        Wv: torch.Tensor,
        attn_mask: torch.Tensor | Any,
    ) -> torch.Tensor:
        """Rebuild K, V from latents c [L, r] and their stored key scales s [L, Hkv] (the values decode reads, so
        both paths normalise a key identically, in fp32), then GQA of the queries q [n, H, hd] over them under
        `attn_mask` (a [n, L] bool mask, True = visible, or a torch attention bias): [n, H, hd] fp32. A key no query
        sees must still be finite (its product is taken before the mask applies)."""
        cf = c.float()
        k = torch.einsum("lr,gdr->gld", cf, Wk) * s.t()[:, :, None] * self.k_norm.weight  # [Hkv, L, hd]
        v = torch.einsum("lr,gdr->gld", cf, Wv)
        # 4-D with enable_gqa: no K/V repeated per q head.
        o = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1)[None],
            k[None],
            v[None],
            attn_mask=attn_mask,
            scale=self.scaling,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)


def _latent_attention_op(q: torch.Tensor, latent: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    get_forward_context().no_compile_layers[layer_name].attend(q, latent, output)


def _latent_attention_fake(q: torch.Tensor, latent: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


direct_register_custom_op(
    "latent_attention", _latent_attention_op, ["output"], _latent_attention_fake, dispatch.TRN_LIB
)
