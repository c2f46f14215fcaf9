"""One dispatch per kernel op: the models call these, never a kernel or a device check directly.

Who computes (VLLM_TRN_KERNELS, read at every call so a running engine can be switched in tests):

- ``auto`` (default): on a Neuron device the NKI kernel, as the Neuron stack's graph op (kernels/nki_ops.py);
  elsewhere the torch path;
- ``torch``: the exact torch path (CPU, and any device without NKI);
- ``emulate``: the NKI kernel run by the project's NumPy NKI emulator (kernels/nki_emu) inside the real
  forward pass: slow, and the same kernel source the device runs;
- ``nki``: the NKI kernel as the Neuron stack's graph op, required (an error where no Neuron torch stack is
  installed).

Two forms of each op. Off Neuron, a torch custom op (namespace ``trn``, below) whose body chooses the torch path or
the emulator when it runs; a compiled graph holds it as one node. On Neuron, the op kernels/nki_ops.py registers with
the stack's ``nki_op``, which the device compiler lowers to the kernel; the choice between the two is made when the
model's graph is traced. Each op's torch path lives in ``<op>.py`` and its kernel with the host wrapper in
``<op>_nki.py``; a ``*_nki`` module (and with it the NKI shim and, without the genuine package, the emulator) is
imported only when a kernel is to run, so the torch path never loads them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from vllm_trn_plugin import envs
from vllm_trn_plugin.kernels import nki_ops
from vllm_trn_plugin.kernels.fp8 import FP8_DTYPE, quantize_per_token, row_linear, scaled_mm_products
from vllm_trn_plugin.kernels.fp8_expert import ExpertWeights
from vllm_trn_plugin.kernels.fp8_expert import fp8_experts as fp8_experts_torch
from vllm_trn_plugin.kernels.latent_decode import AbsorbedWeights, PagedLatents, latent_decode_torch
from vllm_trn_plugin.kernels.simple_gla import simple_gla_decode_step

Runner = Callable[[Any], Callable[..., Any]]


@torch._dynamo.assume_constant_result
def graph_kernels(device: torch.device) -> bool:
    """Whether the kernels enter the graph as the Neuron stack's kernel ops (kernels/nki_ops.py) for tensors on
    `device`, rather than as this module's ``trn`` ops. Decided when a graph is traced, and a constant of it (no
    guard on the environment): switching ``VLLM_TRN_KERNELS`` between torch and emulate, which the ``trn`` ops read
    when they run, never recompiles a graph."""
    mode = envs.kernels()
    if mode == "nki":
        if not nki_ops.registered():
            raise RuntimeError(
                f"{envs.KERNELS}=nki needs the Neuron torch stack (torch-neuronx or libtorch-neuronx-lite with nki): "
                "none is installed; use emulate or torch"
            )
        return True
    return mode == "auto" and device.type == "neuron" and nki_ops.registered()


def kernel_runner(device: torch.device) -> Runner | None:
    """How a ``trn`` op runs its NKI kernel: under ``emulate``, the emulator's ``simulate`` launching it at the
    deployment's LNC degree as the device would (``nki_ops.deployment_lnc``: NEURON_LOGICAL_NC_CONFIG, else 2); else
    None (the torch path; on a Neuron device the kernels are the graph ops of kernels/nki_ops.py instead)."""
    if envs.kernels() != "emulate":
        return None
    from vllm_trn_plugin.kernels.nki_shim import USING_EMULATOR, simulate

    lnc = nki_ops.deployment_lnc()
    if USING_EMULATOR:  # the emulator's stand-in for neuronx-cc's --lnc
        return lambda kernel: simulate(kernel[lnc], compiler_lnc=lnc)
    return lambda kernel: simulate(kernel[lnc])


def _kernel_wrapper(op: str, wrapper: str) -> Callable[..., torch.Tensor]:
    """The host wrapper `wrapper` of kernels/<op>_nki.py (the module is imported on first use)."""
    return getattr(importlib.import_module(f"vllm_trn_plugin.kernels.{op}_nki"), wrapper)


# The plugin's one op namespace: the kernel ops below and the models' cache ops (model_executors/: laplace_mixer,
# latent_attention, registered through vLLM's helper into this library) are all trn::<name>.
TRN_LIB = torch.library.Library("trn", "FRAGMENT")

# The three decode ops as torch custom ops (namespace `trn`): a compiled graph holds each as one node, with a fake
# implementation for tracing and the cache or state it writes declared as mutated, so that under torch.compile the
# write lands in the caller's tensor (functionalization writes the op's result back into it).


@torch.library.custom_op("trn::gla_decode_step", mutates_args=("state_pool",))
def _gla_decode_step(
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


@_gla_decode_step.register_fake
def _(q, k, v, aug, log_decay, scale, state_pool, slots):  # noqa: ANN001, ANN202
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


@torch.library.custom_op("trn::latent_decode", mutates_args=())
def _latent_decode(
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


@_latent_decode.register_fake
def _(q, gamma, w_k, w_v, cache, key_scales, block_table, seq_lens, scale, block_size, latent_scales=None):  # noqa: ANN001, ANN202
    return q.new_empty(q.shape, dtype=torch.float32)


@torch.library.custom_op("trn::fp8_experts", mutates_args=())
def _fp8_experts(
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
    c13: list[torch.Tensor],
    c2: list[torch.Tensor],
) -> torch.Tensor:
    """MLA-Trinity's routed experts (fp8_expert.fp8_experts): x.dtype [T, H]. Which experts run depends on the
    routing, so the op chooses them itself. A stack held in bf16 or the model dtype (the VLLM_TRN_ALLOW_BF16 opt-in,
    or unquantized experts off Neuron) always takes the torch path: the kernel is FP8 x FP8 only.
    `all_local` False (expert parallelism): ids < 0 name other ranks' experts. `c13`, `c2`: each expert's compute
    copies (fp8_expert.expert_compute_copies), which the torch path multiplies with, or empty lists."""
    experts = ExpertWeights(w13, s13, b13, w2, s2, b2)
    runner = kernel_runner(x.device)
    if runner is None or not experts.fp8:
        return fp8_experts_torch(x, topk_weights, topk_ids, experts, (c13, c2) if c13 else None)
    return _kernel_wrapper("fp8_expert", "fp8_experts_nki")(x, topk_weights, topk_ids, experts, runner, all_local)


@_fp8_experts.register_fake
def _(x, topk_weights, topk_ids, w13, s13, b13, w2, s2, b2, all_local, c13, c2):  # noqa: ANN001, ANN202
    return torch.empty_like(x)


@torch.library.custom_op("trn::fp8_linear", mutates_args=())
def _fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    row_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    compute: torch.Tensor | None = None,
) -> torch.Tensor:
    """A quantized linear layer (fp8.row_linear): float32 [T, N] from the weight's compute copy where it has
    one (fp8.fp8_compute_copy). One opaque node in a compiled graph: the copy is an FBGEMM handle no tracer
    can read."""
    return row_linear(x, weight, row_scale, bias, compute)


@_fp8_linear.register_fake
def _(x, weight, row_scale, bias=None, compute=None):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


# --- what the models call: the Neuron graph op on Neuron, else the trn op ---


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
    """Laplace's GLA decode step (`_gla_decode_step`): o [B, H, dv]; `state_pool[slots[b]]` updated in place."""
    op = torch.ops.trn.nki_gla_decode_step if graph_kernels(q.device) else torch.ops.trn.gla_decode_step
    return op(q, k, v, aug, log_decay, scale, state_pool, slots)


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
    """MLA-Trinity's absorbed latent decode (`_latent_decode`): [B, H, hd] fp32."""
    op = torch.ops.trn.nki_latent_decode if graph_kernels(q.device) else torch.ops.trn.latent_decode
    return op(q, gamma, w_k, w_v, cache, key_scales, block_table, seq_lens, scale, block_size, latent_scales)


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
    compute: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """MLA-Trinity's routed experts (`_fp8_experts`): x.dtype [T, H]. On Neuron the kernel is FP8 x FP8 only: an
    expert stack in another dtype is refused when the graph is traced. `compute`: the experts' compute copies for
    the torch path (fp8_expert.expert_compute_copies), or None."""
    if graph_kernels(x.device):
        if not ExpertWeights(w13, s13, b13, w2, s2, b2).fp8:
            raise NotImplementedError(
                f"routed experts in {w13.dtype} / {w2.dtype}: on Neuron the experts run in the FP8 kernel, which "
                "needs a packed checkpoint (vllm-trn pack: MXFP4 experts expanded to FP8 at load)"
            )
        return torch.ops.trn.nki_fp8_experts(x, topk_weights, topk_ids, w13, s13, b13, w2, s2, b2, all_local)
    c13, c2 = compute if compute is not None else ([], [])
    return torch.ops.trn.fp8_experts(x, topk_weights, topk_ids, w13, s13, b13, w2, s2, b2, all_local, c13, c2)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    row_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    compute: torch.Tensor | None = None,
) -> torch.Tensor:
    """A quantized linear layer (dense MLPs, shared experts, the LM head): float32 [T, N] =
    (Q(x) @ weight^T) * s_tok * row_scale + bias (fp8.fp8_linear). On Neuron the FP8 operands enter the graph
    as torch's FP8 GEMM (`_scaled_mm`, unit scales, fp32 out; the scales applied after, in fp32), never as a
    conversion of the weight; elsewhere the `trn::fp8_linear` op, from the weight's compute copy on CPU."""
    if graph_kernels(x.device):
        if weight.dtype != FP8_DTYPE:  # the VLLM_TRN_ALLOW_BF16 opt-in: unquantized, traced
            return row_linear(x, weight, row_scale, bias)
        xq, s_tok = quantize_per_token(x)
        y = scaled_mm_products(xq, weight) * s_tok[:, None] * row_scale[None, :]
        return y if bias is None else y + bias.float()
    return torch.ops.trn.fp8_linear(x, weight, row_scale, bias, compute)


nki_ops.register_installed()
