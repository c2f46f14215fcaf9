"""The three decode kernels as graph ops of the Neuron torch stack, launched at the deployment's LNC degree.

On Trainium the model graph is compiled on the native route (Dynamo -> AOTAutograd -> torch-mlir -> neuronx-cc): a
torch custom op whose body is Python (this package's ``trn::`` ops of dispatch.py) has no lowering there. TorchNeuron
documents how an NKI kernel enters such a graph: ``nki_op(name, fn, mutates_args)`` registers ``fn`` as a torch
custom op and traces into it, and inside ``fn`` ``wrap_nki(kernel)[grid](...)`` becomes one kernel node of the graph;
a cache the kernel writes in place is carried through the graph only when the kernel returns it (docs/trainium.md,
"Kernels"). So on a Neuron device each op here is ``fn`` = the op's preparation in torch ops (no host read: the
context bucket comes from the block table's width) + one ``wrap_nki`` launch:

- ``trn::nki_latent_decode``: the absorbed latent decode (latent_decode_nki.py);
- ``trn::nki_gla_decode_step``: Laplace's GLA step, ``mutates_args=("state_pool",)`` (the kernel returns the state
  rows it writes);
- ``trn::nki_fp8_experts``: the FP8 routed experts (fp8_expert_nki.py).

They are registered when this module is imported on a host with a Neuron torch stack (dispatch.py imports it at its
own import, so a graph reloaded from the precompile cache finds them), and only there: off Neuron nothing here
imports a kernel module. The grid is the deployment's LNC degree (``NEURON_LOGICAL_NC_CONFIG``, default 2 on Trn2):
neuronx-cc refuses a kernel launched at another degree (NCC_EVRF066), so a degree a kernel does not support is
refused when the ops are registered, naming the kernel, instead of at the first request.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

import torch

LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
TRN2_DEFAULT_LNC = 2  # neuronx-cc's default on Trn2 and later (NCC_EVRF066)
OPS = ("trn::nki_latent_decode", "trn::nki_gla_decode_step", "trn::nki_fp8_experts")
# kernel module -> its kernel function's name
KERNELS = {
    "latent_decode_nki": "latent_decode_kernel",
    "simple_gla_nki": "gla_decode_kernel",
    "fp8_expert_nki": "fp8_experts_kernel",
}

_registered: dict[str, Any] = {}


def neuron_torch_stack() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """``(nki_op, wrap_nki)`` of the installed Neuron torch stack, or None: torch-neuronx's (TorchNeuron 2.14+,
    ``from torch_neuronx import nki_op, wrap_nki``), else libtorch-neuronx-lite's (what vLLM Neuron compiles through
    up to SDK 2.34; its ``nki_op`` is in the private ``_compiler`` module). PyPI's placeholder packages of those names
    have neither function and count as absent."""
    try:
        tnx = importlib.import_module("torch_neuronx")
        if callable(getattr(tnx, "nki_op", None)) and callable(getattr(tnx, "wrap_nki", None)):
            return tnx.nki_op, tnx.wrap_nki
    except Exception:  # noqa: BLE001 - not installed, or a placeholder that fails to import
        pass
    try:
        compiler = importlib.import_module("libtorch_neuronx_lite._compiler")
        hop = importlib.import_module("libtorch_neuronx_lite.nki.nki_hop")
        if callable(getattr(compiler, "nki_op", None)) and callable(getattr(hop, "wrap_nki", None)):
            return compiler.nki_op, hop.wrap_nki
    except Exception:  # noqa: BLE001
        pass
    return None


def deployment_lnc() -> int:
    """The LNC degree the deployment compiles for: ``NEURON_LOGICAL_NC_CONFIG`` (which sets both neuronx-cc's
    ``--lnc`` and the kernels' launch degree), else Trn2's default, 2."""
    value = os.environ.get(LNC_ENV)
    if value is None:
        return TRN2_DEFAULT_LNC
    if value.strip() not in ("1", "2"):
        raise ValueError(f"{LNC_ENV}={value!r}: an LNC degree is 1 or 2")
    return int(value)


def check_lnc(lnc: int) -> None:
    """Refuse a deployment degree some kernel cannot run at (each ``*_nki`` module's ``LNC_DEGREES``)."""
    for module, kernel in KERNELS.items():
        degrees = importlib.import_module(f"vllm_trn_plugin.kernels.{module}").LNC_DEGREES
        if lnc not in degrees:
            raise RuntimeError(
                f"{kernel} (kernels/{module}.py) runs at LNC {' or '.join(map(str, degrees))}, and this deployment "
                f"compiles for LNC={lnc} ({LNC_ENV}); neuronx-cc refuses a kernel of another degree (NCC_EVRF066). "
                f"Serve with {LNC_ENV}={degrees[-1]}, or VLLM_TRN_KERNELS=torch"
            )


def registered() -> bool:
    return bool(_registered)


def register(nki_op: Callable[..., Any], wrap_nki: Callable[..., Any], lnc: int) -> None:
    """Register the three ops with the stack's ``nki_op``, each launching its kernel with ``wrap_nki(...)[lnc]``
    (once per process: torch's op registry is global)."""
    if _registered:
        if _registered["lnc"] != lnc:
            raise RuntimeError(f"the kernel ops are registered for LNC={_registered['lnc']}, not {lnc}")
        return
    check_lnc(lnc)
    from vllm_trn_plugin.kernels import fp8_expert_nki, latent_decode_nki, simple_gla_nki
    from vllm_trn_plugin.kernels.fp8_expert import ExpertWeights
    from vllm_trn_plugin.kernels.latent_decode import AbsorbedWeights, PagedLatents

    def launch(kernel: Any) -> Callable[..., Any]:
        return wrap_nki(kernel)[lnc]

    def nki_latent_decode(
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
        h = PagedLatents(cache, key_scales, block_table, seq_lens, block_size, latent_scales)
        bucket = latent_decode_nki.device_bucket(block_table.shape[1], block_size)
        args = latent_decode_nki.kernel_inputs(q, AbsorbedWeights(gamma, w_k, w_v, scale), h, bucket)
        return launch(latent_decode_nki.latent_decode_kernel)(*args)

    def nki_gla_decode_step(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        aug: torch.Tensor,
        log_decay: torch.Tensor,
        scale: float,
        state_pool: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        return simple_gla_nki.gla_decode_nki(q, k, v, aug, log_decay, scale, state_pool, slots, launch)

    def nki_fp8_experts(
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
        experts = ExpertWeights(w13, s13, b13, w2, s2, b2)
        return fp8_expert_nki.fp8_experts_nki(x, topk_weights, topk_ids, experts, launch, all_local)

    ops = {
        OPS[0]: nki_op(OPS[0], nki_latent_decode, mutates_args=()),
        OPS[1]: nki_op(OPS[1], nki_gla_decode_step, mutates_args=("state_pool",)),
        OPS[2]: nki_op(OPS[2], nki_fp8_experts, mutates_args=()),
    }
    _registered.update(ops, lnc=lnc)


def register_installed() -> None:
    """Register the ops if this host has a Neuron torch stack (dispatch.py calls this at import)."""
    stack = neuron_torch_stack()
    if stack is not None:
        register(*stack, deployment_lnc())
