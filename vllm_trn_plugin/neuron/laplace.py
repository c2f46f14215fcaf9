"""Laplace through the vllm-neuron Beta contract (contract.py): ``LaplaceForCausalLM``'s layers and weights, its
state pages bound from the runner's recurrent caches, and a static step the runner's compiler captures whole.

Each GLA mixer is one ``RecurrentLayerSpec`` named by the mixer's prefix: two states per sequence, the fp32 GLA state
``[H, d_k, d_v]`` and the conv window ``[conv_size - 1, D]`` (``laplace_state_shapes`` / ``laplace_state_dtypes``,
the shapes vLLM's state pool holds). A request owns one block per group (the recurrent group's block size is
``max_model_len``), so its state page is ``block_table[row, 0]``.

A step is one of two graphs per bucket, chosen by the bucket's Python ints (``is_decode``):

- decode (a width bucket of rows, one token each): a row is live iff its token's slot is real (> 0); a dead row's
  state page is page -1 for the GLA kernel op (neither read nor written) and the null block's page for the conv
  window (read, and written back: the null block belongs to no request), so a dead row's stale block-table entry,
  which may name a live request's page, is never touched;
- prefill (one request padded to a token bucket): the real tokens are the first ``n = #(slot > 0)``; the chunked
  GLA and the conv run over the padded bucket with what depends on ``n`` masked on device
  (kernels/simple_gla.py ``*_padded``); the sequence starts from zero state unless ``cached_seq_len`` > 0 (a later
  segment of a segmented prefill), which continues from its page; the state after its real tokens is written back.

The decode step's GLA runs through the declared kernel op ``kernels/dispatch.gla_decode_step`` (the NKI kernel on a
Neuron device, torch here, the emulator with ``VLLM_TRN_KERNELS=emulate``); everything else is graph ops.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm_trn_plugin.kernels import dispatch
from vllm_trn_plugin.kernels.simple_gla import (
    causal_conv1d_prefill_padded,
    causal_conv1d_window_step,
    simple_gla_prefill_padded,
)
from vllm_trn_plugin.neuron.contract import (
    NULL_BLOCK_ID,
    BetaModelAdapter,
    KVSpec,
    RecurrentLayerSpec,
    block_rows,
    is_decode,
    live_tokens,
)


class LaplaceBetaModel(BetaModelAdapter):
    vllm_model_path = "vllm_trn_plugin.model_executors.laplace:LaplaceForCausalLM"
    # As LaplaceForCausalLM declares (IsAttentionFree, HasInnerState): vLLM's config reads them off the
    # class the registry resolves (no prefix caching, state pages instead of KV blocks).
    is_attention_free: ClassVar[bool] = True
    has_inner_state: ClassVar[bool] = True

    def _mixers(self) -> list[Any]:
        return [layer.mixer for layer in self.model.model.layers]

    def get_kv_spec(self) -> KVSpec:
        from vllm_trn_plugin.model_executors.laplace import laplace_state_dtypes, laplace_state_shapes

        shapes = laplace_state_shapes(self.config)
        dtypes = laplace_state_dtypes(self.dtype)
        return KVSpec(
            layers=[], recurrent_layers=[RecurrentLayerSpec(m.prefix, shapes, dtypes) for m in self._mixers()]
        )

    def bind_kv_cache(self, kv_caches: dict[str, list[torch.Tensor]]) -> None:
        """Each mixer's ``kv_cache`` becomes the runner's ``(gla_state, conv_window)`` tensors, as vLLM's
        ``MambaBase.bind_kv_cache`` would set them; the step updates them in place."""
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

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: dict[str, Any]) -> torch.Tensor:
        mixers = self._mixers()
        meta = attn_metadata[mixers[0].prefix]  # one recurrent group: every mixer shares its tensors
        live = live_tokens(meta)
        page = block_rows(meta)[:, 0]
        if is_decode(meta):
            read = torch.where(live, page, NULL_BLOCK_ID)  # a dead row reads and writes the null block's page
            kernel_pages = torch.where(live, page, -1)  # the kernel op leaves page -1 alone
            mix = lambda m, h: self._decode(m, h, read, kernel_pages)  # noqa: E731
        else:
            n = live.sum()
            has_context = meta["cached_seq_len"].reshape(-1)[0] > 0
            mix = lambda m, h: self._prefill(m, h, page[:1], n, has_context)  # noqa: E731
        model = self.model.model
        x = model.embed_tokens(input_ids.long())
        for layer in model.layers:
            x = x + mix(layer.mixer, layer.attn_norm(x))
            x = x + layer.mlp(layer.ffn_norm(x))
        return model.norm(x)

    @staticmethod
    def _decode(mixer: Any, h: torch.Tensor, read: torch.Tensor, kernel_pages: torch.Tensor) -> torch.Tensor:
        gla_pool, conv_pool = mixer.kv_cache
        x, window = causal_conv1d_window_step(h, mixer.conv1d.weight[:, 0, :], mixer.conv1d.bias, conv_pool[read])
        conv_pool.index_copy_(0, read, window)
        q, k, v, g = mixer.project(x)
        o = dispatch.gla_decode_step(q, k, v, mixer.aug_balance, mixer.log_decay, mixer.scale, gla_pool, kernel_pages)
        return mixer.o_proj(mixer.gated_output(o, g).to(h.dtype))[0]

    @staticmethod
    def _prefill(
        mixer: Any, h: torch.Tensor, page: torch.Tensor, n: torch.Tensor, has_context: torch.Tensor
    ) -> torch.Tensor:
        gla_pool, conv_pool = mixer.kv_cache
        conv0 = torch.where(has_context, conv_pool.index_select(0, page)[0], 0)
        x, window = causal_conv1d_prefill_padded(h, mixer.conv1d.weight[:, 0, :], mixer.conv1d.bias, n, conv0)
        q, k, v, g = mixer.project(x)
        state0 = torch.where(has_context, gla_pool.index_select(0, page)[0], 0)
        o, state = simple_gla_prefill_padded(q, k, v, mixer.aug_balance, mixer.log_decay, mixer.scale, n, state0)
        gla_pool.index_copy_(0, page, state[None])
        conv_pool.index_copy_(0, page, window[None])
        return mixer.o_proj(mixer.gated_output(o, g).to(h.dtype))[0]
