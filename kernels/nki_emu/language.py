"""``nki.language`` of the emulator: dtypes, buffers, tensor creation, ``fori_loop``, operator identifiers.

The ALU / activation identifiers (``nl.add``, ``nl.exp``, ...) are what the ISA instructions take as ``op=``
[NL, SHARED]; NKI's convenience wrappers that run them directly (``nl.add(x, y)``), like the rest of
``nki.language`` that the project's kernels do not use, are not emulated. Tags in brackets are the sources
listed in docs/nki.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from . import dtypes, errors
from .memory import DynSlice, LoopFrame, MemoryRegion, NkiTensor, VirtualRegister, allocate, ctx, set_context

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


# ---- loops [LOOPS, CF, NL, DYN] -----------------------------------------------------------------------------------
def affine_range(start: int, stop: int | None = None, step: int = 1) -> range:
    """Python ``range`` [LOOPS]: since NKI 0.7 ``affine_range`` / ``sequential_range`` / ``static_range`` are deprecated
    and "default to Python range", so the loop is unrolled at specialization: its body is emitted once per iteration
    (see ``Counters.emitted``). A loop the compiler keeps is ``fori_loop``."""
    return range(start) if stop is None else range(start, stop, step)


sequential_range = affine_range
static_range = affine_range


def _bound(v: Any, what: str) -> int:
    if isinstance(v, VirtualRegister):
        return v.read(what)
    if isinstance(v, NkiTensor):
        raise errors.RegisterError(f"{what}: loop bounds are ints or VirtualRegisters, not tensors")
    return int(v)


def _describe(entry: tuple | None) -> str:
    if entry is None:
        return "nothing (the iteration ended)"
    op, site = entry[0], entry[1]
    where = f"{os.path.basename(site[0][0])}:{site[0][1]}" if site else "?"
    return f"{op} at {where}"


def _check_iteration(frame: LoopFrame, n: int) -> None:
    """The first iteration's trace is the loop body; every later one must repeat it (op names and call sites, nested
    compiled loops included) [CF: the body is traced once]."""
    trace = tuple(frame.trace)
    if frame.body is None:
        frame.body = trace
        return
    if trace == frame.body:
        return
    k = next((j for j, (a, b) in enumerate(zip(trace, frame.body)) if a != b), min(len(trace), len(frame.body)))
    got = trace[k] if k < len(trace) else None
    want = frame.body[k] if k < len(frame.body) else None
    where = frame.site[0] if frame.site else ("?", 0)
    raise errors.LoopBodyError(
        f"nl.fori_loop at {os.path.basename(where[0])}:{where[1]}: iteration {n} emits {len(trace)} instructions, "
        f"iteration 0 emitted {len(frame.body)}; instruction {k} is {_describe(got)}, iteration 0 had "
        f"{_describe(want)}. The compiler traces a fori_loop body once [CF]: its instructions cannot depend on "
        "Python values that change between iterations (use a Python loop to unroll, or make the difference "
        "data: registers, scalar_offset, masks)"
    )


def fori_loop(
    lower: Any, upper: Any, body_fun: Callable[[VirtualRegister], None], step: int = 1, unroll: bool = False
) -> None:
    """Compiled loop [NL fori_loop, CF]: ``for i in range(lower, upper, step): body_fun(i)`` with ``i`` a
    VirtualRegister passed by value; ``lower``/``upper`` ints or registers read at loop entry; ``step`` a positive
    compile-time int.

    Emission (``Counters.emitted``): the body is traced once, so the compiled program holds it once plus the loop
    itself (one ``fori_loop`` entry), whatever the trip count; ``unroll=True`` (NKI 0.8; compile-time int bounds)
    unrolls it at compilation: the body once per iteration, no loop [CF]. The emulator still runs every iteration,
    and checks that each one emits the first one's instructions (same op names from the same call sites, nested
    compiled loops compared by their bodies), else ``errors.LoopBodyError``. A loop that runs zero times still has
    its body in the program: the emulator traces it once without executing it (``KernelContext.traced_only``).
    Tensors allocated in the body count once per allocation site [DYN]; a zero-trip loop moves no data."""
    if isinstance(step, VirtualRegister) or int(step) < 1:
        raise errors.NkiValidationError("fori_loop: step must be a positive compile-time int [NL]")
    if unroll and not (isinstance(lower, (int, np.integer)) and isinstance(upper, (int, np.integer))):
        raise errors.NkiValidationError(
            "fori_loop(unroll=True): the loop is unrolled at compilation, so its bounds must be compile-time ints [CF]"
        )
    kctx = ctx()
    lo, hi = _bound(lower, "fori_loop"), _bound(upper, "fori_loop")
    trips = range(lo, hi, int(step))
    kctx.counters.instructions["fori_loop"] = kctx.counters.instructions.get("fori_loop", 0) + 1
    frame = LoopFrame(kctx.site())
    kctx.loop_stack.append(frame)
    try:
        # tracing a body that does not run (an enclosing zero-trip loop): one pass, nothing executes
        for n, i in enumerate(trips if not kctx.dry else trips[:1] or [lo]):
            frame.trace = []
            body_fun(VirtualRegister(i))
            _check_iteration(frame, n)
        if frame.body is None:  # zero trips at run time: the body is still compiled; trace it without running it
            frame.trace = []
            dry = kctx.traced_only()
            prev = set_context(dry)
            try:
                body_fun(VirtualRegister(lo))
            finally:
                set_context(prev)
                kctx.sync_allocations()
            frame.body = tuple(frame.trace)
    finally:
        kctx.loop_stack.pop()
    kctx.emit_loop(("fori_loop", frame.site, frame.body, len(trips) if unroll else None))


# ---- LNC programs [NL, LNC, LNC-233] -------------------------------------------------------------------
def _axis(axis: Any, what: str) -> None:
    if axis not in (0, None):
        raise errors.NkiValidationError(f"{what}: an LNC launch has one grid axis (0), got axis {axis!r} [LNC]")


def program_id(axis: int = 0) -> int:
    """Index of the running program on the launch grid's axis 0: the physical core, 0 or 1 at LNC=2, 0 at
    LNC=1 [NL program_id, LNC]. A Python int: specialization resolves it, as ``if program_id(0) == 0`` is
    written in the LNC overview's examples [LNC]."""
    _axis(axis, "nl.program_id")
    return ctx().program_id


def num_programs(axes: Any = 0) -> int:
    """Programs on the launch grid: the LNC degree, 1 without LNC [NL num_programs, LNC]."""
    _axis(axes, "nl.num_programs")
    return ctx().num_programs


def program_ndim() -> int:
    """Dimensions of the launch grid [NL program_ndim]: 1 for a bracket launch or LNC=2, 0 for a bare LNC=1 call
    ("0 if no grid"); that an environment-configured LNC=2 kernel reports 1 is our reading of the 0.5
    announcement that kernels are always specialized across the cores of the LNC [ANN-SPMD], UNCONFIRMED."""
    return ctx().grid_ndim


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


# =====================================================================================================================
# nki-library peer-suite additions (issue 28): the rest of ``nki.language`` that AWS's nki-library kernels use.
# Sources: the 0.6 API stub [NL] and tile_size page [TILE] (aws-neuron/aws-neuron-sdk @ 81ce03ae); usage in
# nki-library [L-*] (docs/nki.md, section 0).
# =====================================================================================================================
float8_e4m3fn_x4 = dtypes.float8_e4m3fn_x4
float8_e5m2_x4 = dtypes.float8_e5m2_x4
float4_e2m1fn_x4 = dtypes.float4_e2m1fn_x4
float8_e8m0fnu = dtypes.float8_e8m0fnu


class NKIObject:
    """``nl.NKIObject`` [NL]: "base class for NKI kernel dataclasses and configuration objects". nki-library derives
    its helper classes from it (``TiledRangeIterator``, ``TensorView``, allocators [L-KH]); under specialization they
    are plain Python objects, so here it is an empty base class whose ``__init__`` sets keyword arguments as
    attributes (the stub's signature is ``__init__(self, **kwargs)``; what the real one does with them is
    UNCONFIRMED)."""

    def __init__(self, **kwargs: Any) -> None:
        for k, v in kwargs.items():
            setattr(self, k, v)


class _TileSize:
    """``nl.tile_size``: trn2 tile-size constants [TILE, NL _TileSize]. Values: ``pmax`` 128, ``psum_bank_fmax`` /
    deprecated ``psum_fmax`` 512 fp32 elements (one 2 KiB bank) and ``psum_bank_fmax_bytes`` 2048, ``psum_num_banks``
    8 (7 when ``NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE=true``, as [TILE] says), ``gemm_stationary_fmax`` 128,
    ``gemm_moving_fmax`` 512 [TILE, TILING, TRN2]. ``sbuf_fmax_bytes`` / deprecated ``total_available_sbuf_size``
    (per partition despite the name [TILE]) = the emulator's SBUF capacity per partition, 192 KiB (24 MiB / 128,
    the project's trn2 budget, ``memory.SBUF_BYTES_PER_PARTITION``; the real usable figure is UNCONFIRMED);
    ``sbuf_fmax`` = that in fp32 elements; ``sbuf_size_bytes`` = x 128. ``bn_stats_fmax`` 512 (nki-library's
    ``BN_STATS_FMAX = 512  # nl.tile_size.bn_stats_fmax`` [L-QKVC]); ``psum_min_align`` / ``sbuf_min_align``
    UNCONFIRMED, given as 4 and 1 bytes."""

    pmax = 128
    psum_fmax = 512
    psum_bank_fmax = 512
    psum_bank_fmax_bytes = 2048
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512
    psum_min_align = 4
    sbuf_min_align = 1

    @property
    def psum_num_banks(self) -> int:
        return 7 if os.environ.get("NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE", "").lower() == "true" else 8

    @property
    def sbuf_fmax_bytes(self) -> int:
        from .memory import SBUF_BYTES_PER_PARTITION

        return SBUF_BYTES_PER_PARTITION

    total_available_sbuf_size = sbuf_fmax_bytes

    @property
    def sbuf_fmax(self) -> int:
        return self.sbuf_fmax_bytes // 4

    @property
    def sbuf_size_bytes(self) -> int:
        return self.sbuf_fmax_bytes * self.pmax


tile_size = _TileSize()


def is_hbm(buffer: MemoryRegion) -> bool:
    """``nl.is_hbm``: private or shared HBM [NL]."""
    return buffer in (MemoryRegion.private_hbm, MemoryRegion.shared_hbm)


def is_sbuf(buffer: MemoryRegion) -> bool:
    return buffer is MemoryRegion.sbuf


def is_psum(buffer: MemoryRegion) -> bool:
    return buffer is MemoryRegion.psum


def is_on_chip(buffer: MemoryRegion) -> bool:
    return buffer in (MemoryRegion.sbuf, MemoryRegion.psum)


def load(src: NkiTensor, dtype: Any = None) -> NkiTensor:
    """``nl.load(src, dtype=None)`` [NL load, MIG]: "a new tile on SBUF with values from ``src``", cast to ``dtype``
    when given. Lowered here to one ``nisa.dma_copy`` into a fresh SBUF tile of ``src``'s shape (a 1-D source becomes
    ``(n, 1)``: on-chip tiles are at least 2-D [NL]); the instruction a real compiler emits is UNCONFIRMED
    (docs/nki.md section 6)."""
    from . import isa

    shape = src.shape if src.ndim > 1 else (src.shape[0], 1)
    out = ndarray(shape, dtype or src.dtype, buffer=sbuf, name="load")
    isa.dma_copy(dst=out, src=src)
    return out


def store(dst: NkiTensor, value: NkiTensor) -> None:
    """``nl.store(dst, value)`` [NL store]: write an SBUF tile into an HBM tensor (one ``nisa.dma_copy``). A PSUM
    ``value`` is refused: "``nl.store`` does not accept PSUM tiles" is a known issue of NKI 0.3/0.4 [RN] (and DMA
    cannot read PSUM [ISA, MIG]); copy it to SBUF first."""
    from . import isa

    if value.buffer is MemoryRegion.psum:
        raise errors.MemorySpaceError("nl.store: value is in PSUM; nl.store takes an SBUF tile [RN, NL store]")
    isa.dma_copy(dst=dst, src=value)
