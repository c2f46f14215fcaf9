"""One dispatch per kernel op: the models call these, never a kernel or a device check directly.

Who computes (VLLM_TRN_KERNELS, read at every call so a running engine can be switched in tests):

- ``auto`` (default): the NKI kernel on a Neuron device with the genuine ``nki`` package, else torch;
- ``torch``: the exact torch path (CPU, and any device without NKI);
- ``emulate``: the NKI kernel run by the project's NumPy NKI emulator (kernels/nki_emu) inside the real
  forward pass: slow, and the same kernel source the device runs;
- ``nki``: the NKI kernel, required (an error off a Neuron device).

Each op's torch path lives in ``<op>.py`` and its kernel with the host wrapper in ``<op>_nki.py``; a
``*_nki`` module (and with it the NKI shim and, without the genuine package, the emulator) is imported
only when a kernel is to run, so the torch path never loads them.

On device a kernel is called the way the Neuron PyTorch stack calls NKI: ``wrap_nki(kernel)[lnc](...)``
(the torch.compile-traceable higher-order op of vllm-neuron / libtorch_neuronx_lite, which carries the
in-place aliasing of the cache and state writes).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from vllm_trn_plugin import envs
from vllm_trn_plugin.kernels.fp8_expert import ExpertWeights
from vllm_trn_plugin.kernels.fp8_expert import fp8_experts as fp8_experts_torch
from vllm_trn_plugin.kernels.latent_decode import AbsorbedWeights, PagedLatents, latent_decode_torch
from vllm_trn_plugin.kernels.simple_gla import simple_gla_decode_step

Runner = Callable[[Any], Callable[..., Any]]


def _device_runner(kernel: Any) -> Callable[..., Any]:
    try:  # vllm-neuron's Beta models import it from here
        from vllm_neuron.nki.nki_hop import wrap_nki  # type: ignore[import-not-found]
    except ImportError:
        from libtorch_neuronx_lite.nki.nki_hop import wrap_nki  # type: ignore[import-not-found]

    return wrap_nki(kernel)[1]


def kernel_runner(device: torch.device) -> Runner | None:
    """How to run an NKI kernel for tensors on `device`, or None for the torch path."""
    mode = envs.kernels()
    if mode == "torch" or (mode == "auto" and device.type != "neuron"):
        return None
    from vllm_trn_plugin.kernels.nki_shim import USING_EMULATOR, simulate

    if mode == "emulate":
        return simulate
    on_neuron = device.type == "neuron" and not USING_EMULATOR
    if mode == "nki" and not on_neuron:
        raise RuntimeError(
            f"{envs.KERNELS}=nki needs a Neuron device and the nki package (tensors on {device}, "
            f"nki {'missing' if USING_EMULATOR else 'present'}); use emulate or torch"
        )
    return _device_runner if on_neuron else None


def _kernel_wrapper(op: str, wrapper: str) -> Callable[..., torch.Tensor]:
    """The host wrapper `wrapper` of kernels/<op>_nki.py (the module is imported on first use)."""
    return getattr(importlib.import_module(f"vllm_trn_plugin.kernels.{op}_nki"), wrapper)


# The three decode ops as torch custom ops (namespace `trn`): a compiled graph holds each as one node, with a fake
# implementation for tracing and the cache or state it writes declared as mutated, so that under torch.compile the
# write lands in the caller's tensor (functionalization writes the op's result back into it).


@torch.library.custom_op("trn::gla_decode_step", mutates_args=("state_pool",))
def gla_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    aug: torch.Tensor,
    log_decay: torch.Tensor,
    scale: float,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Laplace's recurrent decode step (simple_gla.simple_gla_decode_step): o [B, H, dv] in q's dtype; the state of
    row b, `state_pool[slots[b]]`, is updated in place; a slot < 0 is a padding row (state untouched, output 0)."""
    runner = kernel_runner(q.device)
    if runner is None:
        return simple_gla_decode_step(q, k, v, aug, log_decay, scale, state_pool, slots)
    return _kernel_wrapper("simple_gla", "gla_decode_nki")(q, k, v, aug, log_decay, scale, state_pool, slots, runner)


@gla_decode_step.register_fake
def _(q, k, v, aug, log_decay, scale, state_pool, slots):  # noqa: ANN001, ANN202
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


@torch.library.custom_op("trn::latent_decode", mutates_args=())
def latent_decode(
    q: torch.Tensor,
    gamma: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    cache: torch.Tensor,
    key_scales: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_size: int,
    latent_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA-Trinity's absorbed latent decode (latent_decode.py): one query per sequence, [B, H, hd] fp32, from the
    layer's `AbsorbedWeights` (gamma, w_k, w_v, scale) and the batch's `PagedLatents` (cache, key_scales,
    block_table, seq_lens >= 1, block_size, and an FP8 cache's per-token latent_scales)."""
    w = AbsorbedWeights(gamma, w_k, w_v, scale)
    h = PagedLatents(cache, key_scales, block_table, seq_lens, block_size, latent_scales)
    runner = kernel_runner(q.device)
    if runner is None:
        return latent_decode_torch(q, w, h)
    return _kernel_wrapper("latent_decode", "latent_decode_nki")(q, w, h, runner)


@latent_decode.register_fake
def _(q, gamma, w_k, w_v, cache, key_scales, block_table, seq_lens, scale, block_size, latent_scales=None):  # noqa: ANN001, ANN202
    return q.new_empty(q.shape, dtype=torch.float32)


@torch.library.custom_op("trn::fp8_experts", mutates_args=())
def fp8_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    b13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    b2: torch.Tensor,
    all_local: bool,
) -> torch.Tensor:
    """MLA-Trinity's routed experts (fp8_expert.fp8_experts): x.dtype [T, H]. Which experts run depends on the
    routing, so the op chooses them itself. A stack held in bf16 or the model dtype (the VLLM_TRN_ALLOW_BF16 opt-in,
    or unquantized experts under the Beta contract) always takes the torch path: the kernel is FP8 x FP8 only.
    `all_local` False (expert parallelism): ids < 0 name other ranks' experts."""
    experts = ExpertWeights(w13, s13, b13, w2, s2, b2)
    runner = kernel_runner(x.device)
    if runner is None or not experts.fp8:
        return fp8_experts_torch(x, topk_weights, topk_ids, experts)
    return _kernel_wrapper("fp8_expert", "fp8_experts_nki")(x, topk_weights, topk_ids, experts, runner, all_local)


@fp8_experts.register_fake
def _(x, topk_weights, topk_ids, w13, s13, b13, w2, s2, b2, all_local):  # noqa: ANN001, ANN202
    return torch.empty_like(x)


# The op names as vLLM's compilation config writes them (splitting ops).
KERNEL_OPS = ("trn::gla_decode_step", "trn::latent_decode", "trn::fp8_experts")
