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

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from vllm_trn_plugin import envs
from vllm_trn_plugin.kernels.fp8_expert import ExpertWeights
from vllm_trn_plugin.kernels.fp8_expert import fp8_experts as fp8_experts_torch
from vllm_trn_plugin.kernels.latent_decode import latent_decode_torch
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


def _dispatched(torch_path: Callable[..., torch.Tensor], op: str, wrapper: str) -> Callable[..., torch.Tensor]:
    """The op with `torch_path`'s signature and docstring: `torch_path(*args)`, or, when a kernel runner is chosen
    for the first argument's device, `<op>_nki.<wrapper>(*args, runner)`."""

    @functools.wraps(torch_path)
    def run(*args: Any) -> torch.Tensor:
        runner = kernel_runner(args[0].device)
        if runner is None:
            return torch_path(*args)
        return _kernel_wrapper(op, wrapper)(*args, runner)

    return run


# Laplace's recurrent decode step; the state pool is updated in place.
gla_decode_step = _dispatched(simple_gla_decode_step, "simple_gla", "gla_decode_nki")
# MLA-Trinity's absorbed latent decode: one query per sequence, [B, H, hd] fp32.
latent_decode = _dispatched(latent_decode_torch, "latent_decode", "latent_decode_nki")


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
    """MLA-Trinity's routed FP8 experts (fp8_expert.fp8_experts), with the flat tensor arguments of the custom op
    model_executors/mxfp4_fp8.py registers. A stack held in bf16 (the VLLM_TRN_ALLOW_BF16 opt-in) always takes
    the torch path: the kernel is FP8 x FP8 only. `all_local` False (expert parallelism): ids < 0 name other
    ranks' experts."""
    experts = ExpertWeights(w13, s13, b13, w2, s2, b2)
    runner = kernel_runner(x.device)
    if runner is None or not experts.fp8:
        return fp8_experts_torch(x, topk_weights, topk_ids, experts)
    return _kernel_wrapper("fp8_expert", "fp8_experts_nki")(x, topk_weights, topk_ids, experts, runner, all_local)
