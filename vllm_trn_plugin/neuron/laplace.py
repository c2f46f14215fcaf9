"""Laplace through the vllm-neuron Beta contract (contract.py): ``LaplaceForCausalLM`` unchanged, its
state pages bound from the runner's recurrent caches.

Each GLA mixer is one ``RecurrentLayerSpec`` named by the mixer's prefix: two states per sequence, the
fp32 GLA state ``[H, d_k, d_v]`` and the conv window ``[conv_size - 1, D]`` (``laplace_state_shapes`` /
``laplace_state_dtypes``, the same shapes vLLM's state pool holds). A request owns one block per group
(the recurrent group's block size is ``max_model_len``), so its state slot is ``block_table[row, 0]``.

Per step the Beta metadata becomes the ``GLAStateMetadata`` the mixer already reads under vLLM:

- decode: the live rows (slot > 0; padding rows point at the null block and are left out entirely, so
  their stale block-table entries are never read or written) become ``num_decodes`` one-token rows; none
  is fresh (a Beta decode always follows that request's prefill);
- prefill (one request per step): its real tokens (the bucket's padding excluded, so the recurrence never
  sees a pad token) become one prefill; it starts from a zero state unless ``cached_seq_len`` > 0, i.e.
  a later segment of a segmented prefill, which continues from the state page.

The decode step then runs ``kernels/dispatch.gla_decode_step`` as under vLLM (NKI kernel on a Neuron
device, torch here, the emulator with ``VLLM_TRN_KERNELS=emulate``); prefill is the chunked torch path.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm_trn_plugin.neuron.contract import BetaModelAdapter, KVSpec, RecurrentLayerSpec, StepPlan, real_block_table


class LaplaceBetaModel(BetaModelAdapter):
    vllm_model_path = "vllm_trn_plugin.model_executors.laplace:LaplaceForCausalLM"
    # As LaplaceForCausalLM declares (IsAttentionFree, HasInnerState): vLLM's config reads them off the
    # class the registry resolves (no prefix caching, state pages instead of KV blocks).
    is_attention_free: ClassVar[bool] = True
    has_inner_state: ClassVar[bool] = True

    def _mixers(self) -> list[Any]:
        return [layer.mixer for layer in self.model.model.layers]

    def _first_layer_name(self) -> str:
        return self._mixers()[0].prefix

    def get_kv_spec(self) -> KVSpec:
        from vllm_trn_plugin.model_executors.laplace import laplace_state_dtypes, laplace_state_shapes

        shapes = laplace_state_shapes(self.config)
        dtypes = laplace_state_dtypes(self.dtype)
        return KVSpec(
            layers=[], recurrent_layers=[RecurrentLayerSpec(m.prefix, shapes, dtypes) for m in self._mixers()]
        )

    def bind_kv_cache(self, kv_caches: dict[str, list[torch.Tensor]]) -> None:
        """Each mixer's ``kv_cache`` becomes the runner's ``(gla_state, conv_window)`` views, as vLLM's
        ``MambaBase.bind_kv_cache`` would set them; the mixer updates them in place."""
        spec = {s.name: s for s in self.get_kv_spec().recurrent_layers}
        for mixer in self._mixers():
            states = self._cache_entry(kv_caches, mixer.prefix, 2)
            num_blocks = states[0].shape[0]
            for t, shape, dtype in zip(states, spec[mixer.prefix].shapes, spec[mixer.prefix].dtypes):
                if tuple(t.shape) != (num_blocks, *shape) or t.dtype != dtype:
                    raise ValueError(
                        f"{mixer.prefix}: state {tuple(t.shape)} {t.dtype}, expected {(num_blocks, *shape)} {dtype}"
                    )
            mixer.kv_cache = tuple(states)
        self._bound = True

    def _forward_metadata(self, plan: StepPlan, attn_metadata: dict[str, dict[str, Any]]) -> dict[str, Any]:
        from vllm_trn_plugin.model_executors.gla_state import GLAStateMetadata

        n_rows, n_tok = plan.live_rows, plan.live_tokens
        empty = torch.zeros(0, dtype=torch.long)
        out: dict[str, Any] = {}
        for mixer in self._mixers():
            meta = attn_metadata[mixer.prefix]
            slots = real_block_table(meta, n_rows)[:, 0]
            if plan.is_decode:
                out[mixer.prefix] = GLAStateMetadata(
                    num_decodes=n_rows,
                    num_prefills=0,
                    num_decode_tokens=n_tok,
                    num_actual_tokens=n_tok,
                    decode_slots=slots,
                    decode_fresh=torch.zeros(n_rows, dtype=torch.bool),
                    prefill_cu_seqlens=torch.zeros(1, dtype=torch.long),
                    prefill_slots=empty,
                    prefill_has_state=torch.zeros(0, dtype=torch.bool),
                )
            else:
                out[mixer.prefix] = GLAStateMetadata(
                    num_decodes=0,
                    num_prefills=n_rows,
                    num_decode_tokens=0,
                    num_actual_tokens=n_tok,
                    decode_slots=empty,
                    decode_fresh=torch.zeros(0, dtype=torch.bool),
                    prefill_cu_seqlens=plan.query_start_loc(),
                    prefill_slots=slots,
                    prefill_has_state=plan.context_lens > 0,
                )
        return out
