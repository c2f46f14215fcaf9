"""A stand-in for torch-neuronx's NKI interface, to test on CPU how the plugin's kernels enter a device graph.

What it stands in for (torch-neuronx's `torch_neuronx/nki_hop.py`, read in a pre-release copy,
parmoham-aws/test-repo-parmoham @ 98154b867aa24562a3213e520d9ad7fd41032291; TorchNeuron's "How to work with NKI
kernels" page, SDK 2.33): `nki_op(name, fn=None, mutates_args={})` registers `fn` as a torch custom op (schema from
its annotations; `fn` is also the op's fake, so it must trace), `wrap_nki(kernel)[grid](*args)` launches an NKI
kernel at an LNC grid and is what `fn` calls, and `get_logical_neuron_cores()` reads NEURON_LOGICAL_NC_CONFIG. The
real `nki_op` traces into `fn`, leaving one `nki_kernel_wrapper` node per launch, and carries an in-place write
through the graph only when the kernel returns the tensor it wrote.

The stand-in keeps the custom op itself as the graph's node (one per call, its mutated arguments as declared) and
checks, when it runs: every op argument that changed is declared in `mutates_args`; every kernel input the kernel
wrote is among the tensors the kernel returns; the kernel runs in the project's NKI emulator at the launch grid with
the deployment's LNC as the compiler's, so a degree mismatch fails as neuronx-cc's NCC_EVRF066 does. Under fake
tensors (tracing), the kernel runs in the emulator on zero inputs of the same shapes to learn its outputs' shapes, as
the real fake asks NKI for them.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

launches: list[tuple[str, int]] = []  # (kernel name, grid) of every launch that ran (eager)


def get_logical_neuron_cores() -> int:
    return int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))


def nki_op(name: str, fn: Callable[..., Any] | None = None, mutates_args: str | Iterable[str] = ()) -> Any:
    mutates = (mutates_args,) if isinstance(mutates_args, str) else tuple(mutates_args)

    def register(fn: Callable[..., Any]) -> Any:
        def checked(*args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(fn).bind(*args, **kwargs)
            before = {k: v.clone() for k, v in bound.arguments.items() if isinstance(v, torch.Tensor)}
            out = fn(*args, **kwargs)
            for k, v in before.items():
                changed = not torch.equal(bound.arguments[k].view(torch.uint8), v.view(torch.uint8))
                if changed and k not in mutates:
                    raise AssertionError(f"{name}: argument {k} was written but is not in mutates_args {mutates}")
            return out

        op = torch.library.custom_op(name, mutates_args=mutates, schema=_schema(fn, mutates))(checked)
        op.register_fake(fn)
        return op

    return register if fn is None else register(fn)


def _schema(fn: Callable[..., Any], mutates: tuple[str, ...]) -> str:
    """The op's schema from fn's annotations (as torch.library infers a custom op's), without the op name."""
    from torch._library.infer_schema import infer_schema

    return infer_schema(fn, mutates_args=mutates)


class _Launcher:
    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: int | tuple[int, ...]) -> Callable[..., Any]:
        lnc = int(grid[0] if isinstance(grid, tuple) else grid)

        def run(*args: Any) -> Any:
            if any(isinstance(a, FakeTensor) for a in args):
                return _fake_outputs(self.kernel, lnc, args)
            return _launch(self.kernel, lnc, args)

        return run


def wrap_nki(nki_kernel: Any, **kwargs: Any) -> _Launcher:
    return _Launcher(nki_kernel)


def _launch(kernel: Any, lnc: int, args: tuple[Any, ...]) -> Any:
    from vllm_trn_plugin.kernels.nki_shim import simulate

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    before = [t.clone() for t in tensors]
    out = simulate(kernel[lnc], compiler_lnc=get_logical_neuron_cores())(*args)
    returned = {id(t) for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)}
    for t, b in zip(tensors, before):
        if not torch.equal(t.view(torch.uint8), b.view(torch.uint8)) and id(t) not in returned:
            raise AssertionError(
                f"{getattr(kernel, '__name__', kernel)}: wrote an input it does not return; a graph compiler carries "
                "an in-place write only as a returned alias"
            )
    launches.append((getattr(kernel, "__name__", str(kernel)), lnc))
    return out


def _fake_outputs(kernel: Any, lnc: int, args: tuple[Any, ...]) -> Any:
    """The kernel's outputs as fakes: it runs in the emulator on zero inputs of the same shapes (outside fake mode)."""
    with unset_fake_temporarily():
        zeros = [torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
        from vllm_trn_plugin.kernels.nki_shim import simulate

        out = simulate(kernel[lnc], compiler_lnc=get_logical_neuron_cores())(*zeros)
    outs = out if isinstance(out, tuple) else (out,)
    fakes = []
    for o in outs:
        alias = next((a for a, z in zip(args, zeros) if z is o), None)
        fakes.append(alias if alias is not None else torch.empty(o.shape, dtype=o.dtype))
    return tuple(fakes) if isinstance(out, tuple) else fakes[0]
