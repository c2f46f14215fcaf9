"""MLA-Trinity through the vllm-neuron Beta contract (contract.py): ``TrinityMLAForCausalLM``'s layers and weights,
its caches bound from the runner's tensors, and a static step the runner's compiler captures whole.

Caches, named by each attention module's prefix (``model.layers.{i}.self_attn``):

- global (``full_attention``) layers: a ``LatentLayerSpec``, one ``kv_lora_rank``-wide latent row per token in the
  layer's ``latent_dtype`` (the model dtype, or FP8 under ``latent_cache_dtype: fp8``), bound as
  ``[num_blocks, block_size, r]``; beside it the layer's key-scale side store ``[rows, Hkv]`` fp32 and, for an FP8
  latent, its dequantization scales ``[rows]`` fp32 (allocated NaN by ``TrinityLatentAttention.bind_kv_cache``, as
  under vLLM);
- sliding layers: a ``LayerSpec`` with ``sliding_window_size``, bound as the runner's ``[k, v]``, each
  ``[num_blocks, num_kv_heads, block_size, head_dim]``.

The step is vLLM's TrinityMLAModel forward ladder written out (embedding, muP scale, per layer the four sandwich
norms around attention and MLP, final norm), calling the layers' own modules; only what touches a cache is the
adapter's own, as graph ops over the runner's tensors:

- every layer writes this step's K/V (sliding) or latent and key scale (global) at ``slot_rows(meta)`` with an
  ``index_put_`` on the bound tensor itself (never through a reshaped view, which under compile may be a copy);
  padded tokens' slots are in the null block (block 0), which no request owns;
- sliding attention: queries, keys, values, q/k norms, RoPE, gate and ``o_proj`` are ``AfmoeAttention``'s; the
  paged attention reads the rows' block tables (decode: the runner's window-trimmed table, first key at
  ``swa_kv_pos_offset``; prefill: the request's whole table). A key is visible iff its block entry is real, its
  position is <= the query's and within the window; keys no query sees are selected to 0 before any product
  (an unwritten row may hold anything), and a dead decode row's output is selected to 0;
- global attention, latent: stored as the layer's ``stored_latents`` gives it (the model dtype, or FP8 codes with a
  per-token scale written by slot beside them, ``latent_cache_dtype``); the key scale from the latent as stored;
- global attention, decode: the declared kernel op ``dispatch.latent_decode`` (with an FP8 latent's scales) over the
  runner's context-bucket table, ``seq_lens = positions + 1`` for live rows; a dead row reads one key of the null
  block (written this step by its own padded token) and its output is selected to 0;
- global attention, prefill (one request padded to a token bucket): K/V rebuilt from every row of the request's
  block table (dequantized first: an unwritten FP8 row may hold NaN), keys past the last real position or in a
  null entry selected to 0, mask key position <= query
  position (padded queries repeat the last real position), GQA in fp32 (``TrinityLatentAttention.rebuilt_attention``,
  the vLLM path's prefill with an explicit mask); a segmented prefill's earlier segments are simply earlier keys;
- MoE layers: vLLM's ``FusedMoE`` runs through an opaque op reading vLLM's forward context, and on the CPU build
  repacks its weights for its own kernel; ``_prepare_for_device`` replaces each layer's ``experts`` by
  ``BetaRoutedExperts`` (same call): vLLM's AFMoE routing in torch and the routed experts through the declared
  kernel op ``dispatch.fp8_experts`` (FP8 stacks of packed checkpoints; unquantized stacks take its torch path).

Python decisions in the step depend only on what is fixed per bucket (``is_decode``, shapes, the layer list).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_trn_plugin.kernels import dispatch
from vllm_trn_plugin.neuron.contract import (
    NULL_BLOCK_ID,
    BetaModelAdapter,
    KVSpec,
    LatentLayerSpec,
    LayerSpec,
    block_rows,
    is_decode,
    live_tokens,
    slot_rows,
)


class PagedKV(nn.Module):
    """A sliding layer's paged ``[k, v]`` cache as the runner binds it. Takes the place of vLLM's ``Attention`` in
    ``AfmoeAttention.attn`` (its backend and cache layout belong to vLLM's runner); the step does the attention."""

    def __init__(self, name: str, num_kv_heads: int, head_dim: int, window: int) -> None:
        super().__init__()
        self.name, self.num_kv_heads, self.head_dim, self.window = name, num_kv_heads, head_dim, window
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str,
    routed_scaling_factor: float,
    e_score_correction_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.32's grouped top-k routing (``fused_moe/router/cpu_router._grouped_topk``, what its FusedMoE runs for
    AFMoE), op for op: scores in fp32; the correction bias steers the group and expert choice only; the chosen
    experts' unbiased scores, renormalised, times the routed scaling factor. (fp32 weights, int32 ids)"""
    scores = router_logits.float()
    scores = torch.softmax(scores, dim=-1) if scoring_func == "softmax" else scores.sigmoid()
    T = scores.shape[0]
    original = scores
    if e_score_correction_bias is not None:
        scores = scores + e_score_correction_bias.unsqueeze(0)
        group_scores = scores.view(T, num_expert_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = scores.view(T, num_expert_group, -1).max(dim=-1).values
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(T, num_expert_group, scores.shape[-1] // num_expert_group)
    masked = scores.masked_fill(~score_mask.reshape(T, -1).bool(), float("-inf"))
    if e_score_correction_bias is not None:
        topk_ids = torch.topk(masked, k=top_k, dim=-1, sorted=False)[1]
        topk_weights = original.gather(1, topk_ids)
    else:
        topk_weights, topk_ids = torch.topk(masked, k=top_k, dim=-1, sorted=False)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int32)


class BetaRoutedExperts(nn.Module):
    """One AFMoE layer's routed and shared experts with vLLM's FusedMoE call (``experts(hidden_states=...,
    router_logits=...) -> [T, D]``), as graph ops plus the declared kernel op ``dispatch.fp8_experts``.

    Holds the routed experts' stacks as vLLM loaded them: the plugin's ``Fp8RowMoEMethod`` parameters (FP8 rows,
    row scales, bias corrections) for a packed checkpoint, else the unquantized ``w13_weight`` [E, 2I, H] (gate rows,
    then up rows) and ``w2_weight`` [E, H, I] with unit scales and zero biases (the op's torch path computes an
    unquantized stack as such). Output as vLLM's MoE runner combines it: shared + routed (the routed scaling factor
    is in the routing weights), all-reduced under tensor or expert parallelism."""

    def __init__(self, moe: nn.Module, config: Any) -> None:
        super().__init__()
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

        from vllm_trn_plugin.model_executors.mxfp4_fp8 import Fp8RowMoEMethod

        runner = moe.experts
        routed = runner.routed_experts
        method = routed.quant_method
        if isinstance(method, Fp8RowMoEMethod):
            method.process_weights_after_loading(routed)  # vLLM's post-processing no longer sees this module
            self.w13, self.w2 = routed.w13_weight, routed.w2_weight
            self.w13_s, self.w13_b = routed.w13_weight_scale, routed.w13_bias_correction
            self.w2_s, self.w2_b = routed.w2_weight_scale, routed.w2_bias_correction
        elif isinstance(method, UnquantizedFusedMoEMethod):
            self.w13, self.w2 = routed.w13_weight, routed.w2_weight
            E, I2, H = self.w13.shape
            zeros = lambda *s: torch.zeros(*s, dtype=torch.float32, device=self.w13.device)  # noqa: E731
            ones = lambda *s: torch.ones(*s, dtype=torch.float32, device=self.w13.device)  # noqa: E731
            b13, b2 = getattr(routed, "w13_bias", None), getattr(routed, "w2_bias", None)
            self.register_buffer("w13_s", ones(E, I2))
            self.register_buffer("w13_b", zeros(E, I2) if b13 is None else b13.detach().float())
            self.register_buffer("w2_s", ones(E, H))
            self.register_buffer("w2_b", zeros(E, H) if b2 is None else b2.detach().float())
        else:
            raise NotImplementedError(f"{routed.layer_name}: routed experts with {type(method).__name__}")
        expert_map = routed.expert_map  # expert parallelism: global id -> local id, -1 for another rank's
        self.register_buffer("expert_map", None if expert_map is None else expert_map.clone())
        self._shared = [moe.shared_experts] if moe.shared_experts is not None else []  # registered in the MoE layer
        self.top_k = config.num_experts_per_tok
        self.num_expert_group, self.topk_group = config.n_group, config.topk_group
        self.scoring_func = moe.score_func
        self.renormalize = moe.route_norm if moe.score_func == "sigmoid" else False
        self.routed_scaling_factor = moe.route_scale
        self.e_score_correction_bias = moe.expert_bias
        mc = runner.moe_config
        self.all_reduce = not mc.is_sequence_parallel and (mc.tp_size > 1 or mc.ep_size > 1)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = grouped_topk(
            router_logits,
            self.top_k,
            self.renormalize,
            self.num_expert_group,
            self.topk_group,
            self.scoring_func,
            self.routed_scaling_factor,
            self.e_score_correction_bias,
        )
        if self.expert_map is not None:
            topk_ids = self.expert_map.index_select(0, topk_ids.long().flatten()).view(topk_ids.shape).int()
        out = dispatch.fp8_experts(
            hidden_states,
            topk_weights,
            topk_ids,
            self.w13,
            self.w13_s,
            self.w13_b,
            self.w2,
            self.w2_s,
            self.w2_b,
            self.expert_map is None,
        )
        for shared in self._shared:
            out = shared(hidden_states) + out
        if self.all_reduce:
            from vllm.distributed import tensor_model_parallel_all_reduce

            out = tensor_model_parallel_all_reduce(out)
        return out


class TrinityMLABetaModel(BetaModelAdapter):
    vllm_model_path = "vllm_trn_plugin.model_executors.trinity_mla:TrinityMLAForCausalLM"

    def __init__(self, vllm_config: Any, neuron_config: Any) -> None:
        super().__init__(vllm_config, neuron_config)
        from vllm_trn_plugin.model_executors.trinity_mla import is_latent_layer

        self._latent: list[Any] = []  # TrinityLatentAttention of the global layers
        self._sliding: list[Any] = []  # AfmoeAttention of the sliding layers, `attn` a PagedKV
        for i, layer in enumerate(self.model.model.layers):
            attn = layer.self_attn
            if is_latent_layer(self.config, i):
                self._latent.append(attn)
                continue
            name = attn.attn.layer_name.removesuffix(".attn")
            attn.attn = PagedKV(name, attn.num_kv_heads, attn.head_dim, attn.sliding_window)
            self._sliding.append(attn)

    def _prepare_for_device(self) -> None:
        for layer in self.model.model.layers:
            if layer.moe_enabled:
                layer.mlp.experts = BetaRoutedExperts(layer.mlp, self.config)

    # --- caches ---

    def get_kv_spec(self) -> KVSpec:
        layers = [
            LayerSpec(a.attn.name, a.num_kv_heads, a.head_dim, self.dtype, sliding_window_size=a.attn.window)
            for a in self._sliding
        ]
        latent = [LatentLayerSpec(a.prefix, a.kv_lora_rank, a.latent_dtype) for a in self._latent]
        return KVSpec(layers=layers, latent_layers=latent)

    def bind_kv_cache(self, kv_caches: dict[str, list[torch.Tensor]]) -> None:
        for a in self._sliding:
            paged = a.attn
            k, v = self._cache_entry(kv_caches, paged.name, 2)
            if k.shape != v.shape or k.dim() != 4 or k.shape[1] != paged.num_kv_heads or k.shape[3] != paged.head_dim:
                raise ValueError(f"{paged.name}: K/V caches {tuple(k.shape)} / {tuple(v.shape)} do not fit this layer")
            paged.k_cache, paged.v_cache = k, v
        for a in self._latent:
            (latent,) = self._cache_entry(kv_caches, a.prefix, 1)
            if latent.dim() != 3 or latent.shape[2] != a.kv_lora_rank:
                raise ValueError(f"{a.prefix}: latent cache {tuple(latent.shape)}, expected [blocks, block_size, r]")
            a.bind_kv_cache(latent)  # allocates the key-scale store (and an FP8 latent's scale store) beside it
        self._bound = True

    # --- the step ---

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: dict[str, Any]) -> torch.Tensor:
        """TrinityMLAModel's forward over one padded step, each layer's attention in its static form."""
        from vllm_trn_plugin.model_executors.latent_attention import TrinityLatentAttention

        model = self.model.model
        positions = positions.long()
        x = model.embed_tokens(input_ids.long())
        if self.config.mup_enabled:
            x = x * (self.config.hidden_size**0.5)
        residual = None
        for layer in model.layers:
            if residual is None:
                residual, h = x, layer.input_layernorm(x)
            else:
                h, residual = layer.input_layernorm(x, residual)
            attn = layer.self_attn
            if isinstance(attn, TrinityLatentAttention):
                h = self._latent_attention(attn, h, positions, attn_metadata[attn.prefix])
            else:
                h = self._sliding_attention(attn, h, positions, attn_metadata[attn.attn.name])
            h = layer.post_attention_layernorm(h)
            h, residual = layer.pre_mlp_layernorm(h, residual)
            x = layer.post_mlp_layernorm(layer.mlp(h))
        return model.norm(x, residual)[0]

    @staticmethod
    def _latent_attention(attn: Any, h: torch.Tensor, positions: torch.Tensor, meta: dict[str, Any]) -> torch.Tensor:
        T, H, hd = h.shape[0], attn.num_heads, attn.head_dim
        cache, scales = attn.kv_cache, attn.key_scales  # [num_blocks, bs, r], [num_blocks * bs, Hkv] fp32
        dequant = attn.latent_scales  # [num_blocks * bs] fp32 for an FP8 latent, else None
        bs = cache.shape[1]
        q, latent = attn.project(h)
        Wk, Wv = attn.kv_weights()
        rows = slot_rows(meta)
        new, new_dequant = attn.stored_latents(latent)
        cache.index_put_((rows // bs, rows % bs), new)
        if dequant is not None:
            dequant.index_put_((rows,), new_dequant)
        # The key scale from the latent as stored.
        scales.index_put_((rows,), attn.key_scale(attn.latent_values(new, new_dequant), Wk))
        live = live_tokens(meta)
        if is_decode(meta):
            # A dead row reads the null block's first row, which its own padded token wrote just now.
            table = torch.where(live[:, None], block_rows(meta), NULL_BLOCK_ID)
            seq_lens = torch.where(live, positions + 1, 1)
            o = dispatch.latent_decode(
                q, attn.k_norm.weight, Wk, Wv, cache, scales, table, seq_lens, attn.scaling, bs, dequant
            )
            o = torch.where(live[:, None, None], o, 0)
        else:
            ids = block_rows(meta)[0]
            L = ids.shape[0] * bs
            key_rows = (ids[:, None] * bs + torch.arange(bs, device=ids.device)).reshape(L)
            kpos = torch.arange(L, device=ids.device)
            real = (meta["block_table_tensor"][0] > NULL_BLOCK_ID)[:, None].expand(-1, bs).reshape(L)
            seen = real & (kpos <= positions.max())  # written: this request's keys up to its last real position
            stored = cache.index_select(0, ids).reshape(L, -1)
            values = attn.latent_values(stored, None if dequant is None else dequant.index_select(0, key_rows))
            # Selected after dequantizing: an unwritten row's code or scale may be NaN, and NaN x 0 is NaN.
            c = torch.where(seen[:, None], values, 0)
            s = torch.where(seen[:, None], scales.index_select(0, key_rows), 0)
            mask = seen[None, :] & (kpos[None, :] <= positions[:, None])
            o = attn.rebuilt_attention(q, c, s, Wk, Wv, mask)
        return attn.gated_output(o.to(h.dtype).reshape(T, H * hd), h)

    @staticmethod
    def _sliding_attention(attn: Any, h: torch.Tensor, positions: torch.Tensor, meta: dict[str, Any]) -> torch.Tensor:
        """AfmoeAttention.forward with the paged attention over the runner's [k, v] (module docstring)."""
        T, H, Hkv, hd = h.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
        qkv, _ = attn.qkv_proj(h)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = attn.q_norm(q.reshape(T, H, hd)).reshape(q.shape)
        k = attn.k_norm(k.reshape(T, Hkv, hd)).reshape(k.shape)
        q, k = attn.rotary_emb(positions, q, k)

        paged = attn.attn
        kc, vc, window = paged.k_cache, paged.v_cache, paged.window
        bs = kc.shape[2]
        # This step's keys and values first (a query sees its own key), by index_put_ on the bound tensors.
        rows = slot_rows(meta)
        heads = torch.arange(Hkv, device=rows.device)
        where = ((rows // bs)[:, None], heads[None, :], (rows % bs)[:, None])
        kc.index_put_(where, k.view(T, Hkv, hd).to(kc.dtype))
        vc.index_put_(where, v.view(T, Hkv, hd).to(vc.dtype))

        ids = block_rows(meta)  # decode [P, W] (trimmed to the window), prefill [1, W] (the whole table)
        R, W = ids.shape
        L = W * bs
        first = meta.get("swa_kv_pos_offset")
        first = torch.zeros(R, dtype=torch.long, device=ids.device) if first is None else first.long()
        kpos = first[:, None] + torch.arange(L, device=ids.device)[None, :]  # [R, L]
        real = (meta["block_table_tensor"] > NULL_BLOCK_ID)[:, :, None].expand(R, W, bs).reshape(R, L)
        keys = kc.index_select(0, ids.reshape(-1)).view(R, W, Hkv, bs, hd).transpose(1, 2).reshape(R, Hkv, L, hd)
        vals = vc.index_select(0, ids.reshape(-1)).view(R, W, Hkv, bs, hd).transpose(1, 2).reshape(R, Hkv, L, hd)
        if is_decode(meta):  # row r: the one query of row r
            live = live_tokens(meta)
            qpos = positions[:, None]  # [R, 1]
            visible = real & live[:, None] & (kpos <= qpos) & (kpos > qpos - window)  # [R, L]
            seen = visible
            qr = q.view(T, H, 1, hd)  # [R, H, 1, hd]
            mask = visible[:, None, None, :]
        else:  # one row, every query of the step
            qpos = positions[:, None]  # [T, 1]
            visible = real & (kpos <= qpos) & (kpos > qpos - window)  # [T, L]
            seen = real & (kpos <= positions.max())  # [1, L]
            qr = q.view(T, H, hd).transpose(0, 1)[None]  # [1, H, T, hd]
            mask = visible[None, None]
        keys = torch.where(seen[:, None, :, None], keys, 0).float()
        vals = torch.where(seen[:, None, :, None], vals, 0).float()
        o = torch.nn.functional.scaled_dot_product_attention(
            qr.float(), keys, vals, attn_mask=mask, scale=attn.scaling, enable_gqa=True
        )
        if is_decode(meta):
            o = torch.where(live[:, None, None, None], o, 0).reshape(T, H * hd)
        else:
            o = o[0].transpose(0, 1).reshape(T, H * hd)
        gate, _ = attn.gate_proj(h)
        return attn.o_proj(o.to(h.dtype) * torch.sigmoid(gate))[0]
