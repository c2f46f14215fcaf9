"""Laplace 3B (i14): an attention-free decoder whose every layer is a Simple GLA mixer.

Spec: docs/models.md §2 and §3. One layer, input x (D)::

    h = SiLU(causal_conv1d(LayerNorm(x)))                 width conv_size, depthwise
    q, k, v, g = W_qkvg h                                 q, k [H, d_k]; v, g [H, d_v]
    o = SimpleGLA(q, k, v) + self-augmentation            fixed geometric decay per head
    x = x + W_out(SiLU(g) * HeadRMSNorm_tier(o))
    x = x + W3(SiLU(W1 LayerNorm(x)) * W2 LayerNorm(x))

The mixer's stateful part (conv window, GLA state) runs behind one opaque custom op so that
vLLM's compiled graph never traces the metadata-dependent recurrence; its states live in
vLLM's state pool (see gla_state.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree, SupportsMambaPrefixCaching
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix
from vllm.sequence import IntermediateTensors
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheSpec

from vllm_trn_plugin.configs.laplace import LaplaceConfig
from vllm_trn_plugin.kernels import dispatch
from vllm_trn_plugin.kernels.causal_conv1d import (
    causal_conv1d_prefill,
    causal_conv1d_prefill_padded,
    causal_conv1d_window_step,
)
from vllm_trn_plugin.kernels.simple_gla import (
    geometric_log_decay,
    simple_gla_advance,
    simple_gla_chunked_prefill,
    simple_gla_prefill_padded,
    simple_gla_verify,
)
from vllm_trn_plugin.model_executors.gla_state import GLAStateBackend, GLAStateMetadata
from vllm_trn_plugin.model_executors.mxfp4_fp8 import check_all_loaded, packed_weights
from vllm_trn_plugin.model_executors.mxfp4_fp8_config import TrnMxfp4Fp8Config


def pending_tokens(vllm_config: VllmConfig) -> int:
    """Tokens whose recurrence inputs a state page keeps for a later step: the most drafts a verification row
    carries under speculative decoding (k), else none."""
    spec = vllm_config.speculative_config
    if spec is None:
        return 0
    try:  # vLLM >= 0.32 states the widest verification row (its V1 parallel drafter appends mask slots to it)
        from vllm.v1.attention.backend import max_decode_query_len
    except ImportError:  # vLLM 0.29 (vLLM Neuron's line): the sampled token and its k drafts
        return spec.num_speculative_tokens
    return max_decode_query_len(vllm_config) - 1


def laplace_state_shapes(config: LaplaceConfig, pending: int = 0) -> tuple[tuple[int, ...], ...]:
    """Per-layer state page: the GLA state [H, d_k, d_v] and the conv window [conv_size-1, D]; with `pending`
    tokens (speculative decoding) also their keys [P, H, d_k], values [P, H, d_v] and conv inputs [P, D], and
    (tokens the state covers, tokens pending) as int32 [2]."""
    H, dk, dv, D = config.num_heads, config.head_k_dim, config.head_v_dim, config.hidden_size
    shapes = ((H, dk, dv), (config.conv_size - 1, D))
    return shapes + (((pending, H, dk), (pending, H, dv), (pending, D), (2,)) if pending else ())


def laplace_state_dtypes(model_dtype: torch.dtype, pending: int = 0) -> tuple[torch.dtype, ...]:
    # The GLA state accumulates over the whole history: fp32. The conv window holds activations, as do the pending
    # keys, values and conv inputs (the recurrence reads them in the model dtype either way).
    return (torch.float32, model_dtype) + ((model_dtype,) * 3 + (torch.int32,) if pending else ())


class LaplaceMixer(MambaBase, nn.Module):
    """Conv + fused QKVG + Simple GLA + tiered head norm + SiLU(g) gate + W_out."""

    def __init__(self, config: LaplaceConfig, model_dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        D, H, dk, dv = config.hidden_size, config.num_heads, config.head_k_dim, config.head_v_dim
        self.hidden_size, self.num_heads, self.head_k_dim, self.head_v_dim = D, H, dk, dv
        self.scale = config.scale
        self.head_norm_eps = config.head_norm_eps
        self.heads_per_tier = H // config.num_decay_tiers
        self.model_dtype = model_dtype
        self.config = config
        self.prefix = prefix

        self.conv1d = nn.Conv1d(D, D, config.conv_size, groups=D, bias=True)
        self.qkvg_proj = MergedColumnParallelLinear(
            D, [H * dk, H * dk, H * dv, H * dv], bias=False, prefix=f"{prefix}.qkvg_proj"
        )
        # Held in float32 whatever the model dtype (converted once, as loaded): the recurrence and the head norm
        # compute in float32, so no step converts them.
        self.aug_balance = nn.Parameter(torch.zeros(H, dk, dtype=torch.float32))
        self.head_norm = nn.Module()
        self.head_norm.weight = nn.Parameter(torch.ones(config.num_decay_tiers, dv, dtype=torch.float32))
        self.o_proj = RowParallelLinear(H * dv, D, bias=False, prefix=f"{prefix}.o_proj")
        log_decay = geometric_log_decay(H, config.decay_t_min, config.decay_t_max)
        self.register_buffer("log_decay", log_decay, persistent=False)

        vllm_config = get_current_vllm_config()
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.pending = pending_tokens(vllm_config)
        static_ctx = vllm_config.compilation_config.static_forward_context
        if prefix in static_ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        static_ctx[prefix] = self

    # --- state pool interface (MambaBase) ---
    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return laplace_state_shapes(self.config, self.pending)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return laplace_state_dtypes(self.model_dtype, self.pending)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec | None:
        # One page per sequence under speculative decoding too: the page keeps the drafts' recurrence inputs
        # (mix_speculative), so vLLM's page per draft position is not needed.
        return dataclasses.replace(super().get_kv_cache_spec(vllm_config), num_speculative_blocks=0)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR

    def get_attn_backend(self) -> type[AttentionBackend]:
        return GLAStateBackend

    # --- forward ---
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = torch.empty(
            hidden_states.shape[0],
            self.num_heads * self.head_v_dim,
            dtype=hidden_states.dtype,
            device=hidden_states.device,
        )
        torch.ops.trn.laplace_mixer(hidden_states, out, self.prefix)
        return self.o_proj(out)[0]

    def mix(self, h: torch.Tensor, output: torch.Tensor) -> None:
        """The stateful part, run eagerly inside the custom op: writes output[:T] (T real tokens)."""
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None
        if meta is None:  # profiling / compile warm-up: no state pages bound to requests
            self.profile_prefill(h, output)
            return
        assert isinstance(meta, GLAStateMetadata)
        if self.pending:
            self.mix_speculative(h, output, meta)
            return
        T, nd = meta.num_actual_tokens, meta.num_decode_tokens
        if meta.num_decodes:
            gla_pool, conv_pool = self.kv_cache[:2]
            slots = meta.decode_slots
            fresh = slots[meta.decode_fresh & (slots >= 0)]
            gla_pool[fresh] = 0
            conv_pool[fresh] = 0
            # a padding row (-1) runs its conv window in vLLM's null block (page 0, which no request owns)
            output[:nd] = self.decode(h[:nd], slots.clamp(min=0), slots).to(output.dtype)
        if meta.num_prefills:
            o = self.prefill(h[nd:T], meta.prefill_cu_seqlens, meta.prefill_slots, meta.prefill_has_state)
            output[nd:T] = o.to(output.dtype)
        output[T:] = 0

    def mix_speculative(self, h: torch.Tensor, output: torch.Tensor, meta: GLAStateMetadata) -> None:
        """`mix` under speculative decoding (k drafts at most). Any of a row's last k tokens may be a draft: a
        verification row is the token sampled last and up to k drafts, and vLLM also sends a new one-token prompt
        with drafts, among the prefills. A row's last 1 + k tokens (its tail) are computed from the state
        (simple_gla_verify: the first as the decode step computes it, the others from the state after it); that
        state, after the tail's first token (never a draft), is written, and the other tail tokens' keys, values and
        conv inputs are kept in the page. The next step, whose context says
        how many of those vLLM accepted, moves the state over exactly them (catch_up) before anything reads it. A
        row's tokens before its tail (a prompt chunk's) go into the state at once. A rejected draft is never in a
        state, a page holds one state and k tokens' inputs, and a row without drafts costs what a decode step
        costs."""
        gla_pool, conv_pool, pend_k, pend_v, pend_h, mark = self.kv_cache
        T, k_max = meta.num_actual_tokens, pend_k.shape[1]
        cu = meta.query_cu_seqlens
        lens_h = cu[1:] - cu[:-1]
        tail_h = lens_h.clamp(max=k_max + 1)
        commit_h = lens_h - tail_h  # tokens before a row's tail
        slots = torch.cat([meta.decode_slots, meta.prefill_slots])
        live, ctx = slots >= 0, meta.context_lens.to(torch.int32)
        idx = slots.clamp(min=0)
        self.catch_up(idx[live], ctx[live])

        long_h = (commit_h > 0).nonzero().squeeze(1)
        if long_h.numel():
            n = commit_h[long_h]
            ccu = torch.cat([n.new_zeros(1), n.cumsum(0)])
            tok = (torch.repeat_interleave(cu[long_h] - ccu[:-1], n) + torch.arange(int(ccu[-1]))).to(h.device)
            rows = long_h.to(h.device)
            o = self.prefill(h[tok], ccu, slots[rows], ctx[rows] > 0)
            output[tok] = o.to(output.dtype)
        commit = commit_h.to(h.device, torch.int32)
        fresh = (ctx == 0) & (commit == 0)  # no history: from zero (vLLM does not clear a page it hands out)
        start, state = conv_pool[idx], gla_pool[idx]  # copies
        start[fresh] = 0
        state[fresh] = 0

        Pm = int(tail_h.max())
        tail = tail_h.to(h.device)
        pos = torch.arange(Pm, device=h.device)
        real = pos < tail[:, None]  # [N, Pm]
        uniform = bool((tail_h == Pm).all())  # every row Pm tokens (e.g. decodes without drafts): no masking
        tok = ((cu[:-1] + commit_h).to(h.device)[:, None] + pos).clamp(max=T - 1)  # [N, Pm]
        # the conv window steps as the decode step does
        window = start
        xs = h.new_zeros(*tok.shape, self.hidden_size)
        w, b = self.conv1d.weight[:, 0, :], self.conv1d.bias
        for i in range(Pm):
            xs[:, i], nxt = causal_conv1d_window_step(h[tok[:, i]], w, b, window)
            window = nxt if uniform else torch.where(real[:, i, None, None], nxt, window)
            if i == 0:
                first_window = window
        q, k, v, g = self.project(xs.view(-1, self.hidden_size) if uniform else xs[real])

        def rows_of(x: torch.Tensor) -> torch.Tensor:  # packed tail tokens -> [N, Pm, ...], zero past a row's end
            if uniform:
                return x.view(*tok.shape, *x.shape[1:])
            out = x.new_zeros(*tok.shape, *x.shape[1:])
            out[real] = x
            return out

        k, v = rows_of(k), rows_of(v)
        o, first_state = simple_gla_verify(rows_of(q), k, v, self.aug_balance, self.log_decay, self.scale, state, tail)
        o = o.view(-1, *o.shape[2:]) if uniform else o[real]
        output[tok.view(-1) if uniform else tok[real]] = self.gated_output(o, g).to(output.dtype)
        keep = live.nonzero().squeeze(1)
        at = idx[keep]
        if keep.numel() < live.numel():  # padding rows: nothing of theirs is written
            first_state, first_window = first_state[keep], first_window[keep]
        gla_pool.index_copy_(0, at, first_state)
        conv_pool.index_copy_(0, at, first_window)
        if Pm > 1:
            pend_k[at, : Pm - 1] = k[keep, 1:]
            pend_v[at, : Pm - 1] = v[keep, 1:]
            pend_h[at, : Pm - 1] = h[tok[keep, 1:]]
        mark[at] = torch.stack([ctx + commit + 1, tail.to(torch.int32) - 1], 1)[keep]
        output[T:] = 0

    def catch_up(self, pages: torch.Tensor, context: torch.Tensor) -> None:
        """Move each page's state and conv window over the pending tokens its sequence now has behind it: `context`
        (vLLM's computed tokens) counts the tokens a previous step verified and vLLM accepted."""
        gla_pool, conv_pool, pend_k, pend_v, pend_h, mark = self.kv_cache
        covered, held = mark[pages].unbind(1)
        n = torch.where(context > 0, context - covered, 0)
        bad = (n < 0) | (n > held)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise RuntimeError(
                f"{self.prefix}: state page {int(pages[i])} covers {int(covered[i])} tokens with {int(held[i])} "
                f"pending, and its sequence has {int(context[i])}: the page does not belong to this sequence's history"
            )
        rows = (n > 0).nonzero().squeeze(1)
        if not rows.numel():
            return
        at, n = pages[rows], n[rows]
        gla_pool[at] = simple_gla_advance(pend_k[at], pend_v[at], self.log_decay, gla_pool[at], n)
        W = conv_pool.shape[1]
        joined = torch.cat([conv_pool[at], pend_h[at]], 1)  # [R, W + P, D]: the window, then the pending inputs
        last = (n[:, None] + torch.arange(W, device=n.device)).long()  # the W inputs before the next token
        conv_pool[at] = joined.gather(1, last[..., None].expand(-1, -1, joined.shape[-1]))
        mark[at] = torch.stack([context[rows], torch.zeros_like(n)], 1)

    def profile_prefill(self, h: torch.Tensor, output: torch.Tensor) -> None:
        """The prefill of the profile run's tokens, from zero states and writing no page, laid out as the step of
        those tokens that needs the most memory: as many sequences as the scheduler admits, each of them a state
        read, handed on and written (the per-step transient vLLM's profile must see to size the cache around it)."""
        T = h.shape[0]
        N = max(1, min(self.max_num_seqs, T))
        cu = torch.linspace(0, T, N + 1).round().to(torch.int32)
        H, dk, dv = self.num_heads, self.head_k_dim, self.head_v_dim
        conv0 = h.new_zeros(N, self.config.conv_size - 1, self.hidden_size)
        x, _ = causal_conv1d_prefill(h, self.conv1d.weight[:, 0, :], self.conv1d.bias, cu, conv0)
        q, k, v, g = self.project(x)
        state0 = torch.zeros(N, H, dk, dv, dtype=torch.float32, device=h.device)
        o, _ = simple_gla_chunked_prefill(q, k, v, self.aug_balance, self.log_decay, self.scale, cu, state0)
        output[:T] = self.gated_output(o, g).to(output.dtype)

    # --- the state as both runners use it (vLLM's, above; the device step, vllm_trn_plugin/neuron/laplace.py) ---

    def decode(self, h: torch.Tensor, conv_pages: torch.Tensor, state_pages: torch.Tensor) -> torch.Tensor:
        """One token per row, h [B, D] (after the layer's norm) -> the o_proj input [B, H * dv] fp32. Row b's conv
        window is page conv_pages[b] (read and written: a padding row must name a page no request owns); its GLA
        state is page state_pages[b], -1 for a padding row (neither read nor written, output 0)."""
        gla_pool, conv_pool = self.kv_cache[:2]
        x, window = causal_conv1d_window_step(
            h, self.conv1d.weight[:, 0, :], self.conv1d.bias, conv_pool.index_select(0, conv_pages)
        )
        conv_pool.index_copy_(0, conv_pages, window)
        q, k, v, g = self.project(x)
        o = dispatch.gla_decode_step(q, k, v, self.aug_balance, self.log_decay, self.scale, gla_pool, state_pages)
        return self.gated_output(o, g)

    def prefill(
        self, h: torch.Tensor, cu_seqlens: torch.Tensor, pages: torch.Tensor, has_state: torch.Tensor
    ) -> torch.Tensor:
        """Packed prompts h [T, D] (`cu_seqlens` on the host) -> the o_proj input [T, H * dv] fp32. Sequence n
        continues from page pages[n] if has_state[n] (a later chunk), else from zero; its page is rewritten."""
        gla_pool, conv_pool = self.kv_cache[:2]
        fresh = ~has_state
        # One read of each sequence's pages (a new sequence's zeroed in place): a step of many short prompts costs
        # its tokens plus one state per sequence.
        conv0 = conv_pool[pages].masked_fill_(fresh[:, None, None], 0)
        x, conv = causal_conv1d_prefill(h, self.conv1d.weight[:, 0, :], self.conv1d.bias, cu_seqlens, conv0)
        del conv0
        q, k, v, g = self.project(x)
        state0 = gla_pool[pages].masked_fill_(fresh[:, None, None, None], 0)
        o, state = simple_gla_chunked_prefill(q, k, v, self.aug_balance, self.log_decay, self.scale, cu_seqlens, state0)
        gla_pool[pages] = state
        conv_pool[pages] = conv
        return self.gated_output(o, g)

    def prefill_padded(
        self, h: torch.Tensor, page: torch.Tensor, length: torch.Tensor, has_state: torch.Tensor
    ) -> torch.Tensor:
        """`prefill` of one prompt padded to a static length T, for a compiled graph: h [T, D] whose first `length`
        (0-d tensor) tokens are real, page [1]; padded tokens neither change the state nor reach a real output."""
        gla_pool, conv_pool = self.kv_cache[:2]
        conv0 = torch.where(has_state, conv_pool.index_select(0, page)[0], 0)
        x, conv = causal_conv1d_prefill_padded(h, self.conv1d.weight[:, 0, :], self.conv1d.bias, length, conv0)
        q, k, v, g = self.project(x)
        state0 = torch.where(has_state, gla_pool.index_select(0, page)[0], 0)
        o, state = simple_gla_prefill_padded(q, k, v, self.aug_balance, self.log_decay, self.scale, length, state0)
        gla_pool.index_copy_(0, page, state[None])
        conv_pool.index_copy_(0, page, conv[None])
        return self.gated_output(o, g)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection of the conv output x [T, D]: q, k [T, H, dk], v [T, H, dv], g [T, H * dv]."""
        H, dk, dv = self.num_heads, self.head_k_dim, self.head_v_dim
        # vLLM's CPU GEMM needs unit stride on the last dim; the conv step's einsum may hand back another layout
        q, k, v, g = self.qkvg_proj(x.contiguous())[0].split([H * dk, H * dk, H * dv, H * dv], dim=-1)
        return q.view(-1, H, dk), k.view(-1, H, dk), v.view(-1, H, dv), g

    def gated_output(self, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """SiLU(g) * HeadRMSNorm_tier(o), fp32 [T, H * dv], the input of o_proj."""
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.head_norm_eps)
        of = of * self.head_norm.weight.repeat_interleave(self.heads_per_tier, 0)
        return F.silu(g.float()) * of.reshape(o.shape[0], -1)


def _laplace_mixer_op(hidden_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    get_forward_context().no_compile_layers[layer_name].mix(hidden_states, output)


def _laplace_mixer_fake(hidden_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


direct_register_custom_op("laplace_mixer", _laplace_mixer_op, ["output"], _laplace_mixer_fake, dispatch.TRN_LIB)


class LaplaceMLP(nn.Module):
    def __init__(self, config: LaplaceConfig, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        F_ = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [F_, F_], bias=False, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            F_, config.hidden_size, bias=False, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)[0].chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)[0]


class LaplaceDecoderLayer(nn.Module):
    def __init__(
        self, config: LaplaceConfig, model_dtype: torch.dtype, quant_config: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mixer = LaplaceMixer(config, model_dtype, prefix=f"{prefix}.mixer")
        self.ffn_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = LaplaceMLP(config, quant_config, prefix=f"{prefix}.mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.attn_norm(x))
        return x + self.mlp(self.ffn_norm(x))


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class LaplaceModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: LaplaceConfig = vllm_config.model_config.hf_config
        dtype = vllm_config.model_config.dtype
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LaplaceDecoderLayer(config, dtype, vllm_config.quant_config, prefix=maybe_prefix(prefix, f"layers.{i}"))
            for i in range(config.num_hidden_layers)
        )
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.prefix = prefix

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    # Checkpoint names that vLLM fuses: (fused param, checkpoint name, shard id); the same fusion as vLLM's
    # quantization configs read it (LaplaceForCausalLM.packed_modules_mapping).
    stacked_params_mapping = [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            full = maybe_prefix(self.prefix, name)  # errors name the checkpoint tensor
            for fused, part, shard in self.stacked_params_mapping:
                if part in name:
                    target = name.replace(part, fused)
                    _param(params, target, full).weight_loader(params[target], tensor, shard)
                    break
            else:
                target = name
                param = _param(params, target, full)
                loader = getattr(param, "weight_loader", None)
                if loader is None:  # vLLM's own loaders check (and pad) shapes themselves
                    if param.shape != tensor.shape:
                        raise ValueError(
                            f"checkpoint tensor {full}: shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
                        )
                    loader = default_weight_loader
                loader(param, tensor)
            loaded.add(target)
        return loaded

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LaplaceForCausalLM(nn.Module, HasInnerState, IsAttentionFree, SupportsMambaPrefixCaching):
    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}  # for vLLM's quantization configs

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: LaplaceConfig = vllm_config.model_config.hf_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.model_dir = vllm_config.model_config.model
        self.model = LaplaceModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            quant_config=self.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        return laplace_state_shapes(vllm_config.model_config.hf_config, pending_tokens(vllm_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return laplace_state_dtypes(vllm_config.model_config.dtype, pending_tokens(vllm_config))

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[Any, Any]:
        """How vLLM's prefix caching (align mode) copies a page's states into the next page: the GLA state
        whole, and the conv window whole (vLLM's own functions, in `laplace_state_shapes` order). Speculative
        decoding, whose pages also hold pending tokens, is refused beside it (engine_checks.py)."""
        return get_temporal_copy_spec, get_conv_copy_spec

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        packed = isinstance(self.quant_config, TrnMxfp4Fp8Config)
        if packed:  # the plugin's streaming reader: errors name the file; MXFP4 arrives as FP8 rows
            weights = packed_weights(self.model_dir, self.quant_config.is_mxfp4)
        loaded = AutoWeightsLoader(self).load_weights(weights)
        if packed:  # vLLM checks completeness only for unquantized models
            check_all_loaded(self, loaded)
        return loaded


def _param(params: dict[str, nn.Parameter], target: str, name: str) -> nn.Parameter:
    if target not in params:
        raise ValueError(f"checkpoint tensor {name} has no place in LaplaceForCausalLM (expected names: spec §3)")
    return params[target]
