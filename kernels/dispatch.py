"""One dispatch per kernel op: the models call these, never a kernel or a device check directly.

Who computes (VLLM_TRN_KERNELS, read at every call so a running engine can be switched in tests):

- ``auto`` (default): the NKI kernel on a Neuron device with the genuine ``nki`` package, else torch;
- ``torch``: the exact torch path (CPU, and any device without NKI);
- ``emulate``: the NKI kernel run by the project's NumPy NKI emulator (kernels/nki_emu) inside the real
  forward pass: slow, and the same kernel source the device runs;
- ``nki``: the NKI kernel, required (an error off a Neuron device).

On device a kernel is called the way the Neuron PyTorch stack calls NKI: ``wrap_nki(kernel)[lnc](...)``
(the torch.compile-traceable higher-order op of vllm-neuron / libtorch_neuronx_lite, which carries the
in-place aliasing of the cache and state writes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_trn_plugin import envs

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
    if mode == "torch":
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
    """Laplace's recurrent decode step (kernels/simple_gla.py); the state pool is updated in place."""
    runner = kernel_runner(q.device)
    if runner is None:
        from vllm_trn_plugin.kernels.simple_gla import simple_gla_decode_step

        return simple_gla_decode_step(q, k, v, aug, log_decay, scale, state_pool, slots)
    from vllm_trn_plugin.kernels.simple_gla_nki import gla_decode_nki

    return gla_decode_nki(q, k, v, aug, log_decay, scale, state_pool, slots, runner)


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
    """MLA-Trinity's routed FP8 experts (kernels/fp8_expert.fp8_experts). A stack held in bf16 (the
    VLLM_TRN_ALLOW_BF16 opt-in) always takes the torch path: the kernel is FP8 x FP8 only. `all_local` False
    (expert parallelism): ids < 0 name other ranks' experts."""
    from vllm_trn_plugin.kernels.fp8_expert import FP8_DTYPE
    from vllm_trn_plugin.kernels.fp8_expert import fp8_experts as torch_path

    runner = kernel_runner(x.device)
    if runner is None or w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        return torch_path(x, topk_weights, topk_ids, w13, s13, b13, w2, s2, b2)
    from vllm_trn_plugin.kernels.fp8_expert_nki import fp8_experts_nki

    return fp8_experts_nki(x, topk_weights, topk_ids, w13, s13, b13, w2, s2, b2, runner, all_local)


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
) -> torch.Tensor:
    """MLA-Trinity's absorbed latent decode (kernels/latent_decode_nki.py): one query per sequence, [B, H, hd] fp32."""
    from vllm_trn_plugin.kernels import latent_decode_nki as op

    args = (q, gamma, w_k, w_v, cache, key_scales, block_table, seq_lens, scale, block_size)
    runner = kernel_runner(q.device)
    if runner is None:
        return op.latent_decode_torch(*args)
    return op.latent_decode_nki(*args, runner)
