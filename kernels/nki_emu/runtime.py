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

LNC (docs/nki.md section 1.4). Two degrees meet at a launch, as on the device [EVRF066, LNC-233]:
- the kernel's: ``kernel[n](...)`` (the bracket launch, being deprecated), else ``NEURON_LOGICAL_NC_CONFIG``,
  else 1 (a bare ``kernel(...)`` "implicitly defaults to LNC=1");
- the compiler's (the deployment's): ``simulate(kernel, compiler_lnc=n)``, else ``--lnc`` / ``--logical-nc-config``
  in ``NEURON_CC_FLAGS``, else ``NEURON_LOGICAL_NC_CONFIG``, else ``DEFAULT_COMPILER_LNC`` = 1. neuronx-cc itself
  defaults to LNC=2 on Trn2 [EVRF066]; the emulator keeps 1 so that a bare call runs as before, and a test of a
  deployment passes ``compiler_lnc=2`` (or sets the variable) explicitly.
A launch whose two degrees differ raises ``errors.LncError`` with NCC_EVRF066's message, naming both degrees.
At LNC=2 the kernel function runs once per program (``nl.program_id(0)`` 0 then 1, ``nl.num_programs(0)`` 2), one
program at a time on the calling process: tensor arguments (placed in shared HBM) and ``nl.shared_hbm``
allocations are shared (one allocation site, one tensor: ``Launch.shared_hbm``); SBUF, PSUM, ``nl.hbm``
(private HBM) allocations, registers, accumulator registers and counters are the program's own. A program runs
until it returns or reaches a cross-core operation (``nisa.core_barrier`` / ``nisa.sendrecv``, module ``lnc``);
there it waits for the other program to reach its matching operation (the n-th of that kind, in program order
[LNC-SR]), so writes made before a barrier are visible to both programs after it. The programs must return the
same outputs (the same shared tensors), else ``errors.LncError``.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from . import dtypes as dt
from . import errors
from .memory import (
    Counters,
    KernelContext,
    MemoryRegion,
    NkiTensor,
    Storage,
    ctx,
    from_numpy,
    set_context,
    to_numpy,
)

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


# ---- LNC degrees [EVRF066, LNC-233, LNC] -----------------------------------------------------------
ENV_LNC = "NEURON_LOGICAL_NC_CONFIG"
ENV_CC_FLAGS = "NEURON_CC_FLAGS"
DEFAULT_COMPILER_LNC = 1  # neuronx-cc's Trn2 default is 2 [EVRF066]; 1 keeps bare calls working (module docstring)
SUPPORTED_LNC = (1, 2)  # "an LNC degree ... of either 1 or 2" [LNC-233]
_CC_LNC = re.compile(r"(?:^|\s)(?:--lnc|--logical-nc-config|-lnc)(?:=|\s+)(\S+)")


def _degree(value: Any, where: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise errors.LncError(f"{where}: LNC degree must be an integer, got {value!r}") from None
    if n not in SUPPORTED_LNC:
        raise errors.LncError(
            f"{where}: LNC degree {n} is not supported (the Neuron SDK supports 1 or 2; a degree too large for the "
            "architecture is an error [LNC-233, LNC])"
        )
    return n


def compiler_lnc(explicit: int | None = None) -> int:
    """The compiler's (deployment's) LNC degree: ``explicit``, else ``--lnc`` in ``NEURON_CC_FLAGS``, else
    ``NEURON_LOGICAL_NC_CONFIG``, else ``DEFAULT_COMPILER_LNC`` [EVRF066]."""
    if explicit is not None:
        return _degree(explicit, "simulate(compiler_lnc=...)")
    m = _CC_LNC.search(os.environ.get(ENV_CC_FLAGS, ""))
    if m:
        return _degree(m.group(1), ENV_CC_FLAGS)
    env = os.environ.get(ENV_LNC, "").strip()
    if env:
        return _degree(env, ENV_LNC)
    return DEFAULT_COMPILER_LNC


def kernel_lnc(bracket: int | None) -> int:
    """The kernel's LNC degree: the bracket launch's, else ``NEURON_LOGICAL_NC_CONFIG``, else 1 [EVRF066, LNC-233]."""
    if bracket is not None:
        return bracket
    env = os.environ.get(ENV_LNC, "").strip()
    return _degree(env, ENV_LNC) if env else 1


# ---- one launch: programs, shared HBM, cross-core rendezvous ----------------------------------------------
class _Aborted(BaseException):
    """Unwinds a waiting program after another program failed (never reaches the caller)."""


class Launch:
    """What the programs of one kernel call share: the shared-HBM allocations and the cross-core rendezvous.

    Programs run one at a time (a baton passes between their threads only when the running program returns or
    waits at a cross-core operation), so a launch is deterministic: with no cross-core operation, program 0 runs to
    its end, then program 1.
    """

    def __init__(self, kernel_name: str, contexts: list[KernelContext]) -> None:
        self.kernel_name = kernel_name
        self.contexts = contexts
        self.num_programs = len(contexts)
        self._shared: dict[tuple, Storage] = {}
        self._cond = threading.Condition()
        self._turn = 0
        self._state = ["ready"] * self.num_programs  # ready | blocked | done
        self._waiting: dict[int, str] = {}  # program -> what it waits at (for error messages)
        self._seq: list[dict[str, int]] = [{} for _ in contexts]  # per program, per kind: operations reached
        self._posts: dict[tuple[str, int], dict[int, Any]] = {}
        self._error: BaseException | None = None
        self._aborted = False
        self.results: list[Any] = [None] * self.num_programs
        for c in contexts:
            c.launch = self

    # ---- shared HBM [LNC] ----
    def shared_hbm(
        self, kctx: KernelContext, shape: tuple[int, ...], dtype: str, fresh: Callable[[], Storage]
    ) -> Storage:
        """The storage of a ``shared_hbm`` allocation: program p's n-th allocation at a source site is the same
        tensor in every program (the LNC overview's example allocates the output in the kernel body and each core
        writes its part of it [LNC, LNC-233]); a different shape or dtype there is an error."""
        if self.num_programs == 1:
            return fresh()
        site = kctx.site()
        n = kctx.hbm_site_counts.get(site, 0)
        kctx.hbm_site_counts[site] = n + 1
        st = self._shared.get((site, n))
        if st is None:
            st = self._shared[(site, n)] = fresh()
        elif st.shape != shape or st.dtype != dtype:
            where = ", ".join(f"{os.path.basename(f)}:{ln}" for f, ln in site[:2])
            raise errors.LncError(
                f"nl.ndarray(buffer=nl.shared_hbm) at {where}: program {kctx.program_id} allocates {shape} {dtype}, "
                f"another program allocated {st.shape} {st.dtype} there; a shared HBM tensor is one tensor for "
                "every program of an LNC launch"
            )
        return st

    # ---- running the programs ----
    def run(self, fn: Callable, args: tuple, kwargs: dict) -> list[Any]:
        """Run ``fn`` once per program; returns each program's result."""
        if self.num_programs == 1:
            prev = set_context(self.contexts[0])
            try:
                self.results[0] = fn(*args, **kwargs)
            finally:
                set_context(prev)
            return self.results
        prev = set_context(None)
        threads = [
            # daemon: an interrupted launch never keeps the interpreter alive with a program waiting for its turn
            threading.Thread(
                target=self._program_main, args=(p, fn, args, kwargs), name=f"nki-program-{p}", daemon=True
            )
            for p in range(self.num_programs)
        ]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            set_context(prev)
        if self._error is not None:
            raise self._error
        return self.results

    def _program_main(self, p: int, fn: Callable, args: tuple, kwargs: dict) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == p or self._aborted)
            if self._aborted:
                return
        set_context(self.contexts[p])
        try:
            result = fn(*args, **kwargs)
        except _Aborted:
            return
        except BaseException as exc:  # noqa: BLE001 - re-raised by run() in the caller's thread
            with self._cond:
                if self._error is None:
                    self._error = exc
                self._aborted = True
                self._state[p] = "done"
                self._cond.notify_all()
            return
        with self._cond:
            self.results[p] = result
            self._state[p] = "done"
            self._pass_baton(p)

    def _pass_baton(self, p: int) -> None:
        """Called with the lock held when program p returns or waits: the next ready program runs; if none is ready
        while some wait, they wait for an operation the others never reach (an error)."""
        n = self.num_programs
        for k in range(1, n + 1):
            q = (p + k) % n
            if self._state[q] == "ready":
                self._turn = q
                self._cond.notify_all()
                return
        if self._waiting and self._error is None:
            parts = []
            for q in range(n):
                if q in self._waiting:
                    parts.append(f"program {q} waits at {self._waiting[q]}")
                else:
                    reached = ", ".join(f"{v} {k}" for k, v in sorted(self._seq[q].items()))
                    parts.append(f"program {q} returned after {reached or 'no cross-core operation'}")
            self._error = errors.LncError(
                f"kernel '{self.kernel_name}' at LNC={n}: {'; '.join(parts)}. Every core must reach the same "
                "cross-core operations in the same order (the cores run the same control flow [LNC]; the n-th "
                "sendrecv of one core pairs with the n-th of the other [LNC-SR])"
            )
        self._aborted = self._aborted or bool(self._waiting)
        self._cond.notify_all()

    def rendezvous(self, kind: str, payload: Any, complete: Callable[[dict[int, Any]], None]) -> None:
        """Program ``ctx().program_id`` reaches its next ``kind`` operation with ``payload``. When every program
        has reached it, ``complete(posts)`` runs once (in the last arriver, lock held) and all continue; until then
        the caller waits and the next ready program runs."""
        kctx = ctx()
        p = kctx.program_id
        with self._cond:
            idx = self._seq[p].get(kind, 0)
            self._seq[p][kind] = idx + 1
            posts = self._posts.setdefault((kind, idx), {})
            posts[p] = payload
            if len(posts) == self.num_programs:
                del self._posts[(kind, idx)]
                complete(posts)
                for q in posts:
                    if q != p:
                        self._state[q] = "ready"
                        self._waiting.pop(q, None)
                return
            self._state[p] = "blocked"
            self._waiting[p] = f"{kind} #{idx + 1}"
            self._pass_baton(p)
            self._cond.wait_for(lambda: (self._turn == p and self._state[p] == "ready") or self._aborted)
            if self._aborted:
                raise _Aborted()
        set_context(kctx)


def _same_result(a: Any, b: Any) -> bool:
    if isinstance(a, NkiTensor) or isinstance(b, NkiTensor):
        return (
            isinstance(a, NkiTensor)
            and isinstance(b, NkiTensor)
            and a.storage is b.storage
            and (a.shape, a.strides, a.offset, a.dtype) == (b.shape, b.strides, b.offset, b.dtype)
        )
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_result(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are different
        return False


def _run_kernel(kernel: Kernel, args: tuple, kwargs: dict, compiler: int | None = None) -> Any:
    global _last
    name = getattr(kernel.fn, "__name__", "kernel")
    k_lnc = kernel_lnc(kernel.lnc)
    c_lnc = compiler_lnc(compiler)
    if k_lnc != c_lnc:
        raise errors.LncError(
            f"NCC_EVRF066: NKI kernel '{name}' is configured with LNC={k_lnc}, but neuronx-cc is using LNC={c_lnc} "
            f"(kernel: {'kernel[' + str(kernel.lnc) + ']' if kernel.lnc is not None else ENV_LNC + ' or the default 1'}"
            f"; compiler: simulate(compiler_lnc=...), {ENV_CC_FLAGS} --lnc, {ENV_LNC} or the emulator's default "
            f"{DEFAULT_COMPILER_LNC}) [EVRF066]"
        )
    bound: list[_Arg] = []
    # LNC=2 inputs live in HBM both cores see [SIM, LNC]; LNC=1 keeps the simulator's nl.hbm placement
    arg_buffer = MemoryRegion.shared_hbm if k_lnc > 1 else MemoryRegion.private_hbm
    hargs = tuple(_convert_in(a, bound, arg_buffer, f"arg{i}") for i, a in enumerate(args))
    hkwargs = {k: _convert_in(v, bound, arg_buffer, k) for k, v in kwargs.items()}
    as_torch = any(a.is_torch for a in bound)
    grid = 1 if (kernel.lnc is not None or k_lnc > 1) else 0
    contexts = [KernelContext(program_id=p, num_programs=k_lnc, grid_ndim=grid) for p in range(k_lnc)]
    for c in contexts:
        c.runner_code = (_run_kernel.__code__, Launch._program_main.__code__)
    launch = Launch(name, contexts)
    try:
        with _SingleThreadBlas():
            results = launch.run(kernel.fn, hargs, hkwargs)
    finally:
        _last = Counters.total([c.counters for c in contexts])
    for p in range(1, k_lnc):
        if not _same_result(results[0], results[p]):
            raise errors.LncError(
                f"kernel '{name}' at LNC={k_lnc}: program 0 returned {results[0]!r} but program {p} returned "
                f"{results[p]!r}; the programs of one launch return the same (shared HBM) outputs [LNC]"
            )
    for a in bound:
        if a.tensor.storage.written:
            _write_back(a)
    return _convert_out(results[0], bound, as_torch)


class Kernel:
    """What ``nki.jit`` returns [NKI]: calling it runs the kernel in the emulator (as
    ``NKI_SIMULATOR=1`` does [SIM]); ``kernel[lnc]`` sets the kernel's LNC degree (1 or 2; the bracket launch is
    being deprecated in favour of ``NEURON_LOGICAL_NC_CONFIG`` [EVRF066]). See the module docstring for LNC."""

    def __init__(self, fn: Callable, lnc: int | None = None, **options: Any) -> None:
        self.fn = fn
        self.lnc = lnc
        self.options = options
        functools.update_wrapper(self, fn)

    def __getitem__(self, lnc: int) -> Kernel:
        if isinstance(lnc, bool) or not isinstance(lnc, int):
            raise errors.LncError("kernel[lnc]: the brackets hold exactly one integer, the LNC degree [LNC]")
        return Kernel(self.fn, _degree(lnc, f"kernel[{lnc}]"), **self.options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _run_kernel(self, args, kwargs)


def jit(fn: Callable | None = None, **kwargs: Any) -> Any:
    """``nki.jit(fn=None, **kwargs)`` [NKI]: usable as ``@nki.jit`` or ``@nki.jit(...)``."""
    if fn is None:
        return lambda f: Kernel(f, **kwargs)
    return Kernel(fn, **kwargs)


class Simulated:
    """The callable ``simulate(kernel)`` returns; ``.counters`` holds the last call's counters."""

    def __init__(self, kernel: Any, compiler_lnc: int | None = None) -> None:
        self.kernel = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
        self.compiler_lnc = compiler_lnc
        self.counters: Counters | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return _run_kernel(self.kernel, args, kwargs, self.compiler_lnc)
        finally:
            self.counters = copy.deepcopy(_last)


def simulate(kernel: Any, compiler_lnc: int | None = None) -> Simulated:
    """``nki.simulate(kernel)`` [NKI, SIM]: a callable taking torch tensors or NumPy arrays. ``compiler_lnc`` is the
    deployment's LNC degree (the emulator's stand-in for neuronx-cc's ``--lnc``; module docstring): e.g.
    ``simulate(kernel[2], compiler_lnc=2)`` runs a kernel as a Trn2 deployment at LNC=2 would."""
    return Simulated(kernel, compiler_lnc)
