"""MLA-Trinity through vLLM Neuron's model contract (contract.py): ``TrinityMLAForCausalLM``'s layers and weights,
its caches bound from the runner's tensors, and a step the runner's compiler captures whole.

Caches, named by each attention module's prefix (``model.layers.{i}.self_attn``):

- global (``full_attention``) layers: an MLA ``LayerSpec`` (vLLM's ``MLAAttentionSpec``: one "head" of the latent
  width), one ``kv_lora_rank``-wide latent row per token in the model dtype, bound as ``[num_blocks, 1, block_size,
  r]``; beside it the layer's key-scale side store ``[rows, Hkv]`` fp32 (allocated NaN by
  ``TrinityLatentAttention.bind_kv_cache``, as under vLLM);
- sliding layers: a SLIDING_WINDOW ``LayerSpec``, bound as the runner's ``[k, v]``, each ``[num_blocks,
  num_kv_heads, block_size, head_dim]``.

The step is the model's own forward (``TrinityMLAModel``: embedding, muP scale, vLLM's AFMoE decoder layers with their
four sandwich norms, final norm). Three parts are swapped for static forms that read the runner's metadata for the
step (``StepContext``) instead of vLLM's forward context:

- ``AfmoeAttention.attn`` (vLLM's paged ``Attention``) becomes ``PagedKV``: the layer's own projections, q/k norms,
  RoPE, gate and ``o_proj`` run as under vLLM; ``PagedKV`` writes this step's K/V by slot (``index_put_`` on the bound
  tensors) and attends over the rows' block tables (decode: the window-trimmed table, first key at
  ``swa_kv_pos_offset``; prefill: the request's whole table). A key is visible iff its block entry is real, its
  position is <= the query's and within the window; keys no query sees are selected to 0 before any product (an
  unwritten row may hold anything), and a dead decode row's output is selected to 0;
- each global layer's ``TrinityLatentAttention`` is wrapped in ``StaticLatentAttention``, which calls the layer's
  own ``project``, ``write_latents`` (latent and key scale by slot; padded tokens write into the null block),
  ``decode`` (the kernel op ``dispatch.latent_decode`` over the context-bucket table, ``seq_lens = positions + 1``
  for live rows; a dead row reads one key of the null block and its output is selected to 0) or, for a prefill,
  ``read_latents`` over every row of the request's table and ``rebuilt_attention`` with the causal mask (keys past
  the last real position or in a null entry selected to 0), then ``gated_output``;
- each MoE layer's ``experts`` (vLLM's ``FusedMoE``, an opaque op reading vLLM's forward context that repacks its
  weights for the CPU kernel) becomes ``StaticRoutedExperts`` (same call): vLLM's AFMoE routing in torch and the
  routed experts through the kernel op ``dispatch.fp8_experts`` (FP8 stacks of packed checkpoints; an unquantized
  stack takes its torch path off Neuron, and is refused on Neuron, whose kernel is FP8 only).

Python decisions in the step depend only on what is fixed per bucket (``is_decode``, shapes, the layer list).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_trn_plugin.kernels import dispatch
from vllm_trn_plugin.neuron.contract import (
    NULL_BLOCK_ID,
    CacheKind,
    KVSpec,
    LayerSpec,
    NeuronModelAdapter,
    StepContext,
    block_rows,
    is_decode,
    live_tokens,
    slot_rows,
)


class PagedKV(nn.Module):
    """A sliding layer's paged ``[k, v]`` cache as the runner binds it, and the paged attention over it. Takes the
    place of vLLM's ``Attention`` in ``AfmoeAttention.attn`` (same call: ``attn(q, k, v) -> [T, H * hd]`` after the
    q/k norms and RoPE); the positions and block tables come from the step's metadata."""

    def __init__(
        self, name: str, num_kv_heads: int, head_dim: int, window: int, scale: float, step: StepContext
    ) -> None:
        super().__init__()
        self.name, self.num_kv_heads, self.head_dim, self.window = name, num_kv_heads, head_dim, window
        self.scale, self.step = scale, step
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta, positions = self.step.meta(self.name), self.step.positions
        T, Hkv, hd = q.shape[0], self.num_kv_heads, self.head_dim
        H = q.shape[-1] // hd
        kc, vc, window = self.k_cache, self.v_cache, self.window
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
        decode = is_decode(meta)
        qpos = positions[:, None]  # [T, 1]
        visible = real & (kpos <= qpos) & (kpos > qpos - window)  # decode [R, L], row r's one query; prefill [T, L]
        if decode:  # row r: the one query of row r
            live = live_tokens(meta)
            visible = visible & live[:, None]
            seen = visible
            qr = q.view(T, H, 1, hd)  # [R, H, 1, hd]
            mask = visible[:, None, None, :]
        else:  # one row, every query of the step
            seen = real & (kpos <= positions.max())  # [1, L]
            qr = q.view(T, H, hd).transpose(0, 1)[None]  # [1, H, T, hd]
            mask = visible[None, None]
        # keys no query sees are selected to 0 before any product (an unwritten row may hold anything)
        keys = torch.where(seen[:, None, :, None], keys, 0).float()
        vals = torch.where(seen[:, None, :, None], vals, 0).float()
        o = torch.nn.functional.scaled_dot_product_attention(
            qr.float(), keys, vals, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        if decode:
            o = torch.where(live[:, None, None, None], o, 0).reshape(T, H * hd)
        else:
            o = o[0].transpose(0, 1).reshape(T, H * hd)
        return o.to(q.dtype)


class StaticLatentAttention(nn.Module):
    """A ``TrinityLatentAttention`` in the static step: the same call (``(positions, hidden_states) -> [T, D]``), its
    cache written and read through the layer's own ``write_latents`` / ``decode`` / ``read_latents`` by the runner's
    metadata for this step."""

    def __init__(self, attn: nn.Module, step: StepContext) -> None:
        super().__init__()
        self.attn = attn
        self.step = step

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        attn, meta = self.attn, self.step.meta(self.attn.prefix)
        T = hidden_states.shape[0]
        q, latent = attn.project(hidden_states)
        attn.write_latents(latent, slot_rows(meta))  # padded tokens write into the null block
        live, bs = live_tokens(meta), meta["block_size"]
        if is_decode(meta):
            # A dead row reads the null block's first row, which its own padded token wrote just now.
            table = torch.where(live[:, None], block_rows(meta), NULL_BLOCK_ID)
            o = attn.decode(q, table, torch.where(live, positions + 1, 1), bs)
            o = torch.where(live[:, None, None], o, 0)
        else:
            ids = block_rows(meta)[0]
            L = ids.shape[0] * bs
            kpos = torch.arange(L, device=ids.device)
            real = (meta["block_table_tensor"][0] > NULL_BLOCK_ID)[:, None].expand(-1, bs).reshape(L)
            seen = real & (kpos <= positions.max())  # written: this request's keys up to its last real position
            c, s = attn.read_latents((ids[:, None] * bs + torch.arange(bs, device=ids.device)).reshape(L))
            # Selected after dequantizing: an unwritten row's code or scale may be NaN, and NaN x 0 is NaN.
            c = torch.where(seen[:, None], c, 0)
            s = torch.where(seen[:, None], s, 0)
            mask = seen[None, :] & (kpos[None, :] <= positions[:, None])
            o = attn.rebuilt_attention(q, c, s, *attn.kv_weights(), mask)
        return attn.gated_output(o.to(hidden_states.dtype).reshape(T, -1), hidden_states)


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


class StaticRoutedExperts(nn.Module):
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


class TrinityMLANeuronModel(NeuronModelAdapter):
    vllm_model_path = "vllm_trn_plugin.model_executors.trinity_mla:TrinityMLAForCausalLM"

    @classmethod
    def check_config(cls, vllm_config: Any) -> dict[str, Any]:
        """The runner allocates every layer's cache in the --kv-cache-dtype (it does not read ``LayerSpec.dtype``),
        and the static step keeps the sliding layers' K/V in the model dtype: so the latent is in the model dtype
        too. An FP8 cache of either kind is refused here, naming the option, rather than at binding (after minutes
        of weight loading) or by serving another dtype than asked."""
        from vllm_trn_plugin.kernels.fp8 import FP8_DTYPE
        from vllm_trn_plugin.model_executors.latent_cache import LATENT_CACHE_DTYPE, latent_cache_dtype

        if str(vllm_config.cache_config.cache_dtype).startswith("fp8"):
            raise NotImplementedError(
                f"--kv-cache-dtype {vllm_config.cache_config.cache_dtype}: the Neuron adapter keeps MLA-Trinity's "
                "sliding layers' K/V in the model dtype (its static step has no FP8 K/V with vLLM's per-tensor k/v "
                "scales); serve with --kv-cache-dtype auto"
            )
        if latent_cache_dtype(vllm_config) == FP8_DTYPE:
            raise NotImplementedError(
                f'--additional-config {{"{LATENT_CACHE_DTYPE}": "fp8"}}: vLLM Neuron allocates every layer\'s cache in '
                "the --kv-cache-dtype, so an FP8 latent beside model-dtype sliding layers cannot be asked of it; serve "
                f'the latent in the model dtype ("{LATENT_CACHE_DTYPE}": "model") under vLLM Neuron'
            )
        return {LATENT_CACHE_DTYPE: "model"}

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
            attn.attn = PagedKV(
                name, attn.num_kv_heads, attn.head_dim, attn.sliding_window, attn.scaling, self.step_context
            )
            self._sliding.append(attn)

    def _prepare_for_device(self) -> None:
        for layer in self.model.model.layers:
            if layer.moe_enabled:
                layer.mlp.experts = StaticRoutedExperts(layer.mlp, self.config)
            if layer.self_attn in self._latent:
                layer.self_attn = StaticLatentAttention(layer.self_attn, self.step_context)

    # --- caches ---

    def get_kv_spec(self) -> KVSpec:
        sliding = [
            LayerSpec(
                a.attn.name,
                a.num_kv_heads,
                a.head_dim,
                self.dtype,
                sliding_window_size=a.attn.window,
                cache_kind=CacheKind.SLIDING_WINDOW,
            )
            for a in self._sliding
        ]
        # one r-wide latent row per token: vLLM's MLAAttentionSpec with one "KV head" of size r
        latent = [
            LayerSpec(a.prefix, 1, a.kv_lora_rank, a.latent_dtype, cache_kind=CacheKind.MLA) for a in self._latent
        ]
        return KVSpec(layers=sliding + latent)

    def bind_kv_cache(self, kv_caches: dict[str, list[torch.Tensor]]) -> None:
        for a in self._sliding:
            paged = a.attn
            k, v = self._cache_entry(kv_caches, paged.name, 2)
            if k.shape != v.shape or k.dim() != 4 or k.shape[1] != paged.num_kv_heads or k.shape[3] != paged.head_dim:
                raise ValueError(f"{paged.name}: K/V caches {tuple(k.shape)} / {tuple(v.shape)} do not fit this layer")
            if k.dtype != self.dtype:
                raise ValueError(
                    f"{paged.name}: K/V cache in {k.dtype}; the adapter keeps sliding layers in the model dtype "
                    f"{self.dtype} (serve with --kv-cache-dtype auto)"
                )
            paged.k_cache, paged.v_cache = k, v
        for a in self._latent:
            (latent,) = self._cache_entry(kv_caches, a.prefix, 1)
            if latent.dim() == 4 and latent.shape[1] == 1:  # [blocks, 1 head, block_size, r], as the runner binds MLA
                latent = latent.view(latent.shape[0], latent.shape[2], latent.shape[3])
            if latent.dim() != 3 or latent.shape[2] != a.kv_lora_rank:
                raise ValueError(
                    f"{a.prefix}: latent cache {tuple(latent.shape)}, expected "
                    f"[blocks, 1, block_size, {a.kv_lora_rank}]"
                )
            if latent.dtype != a.latent_dtype:
                raise ValueError(
                    f"{a.prefix}: the runner allocated the latent in {latent.dtype}, the layer stores "
                    f"{a.latent_dtype} (latent_cache_dtype). vLLM Neuron sizes every layer by --kv-cache-dtype and "
                    "the adapter keeps the sliding layers in the model dtype, so serve the latent in the model dtype "
                    "(latent_cache_dtype model) under this runner"
                )
            a.bind_kv_cache(latent)  # allocates the key-scale store (and an FP8 latent's scale store) beside it
        self._bound = True
