"""``nki.jit`` / ``nki.simulate`` of the emulator: argument conversion, write-back, counters.

``simulate(kernel)(*args, **kwargs)`` mirrors the simulator's execution model [SIM]: each tensor
argument (torch or NumPy) becomes an HBM tensor holding a copy of its values; the kernel runs
eagerly; input tensors the kernel wrote (any DMA into them) are copied back into the caller's
tensors in place (same storage) [SIM step 4]; returned tensors come back as the caller's container
type (torch if any argument was torch, else NumPy). A returned input (in-place update, returned as
the nki-library KV-cache kernels do [L-ABT]) comes back as the caller's own object. Non-tensor
arguments (ints, floats, tuples of them, dtypes) pass through as compile-time constants.

dtype mapping: torch.float32/bfloat16/float16/int32/int16/int8/uint8 map to the same NKI type;
``torch.float8_e4m3fn`` <-> ``nl.float8_e4m3`` by reinterpreting bits (the project convention: all
values within +-240, where the two formats agree [3P-ADP]); e4m3fn codes beyond 240 become NaN on the
way in, and e4m3 inf/NaN become e4m3fn NaN on the way out. 64-bit tensors are rejected (NKI has no
64-bit types [NL]).

Counters: ``last_counters()`` (or the ``.counters`` attribute of the callable ``simulate`` returned)
gives the ``Counters`` of the most recent kernel call.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from . import dtypes as dt
from . import errors
from .memory import Counters, KernelContext, MemoryRegion, NkiTensor, from_numpy, set_context, to_numpy

try:  # torch is optional for the emulator itself
    import torch
except ImportError:  # pragma: no cover - torch is installed in this project
    torch = None  # type: ignore[assignment]

_last: Counters | None = None


def _find_blas_threads() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """NumPy's bundled OpenBLAS thread get/set, if present. Each TensorE instruction is a small GEMM; on a
    loaded 2-core machine a multi-threaded OpenBLAS spends 5-10x longer synchronising than computing,
    so kernel runs pin it to one thread and restore the setting afterwards."""
    try:
        import ctypes
        import glob
        import os

        root = os.path.dirname(os.path.dirname(np.__file__))
        for path in glob.glob(os.path.join(root, "numpy.libs", "*openblas*")):
            lib = ctypes.CDLL(path)
            for get, set_ in (
                ("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
                ("openblas_get_num_threads", "openblas_set_num_threads"),
            ):
                if hasattr(lib, get) and hasattr(lib, set_):
                    return getattr(lib, get), getattr(lib, set_)
    except Exception:  # noqa: BLE001 - an optimisation only
        return None
    return None


BLAS_THREADS = _find_blas_threads()


class _SingleThreadBlas:
    def __enter__(self) -> None:
        self.prev = BLAS_THREADS[0]() if BLAS_THREADS else None
        if BLAS_THREADS and self.prev != 1:
            BLAS_THREADS[1](1)

    def __exit__(self, *exc: object) -> None:
        if BLAS_THREADS and self.prev is not None and self.prev != 1:
            BLAS_THREADS[1](self.prev)


def last_counters() -> Counters:
    """Counters of the most recent kernel call (a copy)."""
    if _last is None:
        raise RuntimeError("no kernel has run yet")
    return copy.deepcopy(_last)


# ---- torch / numpy conversion ---------------------------------------------------------------------
def _torch_to_numpy(t: Any) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dt.np_dtype(dt.bfloat16))
    if t.dtype == torch.float8_e4m3fn:
        bits = t.view(torch.uint8).numpy().copy()
        over = (bits & 0x7F) >= 0x78  # e4m3fn 256..448 and NaN: not representable in Trainium2 e4m3
        bits[over] = bits[over] | 0x7F
        return bits.view(dt.np_dtype(dt.float8_e4m3))
    if t.dtype == torch.float8_e5m2:
        return t.view(torch.uint8).numpy().view(dt.np_dtype(dt.float8_e5m2))
    if t.dtype in (torch.int64, torch.float64):
        raise errors.NkiValidationError(f"simulate: {t.dtype} tensors have no NKI dtype; pass int32 / float32")
    if t.dtype == torch.bool:
        return t.numpy().astype(np.uint8)
    return t.numpy()


def _numpy_to_torch(a: np.ndarray, like: Any = None) -> Any:
    a = np.ascontiguousarray(a)
    if a.dtype == dt.np_dtype(dt.bfloat16):
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    if a.dtype == dt.np_dtype(dt.float8_e4m3):
        bits = a.view(np.uint8).copy()
        special = (bits & 0x78) == 0x78  # e4m3 inf / NaN -> e4m3fn NaN
        bits[special] = bits[special] | 0x7F
        return torch.from_numpy(bits).view(torch.float8_e4m3fn)
    if a.dtype == dt.np_dtype(dt.float8_e5m2):
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e5m2)
    if a.dtype == np.uint32:
        return torch.from_numpy(a.view(np.int32).copy())
    return torch.from_numpy(a.copy())


def _is_torch(x: Any) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


class _Arg:
    def __init__(self, original: Any, tensor: NkiTensor, is_torch: bool) -> None:
        self.original = original
        self.tensor = tensor
        self.is_torch = is_torch


def _convert_in(x: Any, bound: list[_Arg], buffer: MemoryRegion, name: str) -> Any:
    if _is_torch(x):
        t = from_numpy(_torch_to_numpy(x), buffer, name)
        bound.append(_Arg(x, t, True))
        return t
    if isinstance(x, np.ndarray):
        t = from_numpy(x, buffer, name)
        bound.append(_Arg(x, t, False))
        return t
    if isinstance(x, tuple):
        return tuple(_convert_in(v, bound, buffer, f"{name}_{i}") for i, v in enumerate(x))
    if isinstance(x, list):
        return [_convert_in(v, bound, buffer, f"{name}_{i}") for i, v in enumerate(x)]
    return x


def _write_back(a: _Arg) -> None:
    st = a.tensor.storage
    vals = st.typed(st.dtype).reshape(st.shape)
    if a.is_torch:
        src = _numpy_to_torch(vals)
        if a.original.dtype != src.dtype:
            src = src.view(a.original.dtype) if src.element_size() == a.original.element_size() else src
        with torch.no_grad():
            a.original.copy_(src.reshape(a.original.shape))
    else:
        a.original[...] = vals.reshape(a.original.shape).view(a.original.dtype)


def _convert_out(r: Any, bound: list[_Arg], as_torch: bool) -> Any:
    if isinstance(r, NkiTensor):
        for a in bound:
            if a.tensor.storage is r.storage and r.shape == a.tensor.shape and r.offset == 0:
                return a.original
        if r.buffer is not MemoryRegion.shared_hbm:
            raise errors.NkiValidationError(
                f"kernel returned '{r.name}' in {r.buffer.value}; returned tensors must be nl.shared_hbm [MIG]"
            )
        vals = to_numpy(r)
        return _numpy_to_torch(vals) if as_torch else vals
    if isinstance(r, tuple):
        return tuple(_convert_out(v, bound, as_torch) for v in r)
    if isinstance(r, list):
        return [_convert_out(v, bound, as_torch) for v in r]
    return r


def _run_kernel(fn: Callable, lnc: int, args: tuple, kwargs: dict) -> Any:
    global _last
    if lnc != 1:
        raise errors.NkiValidationError("the emulator runs LNC=1 kernels only (kernel[1] or no brackets)")
    bound: list[_Arg] = []
    hargs = tuple(_convert_in(a, bound, MemoryRegion.private_hbm, f"arg{i}") for i, a in enumerate(args))
    hkwargs = {k: _convert_in(v, bound, MemoryRegion.private_hbm, k) for k, v in kwargs.items()}
    as_torch = any(a.is_torch for a in bound)
    kctx = KernelContext()
    kctx.runner_code = _run_kernel.__code__
    prev = set_context(kctx)
    try:
        with _SingleThreadBlas():
            result = fn(*hargs, **hkwargs)
    finally:
        set_context(prev)
        _last = kctx.counters
    for a in bound:
        if a.tensor.storage.written:
            _write_back(a)
    return _convert_out(result, bound, as_torch)


class Kernel:
    """What ``nki.jit`` returns [NKI]: calling it runs the kernel in the emulator (as
    ``NKI_SIMULATOR=1`` does [SIM]); ``kernel[lnc]`` selects the LNC degree (1 only here)."""

    def __init__(self, fn: Callable, lnc: int = 1, **options: Any) -> None:
        self.fn = fn
        self.lnc = lnc
        self.options = options
        functools.update_wrapper(self, fn)

    def __getitem__(self, lnc: int) -> Kernel:
        if not isinstance(lnc, int):
            raise errors.NkiValidationError("kernel[lnc]: exactly one integer LNC degree [LNC]")
        return Kernel(self.fn, lnc, **self.options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _run_kernel(self.fn, self.lnc, args, kwargs)


def jit(fn: Callable | None = None, **kwargs: Any) -> Any:
    """``nki.jit(fn=None, **kwargs)`` [NKI]: usable as ``@nki.jit`` or ``@nki.jit(...)``."""
    if fn is None:
        return lambda f: Kernel(f, **kwargs)
    return Kernel(fn, **kwargs)


class Simulated:
    """The callable ``simulate(kernel)`` returns; ``.counters`` holds the last call's counters."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
        self.counters: Counters | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.kernel(*args, **kwargs)
        finally:
            self.counters = copy.deepcopy(_last)


def simulate(kernel: Any) -> Simulated:
    """``nki.simulate(kernel)`` [NKI, SIM]: a callable taking torch tensors or NumPy arrays."""
    return Simulated(kernel)
