"""MLA-Trinity through the vllm-neuron Beta contract (contract.py): ``TrinityMLAForCausalLM`` unchanged
except for the one piece vLLM supplied, the sliding layers' paged-attention call.

Caches, named by each attention module's prefix (``model.layers.{i}.self_attn``):

- global (``full_attention``) layers: a ``LatentLayerSpec`` -- one ``kv_lora_rank``-wide latent row per
  token, bound as ``[num_blocks, block_size, r]`` and used as the layer's ``kv_cache`` exactly as under
  vLLM (``TrinityLatentAttention``: cache write by slot, the per-key norm scale in its side store,
  prefill rebuilding K/V, decode through ``kernels/dispatch.latent_decode``);
- sliding layers: a ``LayerSpec`` with ``sliding_window_size``, bound as the runner's ``[k, v]``, each
  ``[num_blocks, num_kv_heads, block_size, head_dim]``.

Everything in a sliding layer but the attention itself is vLLM's ``AfmoeAttention`` (QKV, q/k norms, RoPE,
sigmoid gate, ``o_proj``). Its ``self.attn`` -- vLLM's ``Attention``, whose backend and cache layout belong
to vLLM's runner -- is replaced by ``BetaPagedAttention``: same call (``attn(q, k, v) -> [T, H * hd]``), but
it writes K/V into the runner's cache by ``slot_mapping`` (real tokens only) and reads the window through
the Beta block table, which at decode the runner has already trimmed to the window
(``swa_kv_pos_offset`` = position of its first key). The MoE layers are vLLM's AFMoE routing with the
plugin's expert methods (packed checkpoints: FP8 experts through ``kernels/dispatch.fp8_experts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm_trn_plugin.neuron.contract import (
    BetaModelAdapter,
    KVSpec,
    LatentLayerSpec,
    LayerSpec,
    StepPlan,
    real_block_table,
)


@dataclass
class PagedAttentionStep:
    """One sliding layer's view of a step: real tokens' slots and, per live row, its queries' first
    position and the blocks holding its visible keys (the first at position ``kv_offsets[row]``)."""

    slots: torch.Tensor  # [live tokens] int64
    query_start_loc: torch.Tensor  # [rows + 1]
    query_pos0: torch.Tensor  # [rows]
    block_ids: list[torch.Tensor]  # per row, int64
    kv_offsets: torch.Tensor  # [rows]


class BetaPagedAttention(nn.Module):
    """Causal sliding-window GQA over the Beta runner's paged ``[k, v]`` cache (torch; q ``[T, H*hd]``).

    Writes first, then attends, so a query sees its own key; keys outside ``[pos - window + 1, pos]``
    are removed by selection in the mask (never multiplied away: unwritten rows may hold anything).
    Computes in fp32 and returns the input dtype.
    """

    def __init__(self, name: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int) -> None:
        super().__init__()
        self.name, self.window, self.scale = name, window, scale
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        step: PagedAttentionStep = get_forward_context().attn_metadata[self.name]
        T, H, Hkv, hd = q.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        kc, vc = self.k_cache, self.v_cache
        bs = kc.shape[2]
        n = step.slots.numel()
        blk, off = step.slots // bs, step.slots % bs
        kc[blk, :, off] = k[:n].view(n, Hkv, hd).to(kc.dtype)
        vc[blk, :, off] = v[:n].view(n, Hkv, hd).to(vc.dtype)

        out = q.new_zeros(T, H * hd)
        qsl = step.query_start_loc
        for r, ids in enumerate(step.block_ids):
            s, e = int(qsl[r]), int(qsl[r + 1])
            keys = kc[ids].permute(1, 0, 2, 3).reshape(Hkv, -1, hd).float()
            vals = vc[ids].permute(1, 0, 2, 3).reshape(Hkv, -1, hd).float()
            kpos = int(step.kv_offsets[r]) + torch.arange(keys.shape[1], device=q.device)
            qpos = int(step.query_pos0[r]) + torch.arange(e - s, device=q.device)
            dist = qpos[:, None] - kpos[None, :]
            visible = (dist >= 0) & (dist < self.window)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[s:e].view(e - s, H, hd).transpose(0, 1).float()[None],
                keys[None],
                vals[None],
                attn_mask=visible,
                scale=self.scale,
                enable_gqa=True,
            )
            out[s:e] = o[0].transpose(0, 1).reshape(e - s, H * hd).to(out.dtype)
        return out


class TrinityMLABetaModel(BetaModelAdapter):
    vllm_model_path = "vllm_trn_plugin.model_executors.trinity_mla:TrinityMLAForCausalLM"

    def __init__(self, vllm_config: Any, neuron_config: Any) -> None:
        super().__init__(vllm_config, neuron_config)
        from vllm_trn_plugin.model_executors.trinity_mla import is_latent_layer

        self._latent: list[Any] = []
        self._sliding: list[tuple[str, BetaPagedAttention]] = []
        for i, layer in enumerate(self.model.model.layers):
            attn = layer.self_attn
            if is_latent_layer(self.config, i):
                self._latent.append(attn)
                continue
            name = attn.attn.layer_name.removesuffix(".attn")
            paged = BetaPagedAttention(
                name, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling, attn.sliding_window
            )
            attn.attn = paged
            self._sliding.append((name, paged))

    def _first_layer_name(self) -> str:
        return (self._sliding[0][0]) if self._sliding else self._latent[0].prefix

    def get_kv_spec(self) -> KVSpec:
        layers = [
            LayerSpec(name, a.num_kv_heads, a.head_dim, self.dtype, sliding_window_size=a.window)
            for name, a in self._sliding
        ]
        latent = [LatentLayerSpec(a.prefix, a.kv_lora_rank, self.dtype) for a in self._latent]
        return KVSpec(layers=layers, latent_layers=latent)

    def bind_kv_cache(self, kv_caches: dict[str, list[torch.Tensor]]) -> None:
        for name, attn in self._sliding:
            k, v = self._cache_entry(kv_caches, name, 2)
            if k.shape != v.shape or k.dim() != 4 or k.shape[1] != attn.num_kv_heads or k.shape[3] != attn.head_dim:
                raise ValueError(f"{name}: K/V caches {tuple(k.shape)} / {tuple(v.shape)} do not fit this layer")
            attn.k_cache, attn.v_cache = k, v
        for attn in self._latent:
            (latent,) = self._cache_entry(kv_caches, attn.prefix, 1)
            if latent.dim() != 3 or latent.shape[2] != attn.kv_lora_rank:
                raise ValueError(f"{attn.prefix}: latent cache {tuple(latent.shape)}, expected [blocks, block_size, r]")
            attn.bind_kv_cache(latent)  # allocates the key-scale store beside it
        self._bound = True

    def _forward_metadata(self, plan: StepPlan, attn_metadata: dict[str, dict[str, Any]]) -> dict[str, Any]:
        from vllm_trn_plugin.model_executors.latent_attention import LatentMetadata

        n_rows, n_tok = plan.live_rows, plan.live_tokens
        qsl, seq_lens = plan.query_start_loc(), plan.seq_lens()
        out: dict[str, Any] = {}
        for attn in self._latent:
            meta = attn_metadata[attn.prefix]
            out[attn.prefix] = LatentMetadata(
                num_decodes=n_rows if plan.is_decode else 0,
                num_actual_tokens=n_tok,
                query_start_loc=qsl,
                seq_lens=seq_lens,
                block_table=real_block_table(meta, n_rows),
                slot_mapping=meta["slot_mapping"][:n_tok].long(),
                block_size=int(meta["block_size"]),
            )
        # Layers of one cache group share the runner's tensors: their window view is built once.
        steps: dict[tuple[int, ...], PagedAttentionStep] = {}
        for name, attn in self._sliding:
            meta = attn_metadata[name]
            offsets = meta.get("swa_kv_pos_offset")
            key = (id(meta["block_table_tensor"]), id(meta["slot_mapping"]), id(offsets), attn.window)
            if key not in steps:
                steps[key] = self._window_step(name, attn.window, meta, plan, qsl, seq_lens)
            out[name] = steps[key]
        return out

    @staticmethod
    def _window_step(
        name: str,
        window: int,
        meta: dict[str, Any],
        plan: StepPlan,
        qsl: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> PagedAttentionStep:
        n_rows, n_tok = plan.live_rows, plan.live_tokens
        bs = int(meta["block_size"])
        table = real_block_table(meta, n_rows)
        offsets = meta.get("swa_kv_pos_offset")
        offsets = (
            torch.zeros(n_rows, dtype=torch.long) if offsets is None else offsets[:n_rows].to("cpu", torch.long).clone()
        )
        ids = []
        for r, (ctx, seq) in enumerate(zip(plan.context_lens.tolist(), seq_lens.tolist())):
            # Blocks from the one holding the window's first key to the one holding the last query.
            first = max(0, ctx - window + 1) - int(offsets[r])
            last = seq - 1 - int(offsets[r])
            if first < 0 or last // bs >= table.shape[1]:
                raise ValueError(f"{name}: row {r} needs keys outside its block table")
            ids.append(table[r, first // bs : last // bs + 1])
            offsets[r] += (first // bs) * bs
        return PagedAttentionStep(
            slots=meta["slot_mapping"][:n_tok].long(),
            query_start_loc=qsl,
            query_pos0=plan.context_lens,
            block_ids=ids,
            kv_offsets=offsets,
        )
