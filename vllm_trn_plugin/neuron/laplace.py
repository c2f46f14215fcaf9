"""Laplace through vLLM Neuron's model contract (contract.py): ``LaplaceForCausalLM``'s layers and weights, its
state pages bound from the runner's recurrent caches, and a static step the runner's compiler captures whole.

Each GLA mixer is one ``RecurrentLayerSpec`` named by the mixer's prefix: two states per sequence, the fp32 GLA state
``[H, d_k, d_v]`` and the conv window ``[conv_size - 1, D]`` (``laplace_state_shapes`` / ``laplace_state_dtypes``,
the shapes vLLM's state pool holds). A request owns one block per group (the recurrent group's block size is
``max_model_len``), so its state page is ``block_table[row, 0]``.

The step is the model's own forward (``LaplaceModel``: embedding, the layers' norms, mixers and MLPs, final norm)
with each mixer wrapped (``StaticMixer``) so that its state I/O reads the runner's metadata instead of vLLM's. A
step is one of two graphs per bucket, chosen by the bucket's Python ints (``is_decode``):

- decode (a width bucket of rows, one token each): the mixer's ``decode``; a row is live iff its token's slot is real
  (> 0); a dead row's GLA state page is -1 for the kernel op (neither read nor written) and its conv window the null
  block's page (read, and written back: the null block belongs to no request), so a dead row's stale block-table
  entry, which may name a live request's page, is never touched;
- prefill (one request padded to a token bucket): the mixer's ``prefill_padded`` over the first ``n = #(slot > 0)``
  tokens, from zero state unless ``cached_seq_len`` > 0 (a later segment of a segmented prefill).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from vllm_trn_plugin.neuron.contract import (
    NULL_BLOCK_ID,
    KVSpec,
    NeuronModelAdapter,
    RecurrentLayerSpec,
    StepContext,
    block_rows,
    is_decode,
    live_tokens,
)


class StaticMixer(nn.Module):
    """A ``LaplaceMixer`` in the static step: the same call (``h -> o_proj(...)``), the state I/O by the runner's
    metadata for this step (``StepContext``) through the mixer's own ``decode`` / ``prefill_padded``."""

    def __init__(self, mixer: nn.Module, step: StepContext) -> None:
        super().__init__()
        self.mixer = mixer
        self.step = step

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mixer = self.mixer
        meta = self.step.meta(mixer.prefix)
        live = live_tokens(meta)
        page = block_rows(meta)[:, 0]
        if is_decode(meta):
            o = mixer.decode(h, torch.where(live, page, NULL_BLOCK_ID), torch.where(live, page, -1))
        else:
            has_state = meta["cached_seq_len"].reshape(-1)[0] > 0
            o = mixer.prefill_padded(h, page[:1], live.sum(), has_state)
        return mixer.o_proj(o.to(h.dtype))[0]


class LaplaceNeuronModel(NeuronModelAdapter):
    vllm_model_path = "vllm_trn_plugin.model_executors.laplace:LaplaceForCausalLM"
    # As LaplaceForCausalLM declares (IsAttentionFree, HasInnerState): vLLM's config reads them off the
    # class the registry resolves (no prefix caching, state pages instead of KV blocks).
    is_attention_free: ClassVar[bool] = True
    has_inner_state: ClassVar[bool] = True

    @classmethod
    def check_config(cls, vllm_config: Any) -> dict[str, Any]:
        if vllm_config.cache_config.enable_prefix_caching:
            raise NotImplementedError(
                "--enable-prefix-caching: the Neuron adapter keeps one Laplace state page per sequence (its "
                "static step has no state checkpoints per block); prefix caching of Laplace's state runs on the vLLM "
                "path. Serve with --no-enable-prefix-caching"
            )
        return {}

    def __init__(self, vllm_config: Any, neuron_config: Any) -> None:
        super().__init__(vllm_config, neuron_config)
        self._mixers = [layer.mixer for layer in self.model.model.layers]

    def _prepare_for_device(self) -> None:
        for layer, mixer in zip(self.model.model.layers, self._mixers):
            layer.mixer = StaticMixer(mixer, self.step_context)

    def get_kv_spec(self) -> KVSpec:
        from vllm_trn_plugin.model_executors.laplace import laplace_state_dtypes, laplace_state_shapes

        shapes = laplace_state_shapes(self.config)
        dtypes = laplace_state_dtypes(self.dtype)
        return KVSpec(layers=[], recurrent_layers=[RecurrentLayerSpec(m.prefix, shapes, dtypes) for m in self._mixers])

    def bind_kv_cache(self, kv_caches: dict[str, list[torch.Tensor]]) -> None:
        """Each mixer's ``kv_cache`` becomes the runner's ``(gla_state, conv_window)`` tensors, as vLLM's
        ``MambaBase.bind_kv_cache`` would set them; the step updates them in place."""
        spec = {s.name: s for s in self.get_kv_spec().recurrent_layers}
        for mixer in self._mixers:
            states = self._cache_entry(kv_caches, mixer.prefix, 2)
            num_blocks = states[0].shape[0]
            for t, shape, dtype in zip(states, spec[mixer.prefix].shapes, spec[mixer.prefix].dtypes):
                if tuple(t.shape) != (num_blocks, *shape) or t.dtype != dtype:
                    raise ValueError(
                        f"{mixer.prefix}: state {tuple(t.shape)} {t.dtype}, expected {(num_blocks, *shape)} {dtype}"
                    )
            mixer.kv_cache = tuple(states)
        self._bound = True
