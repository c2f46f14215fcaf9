"""``nki.language`` of the emulator: dtypes, buffers, tensor creation, loops, operator identifiers.

The ALU / activation identifiers are functions (``nl.add`` is both ``op=nl.add`` and the
convenience wrapper ``nl.add(x, y)`` [NL]); the wrappers allocate a new SBUF tile and run the
matching ISA instruction (which instruction each wrapper lowers to is UNCONFIRMED [NL]).
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from . import dtypes as _dt
from . import isa as _isa
from .errors import NkiValidationError, RegisterError
from .memory import (
    PMAX,
    PSUM_BANK_BYTES,
    PSUM_NUM_BANKS,
    SBUF_BYTES_PER_PARTITION,
    DynSlice,
    MemoryRegion,
    NkiTensor,
    VirtualRegister,
    allocate,
    ctx,
)

# ---- dtypes [NL, SHARED] -------------------------------------------------------------------------
bool_ = _dt.bool_
int8 = _dt.int8
int16 = _dt.int16
int32 = _dt.int32
uint8 = _dt.uint8
uint16 = _dt.uint16
uint32 = _dt.uint32
float16 = _dt.float16
float32 = _dt.float32
bfloat16 = _dt.bfloat16
tfloat32 = _dt.tfloat32
float8_e4m3 = _dt.float8_e4m3
float8_e5m2 = _dt.float8_e5m2
float8_e4m3fn = _dt.float8_e4m3fn

# ---- buffers [NL] ----------------------------------------------------------------------------
sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
hbm = MemoryRegion.private_hbm
shared_hbm = MemoryRegion.shared_hbm

# ---- tile sizes on trn2 [TILE, TILING, EXMM]; sbuf_fmax_bytes is the project's 192 KiB budget ----
tile_size = SimpleNamespace(
    pmax=PMAX,
    psum_bank_fmax=PSUM_BANK_BYTES // 4,
    psum_fmax=PSUM_BANK_BYTES // 4,
    psum_bank_fmax_bytes=PSUM_BANK_BYTES,
    psum_num_banks=PSUM_NUM_BANKS,
    gemm_stationary_fmax=128,
    gemm_moving_fmax=512,
    sbuf_fmax_bytes=SBUF_BYTES_PER_PARTITION,
    total_available_sbuf_size=SBUF_BYTES_PER_PARTITION,
    sbuf_size_bytes=SBUF_BYTES_PER_PARTITION * PMAX,
)

NkiTensor = NkiTensor
VirtualRegister = VirtualRegister
MemoryRegion = MemoryRegion


def is_hbm(buffer: MemoryRegion) -> bool:
    return buffer in (private_hbm, shared_hbm)


def is_sbuf(buffer: MemoryRegion) -> bool:
    return buffer is sbuf


def is_psum(buffer: MemoryRegion) -> bool:
    return buffer is psum


def is_on_chip(buffer: MemoryRegion) -> bool:
    return buffer in (sbuf, psum)


# ---- creation [NL, LG] ---------------------------------------------------------------------------
def ndarray(shape: Any, dtype: Any, buffer: MemoryRegion = sbuf, name: str = "", address: Any = None) -> NkiTensor:
    """Uninitialised tensor: NaN-poisoned (floats) or 4 (ints), as the simulator does [NL, SIM].
    SBUF/PSUM partition dim <= 128; on-chip capacity is tracked per allocation site (see memory)."""
    return allocate(shape, dtype, buffer, name)


def zeros(shape: Any, dtype: Any, buffer: MemoryRegion = sbuf, name: str = "") -> NkiTensor:
    """A tensor filled with 0 (on hardware a memset; counted as one ``memset`` instruction) [NL]."""
    ctx().counters.count("memset")
    return allocate(shape, dtype, buffer, name, fill=0)


def ones(shape: Any, dtype: Any, buffer: MemoryRegion = sbuf, name: str = "") -> NkiTensor:
    """A tensor filled with 1 (one ``memset``) [NL]."""
    ctx().counters.count("memset")
    return allocate(shape, dtype, buffer, name, fill=1)


def full(shape: Any, fill_value: Any, dtype: Any, buffer: MemoryRegion = sbuf, name: str = "") -> NkiTensor:
    """A tensor filled with ``fill_value`` cast to ``dtype`` (one ``memset``) [NL]."""
    ctx().counters.count("memset")
    return allocate(shape, dtype, buffer, name, fill=fill_value)


def zeros_like(x: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    """``zeros`` with ``x``'s shape (and dtype / buffer unless given) [NL]."""
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def empty_like(x: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    """``ndarray`` with ``x``'s shape (poisoned) [NL]."""
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def shared_identity_matrix(n: int, dtype: Any = uint8, dst: NkiTensor | None = None) -> NkiTensor:
    """An [n, n] identity in SBUF (moving operand of PE transposes) [NL]."""
    out = dst if dst is not None else ndarray((n, n), dtype, sbuf, name="identity")
    out._write_raw(_dt.cast(np.eye(n, dtype=np.float32), out.dtype).reshape(out.shape))
    return out


def ds(start: int, size: int) -> DynSlice:
    """``nl.ds(start, size)``: slice ``start : start + size`` [NL]."""
    return DynSlice(start, size)


# ---- SPMD [NL, LNC] ------------------------------------------------------------------------------
def program_id(axis: int = 0) -> int:
    """SPMD program index: always 0 (the emulator runs LNC=1) [NL, LNC]."""
    return ctx().program_id if axis == 0 else 0


def num_programs(axes: int = 0) -> int:
    return ctx().num_programs if axes == 0 else 1


def program_ndim() -> int:
    return 1


# ---- loops [NL, DYN] -----------------------------------------------------------------------------
def affine_range(start: int, stop: int | None = None, step: int = 1) -> range:
    """Alias of ``range`` in 0.6 (fully unrolled) [NL]."""
    return range(start, stop, step) if stop is not None else range(start)


sequential_range = affine_range
static_range = affine_range


def _bound(v: Any, what: str) -> int:
    if isinstance(v, VirtualRegister):
        return v._get(what)
    if isinstance(v, NkiTensor):
        raise RegisterError(f"{what}: loop bounds are ints or VirtualRegisters, not tensors")
    return int(v)


def fori_loop(lower: Any, upper: Any, body_fun: Callable[[VirtualRegister], None], step: int = 1) -> None:
    """Runtime loop [NL fori_loop]: ``for i in range(lower, upper, step): body_fun(i)`` with ``i`` a
    VirtualRegister passed by value; ``lower``/``upper`` ints or registers read at loop entry;
    ``step`` a positive compile-time int. A zero-trip loop runs nothing (its DMAs cost nothing)."""
    if isinstance(step, VirtualRegister) or int(step) < 1:
        raise NkiValidationError("fori_loop: step must be a positive compile-time int [NL]")
    lo, hi = _bound(lower, "fori_loop"), _bound(upper, "fori_loop")
    ctx().counters.count("fori_loop")
    for i in range(lo, hi, int(step)):
        body_fun(VirtualRegister(i))


def while_loop(init: VirtualRegister, body_fun: Callable[[VirtualRegister], VirtualRegister]) -> None:
    """``r = init; while r != 0: r = body_fun(r)`` [NL while_loop]."""
    if not isinstance(init, VirtualRegister):
        raise RegisterError("while_loop: init must be a VirtualRegister")
    ctx().counters.count("while_loop")
    r = init
    for _ in range(10_000_000):
        if r._get("while_loop") == 0:
            return
        r = body_fun(VirtualRegister(r._get("while_loop")))
        if not isinstance(r, VirtualRegister):
            raise RegisterError("while_loop: body_fun must return the next condition VirtualRegister")
    raise NkiValidationError("while_loop: no termination after 10^7 iterations")


def dynamic_range(start: Any, stop: Any = None, step: int = 1):  # noqa: ANN201 - generator
    """Deprecated in 0.6 (use ``fori_loop``) [RN 0.6.0]; yields registers."""
    lo, hi = (0, _bound(start, "dynamic_range")) if stop is None else (_bound(start, "x"), _bound(stop, "x"))
    for i in range(lo, hi, int(step)):
        yield VirtualRegister(i)


# ---- operator identifiers and convenience wrappers [NL, SHARED] ----------------------------------
def _new_like(x: NkiTensor, dtype: Any) -> NkiTensor:
    return ndarray(x.shape, dtype or x.dtype, sbuf)


def _binary(name: str) -> Callable:
    def fn(x: Any, y: Any, dtype: Any = None) -> NkiTensor:
        if not isinstance(x, NkiTensor):
            raise NkiValidationError(f"nl.{name}: first operand must be a tile")
        out = _new_like(x, dtype)
        if isinstance(y, NkiTensor):
            if y.shape != x.shape:
                raise NkiValidationError(f"nl.{name}: binary wrappers do not broadcast ({x.shape} vs {y.shape}) [RN]")
            _isa.tensor_tensor(out, x, y, op=fn)
        else:
            _isa.tensor_scalar(out, x, fn, float(y))
        return out

    fn._nki_op = name  # type: ignore[attr-defined]
    fn.__name__ = name
    fn.__doc__ = f"ALU op identifier ``{name}`` and the wrapper ``nl.{name}(x, y, dtype=None)`` [NL, SHARED]."
    return fn


def _unary(name: str) -> Callable:
    def fn(x: NkiTensor, dtype: Any = None) -> NkiTensor:
        out = _new_like(x, dtype)
        _isa.activation(out, fn, x)
        return out

    fn._nki_op = name  # type: ignore[attr-defined]
    fn.__name__ = name
    fn.__doc__ = f"Activation identifier ``{name}`` and the wrapper ``nl.{name}(x, dtype=None)`` [NL, SHARED]."
    return fn


def _bitvec_unary(name: str) -> Callable:
    def fn(x: NkiTensor, dtype: Any = None) -> NkiTensor:
        out = _new_like(x, dtype)
        _isa.tensor_scalar(out, x, fn, None)
        return out

    fn._nki_op = name  # type: ignore[attr-defined]
    fn.__name__ = name
    return fn


add = _binary("add")
subtract = _binary("subtract")
multiply = _binary("multiply")
divide = _binary("divide")
maximum = _binary("maximum")
minimum = _binary("minimum")
power = _binary("power")
equal = _binary("equal")
not_equal = _binary("not_equal")
greater = _binary("greater")
greater_equal = _binary("greater_equal")
less = _binary("less")
less_equal = _binary("less_equal")
logical_and = _binary("logical_and")
logical_or = _binary("logical_or")
logical_xor = _binary("logical_xor")
bitwise_and = _binary("bitwise_and")
bitwise_or = _binary("bitwise_or")
bitwise_xor = _binary("bitwise_xor")
left_shift = _binary("left_shift")
right_shift = _binary("right_shift")
abs_max = _binary("abs_max")
abs_min = _binary("abs_min")
invert = _bitvec_unary("invert")
logical_not = _bitvec_unary("logical_not")

copy = _unary("copy")
exp = _unary("exp")
log = _unary("log")
sqrt = _unary("sqrt")
rsqrt = _unary("rsqrt")
reciprocal = _unary("reciprocal")
square = _unary("square")
abs = _unary("abs")  # noqa: A001 - NKI name
sign = _unary("sign")
relu = _unary("relu")
sigmoid = _unary("sigmoid")
tanh = _unary("tanh")
silu = _unary("silu")
silu_dx = _unary("silu_dx")
gelu = _unary("gelu")
gelu_dx = _unary("gelu_dx")
gelu_apprx_tanh = _unary("gelu_apprx_tanh")
gelu_apprx_sigmoid = _unary("gelu_apprx_sigmoid")
gelu_apprx_sigmoid_dx = _unary("gelu_apprx_sigmoid_dx")
softplus = _unary("softplus")
mish = _unary("mish")
erf = _unary("erf")
erf_dx = _unary("erf_dx")
sin = _unary("sin")
cos = _unary("cos")
arctan = _unary("arctan")
negative = _unary("negative")
identity = copy
bypass = _unary("bypass")


def _reduction(name: str, alu: Callable) -> Callable:
    def fn(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> NkiTensor:
        ax = (axis,) if isinstance(axis, int) else tuple(axis)
        ax = tuple(a % x.ndim for a in ax)
        shape = [s for k, s in enumerate(x.shape) if k not in ax or keepdims]
        shape = [1 if k in ax else s for k, s in enumerate(x.shape)] if keepdims else shape
        if len(shape) < 2:
            shape = [x.shape[0], 1]
        out = ndarray(tuple(shape), dtype or x.dtype, sbuf)
        _isa.tensor_reduce(out, alu, x, ax, keepdims=keepdims)
        return out

    fn.__name__ = name
    return fn


sum = _reduction("sum", add)  # noqa: A001
max = _reduction("max", maximum)  # noqa: A001
min = _reduction("min", minimum)  # noqa: A001
prod = _reduction("prod", multiply)


# ---- load / store [NL, MIG] ------------------------------------------------------------------
def load(src: NkiTensor, dtype: Any = None) -> NkiTensor:
    """A new SBUF tile holding ``src`` (one ``dma_copy``; optional cast) [NL load]."""
    shape = src.shape if len(src.shape) >= 2 else (src.shape[0], 1)
    out = ndarray(shape, dtype or src.dtype, sbuf)
    _isa.dma_copy(out, src)
    return out


def store(dst: NkiTensor, value: NkiTensor) -> None:
    """``dst = value`` for an SBUF tile into HBM; PSUM is rejected [NL store, RN]."""
    if isinstance(value, NkiTensor) and value.buffer is psum:
        raise NkiValidationError("nl.store: value is in PSUM; nl.store does not accept PSUM tiles [RN]")
    _isa.dma_copy(dst, value)


def device_print(print_prefix: str, tensor: NkiTensor) -> None:
    """Prints immediately in simulation [NL, SIM]."""
    builtins.print(print_prefix, np.asarray(_dt.to_f32(tensor._read_raw("device_print"))))
