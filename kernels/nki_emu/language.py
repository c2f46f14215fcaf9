"""``nki.language`` of the emulator: dtypes, buffers, tensor creation, ``fori_loop``, operator identifiers.

The ALU / activation identifiers (``nl.add``, ``nl.exp``, ...) are what the ISA instructions take as ``op=``
[NL, SHARED]; NKI's convenience wrappers that run them directly (``nl.add(x, y)``), like the rest of
``nki.language`` that the project's kernels do not use, are not emulated. Tags in brackets are the sources
listed in docs/nki-0.6.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import dtypes, errors
from .memory import DynSlice, MemoryRegion, NkiTensor, VirtualRegister, allocate, ctx

# ---- dtypes [NL, SHARED] -------------------------------------------------------------------------
bool_ = dtypes.bool_
int8 = dtypes.int8
int16 = dtypes.int16
int32 = dtypes.int32
uint8 = dtypes.uint8
uint16 = dtypes.uint16
uint32 = dtypes.uint32
float16 = dtypes.float16
float32 = dtypes.float32
bfloat16 = dtypes.bfloat16
tfloat32 = dtypes.tfloat32
float8_e4m3 = dtypes.float8_e4m3
float8_e5m2 = dtypes.float8_e5m2
float8_e4m3fn = dtypes.float8_e4m3fn

# ---- buffers [NL] ----------------------------------------------------------------------------
sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
hbm = MemoryRegion.private_hbm
shared_hbm = MemoryRegion.shared_hbm

NkiTensor = NkiTensor
VirtualRegister = VirtualRegister


# ---- creation [NL, LG] ---------------------------------------------------------------------------
def ndarray(shape: Any, dtype: Any, buffer: MemoryRegion = sbuf, name: str = "", address: Any = None) -> NkiTensor:
    """Uninitialised tensor: NaN-poisoned (floats) or 4 (ints), as the simulator does [NL, SIM].
    SBUF/PSUM partition dim <= 128; on-chip capacity is tracked per allocation site (see memory)."""
    return allocate(shape, dtype, buffer, name)


def zeros(shape: Any, dtype: Any, buffer: MemoryRegion = sbuf, name: str = "") -> NkiTensor:
    """A tensor filled with 0 (on hardware a memset; counted as one ``memset`` instruction) [NL]."""
    ctx().counters.count("memset")
    return allocate(shape, dtype, buffer, name, fill=0)


def shared_identity_matrix(n: int, dtype: Any = uint8, dst: NkiTensor | None = None) -> NkiTensor:
    """An [n, n] identity in SBUF (moving operand of PE transposes) [NL]."""
    out = dst if dst is not None else ndarray((n, n), dtype, sbuf, name="identity")
    out.write_raw(dtypes.cast(np.eye(n, dtype=np.float32), out.dtype).reshape(out.shape))
    return out


def ds(start: int, size: int) -> DynSlice:
    """``nl.ds(start, size)``: slice ``start : start + size`` [NL]."""
    return DynSlice(start, size)


# ---- runtime loop [NL, DYN] ----------------------------------------------------------------------
def _bound(v: Any, what: str) -> int:
    if isinstance(v, VirtualRegister):
        return v.read(what)
    if isinstance(v, NkiTensor):
        raise errors.RegisterError(f"{what}: loop bounds are ints or VirtualRegisters, not tensors")
    return int(v)


def fori_loop(lower: Any, upper: Any, body_fun: Callable[[VirtualRegister], None], step: int = 1) -> None:
    """Runtime loop [NL fori_loop]: ``for i in range(lower, upper, step): body_fun(i)`` with ``i`` a
    VirtualRegister passed by value; ``lower``/``upper`` ints or registers read at loop entry;
    ``step`` a positive compile-time int. A zero-trip loop runs nothing (its DMAs cost nothing)."""
    if isinstance(step, VirtualRegister) or int(step) < 1:
        raise errors.NkiValidationError("fori_loop: step must be a positive compile-time int [NL]")
    lo, hi = _bound(lower, "fori_loop"), _bound(upper, "fori_loop")
    ctx().counters.count("fori_loop")
    for i in range(lo, hi, int(step)):
        body_fun(VirtualRegister(i))


# ---- operator identifiers [NL, SHARED] -----------------------------------------------------------
class Op:
    """An ALU operator or activation function, named as the ISA tables in ``ops`` name it."""

    def __init__(self, name: str) -> None:
        self.nki_op = name

    def __repr__(self) -> str:
        return f"nl.{self.nki_op}"


add = Op("add")
subtract = Op("subtract")
multiply = Op("multiply")
divide = Op("divide")
maximum = Op("maximum")
minimum = Op("minimum")
power = Op("power")
equal = Op("equal")
not_equal = Op("not_equal")
greater = Op("greater")
greater_equal = Op("greater_equal")
less = Op("less")
less_equal = Op("less_equal")
logical_and = Op("logical_and")
logical_or = Op("logical_or")
logical_xor = Op("logical_xor")
bitwise_and = Op("bitwise_and")
bitwise_or = Op("bitwise_or")
bitwise_xor = Op("bitwise_xor")
left_shift = Op("left_shift")
right_shift = Op("right_shift")
abs_max = Op("abs_max")
abs_min = Op("abs_min")
invert = Op("invert")
logical_not = Op("logical_not")

copy = Op("copy")
exp = Op("exp")
log = Op("log")
sqrt = Op("sqrt")
rsqrt = Op("rsqrt")
reciprocal = Op("reciprocal")
square = Op("square")
abs = Op("abs")  # noqa: A001 - NKI name
sign = Op("sign")
relu = Op("relu")
sigmoid = Op("sigmoid")
tanh = Op("tanh")
silu = Op("silu")
silu_dx = Op("silu_dx")
gelu = Op("gelu")
gelu_dx = Op("gelu_dx")
gelu_apprx_tanh = Op("gelu_apprx_tanh")
gelu_apprx_sigmoid = Op("gelu_apprx_sigmoid")
gelu_apprx_sigmoid_dx = Op("gelu_apprx_sigmoid_dx")
softplus = Op("softplus")
mish = Op("mish")
erf = Op("erf")
erf_dx = Op("erf_dx")
sin = Op("sin")
cos = Op("cos")
arctan = Op("arctan")
negative = Op("negative")
identity = copy
bypass = Op("bypass")
