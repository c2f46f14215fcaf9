"""Buffers, tensor views and the per-kernel-call state of the emulator.

Storage model: every allocation is one flat byte buffer; an ``NkiTensor`` is a view of it
(``shape``, ``strides`` and ``offset`` in elements of the view's dtype), and element
``[i0, i1, ...]`` lives at ``offset + sum(strides[k] * i_k)`` [LG, APS]. On-chip tensors (SBUF, PSUM)
store partition ``p`` at ``p * partition_stride``; dim 0 is the partition dim [TILING, NL].

Allocation accounting (our documented model, not the real simulator's — it does not model capacity
[SIM]): a kernel's SBUF and PSUM usage is counted by *distinct allocation sites*. A site is the chain
of kernel-side source locations (file:line of each user frame) that led to the ``nl.ndarray`` call;
repeated allocations at one site (Python loops, which are unrolled on hardware where the compiler's
allocator reuses the space, and ``fori_loop`` bodies [DYN]) count once, at their largest size. All
sites are live until the kernel returns. A kernel whose sites together exceed 192 KiB per partition of
SBUF (24 MiB / 128, the project's trn2 budget) or 16 KiB per partition of PSUM (8 banks x 2 KiB
[TRN2, L-KH]) fails with ``errors.CapacityError``. PSUM sites are counted in whole banks (an allocation
starts on a bank boundary [MIG]; that tiles never share a bank is our UNCONFIRMED assumption).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
import warnings
from enum import Enum
from typing import Any

import numpy as np

from . import dtypes as dt
from . import errors

PMAX = 128
PSUM_BANK_BYTES = 2048
PSUM_NUM_BANKS = 8
PSUM_BYTES_PER_PARTITION = PSUM_BANK_BYTES * PSUM_NUM_BANKS
SBUF_BYTES_PER_PARTITION = 192 * 1024

_EMU_DIR = os.path.dirname(os.path.abspath(__file__))


class MemoryRegion(Enum):
    """Memory buffers [NL]: ``nl.hbm`` is an alias of ``private_hbm``."""

    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"


def _region(buffer: object) -> MemoryRegion:
    if isinstance(buffer, MemoryRegion):
        return buffer
    raise errors.NkiValidationError(
        f"buffer must be nl.sbuf / nl.psum / nl.hbm / nl.shared_hbm, got {buffer!r} (string buffer names are "
        "rejected since NKI 0.3 [MIG])"
    )


def is_hbm(buffer: MemoryRegion) -> bool:
    return buffer in (MemoryRegion.private_hbm, MemoryRegion.shared_hbm)


@dataclasses.dataclass
class Counters:
    """Per-kernel-call counters, read with ``nki_emu.last_counters()`` after a ``simulate`` call.

    DMA bytes count the bytes actually transferred (OOB-skipped rows are not counted), on the HBM side
    for HBM<->SBUF (``src`` bytes for HBM->SBUF, ``dst`` bytes for SBUF->HBM); ``dma_instructions``
    counts ``dma_copy`` calls. ``matmul_instructions`` counts every
    ``nc_matmul`` call (including ``is_transpose=True``) and ``matmul_macs`` their
    contraction x stationary-free x moving-free products (double_row: contraction = 2 x partitions);
    ``transpose_instructions`` counts ``nc_transpose``. ``instructions`` maps every executed ISA
    instruction name to its count. ``sbuf_bytes_per_partition`` / ``psum_bytes_per_partition`` are the
    site-based allocation totals (see the module docstring; PSUM in whole banks).

    DMA cost (model and sources: ``cost``): ``dma_descriptors`` counts the runs contiguous on both sides (one
    descriptor each), ``dma_src_runs`` / ``dma_dst_runs`` the runs of each side alone, ``dma_run_bytes`` their bytes
    (HBM side), ``dma_run_hist`` descriptors by size (key: the power of two at or below the run's bytes),
    ``dma_run_bytes_min`` the smallest run (None before any DMA), ``dma_mean_run_bytes`` the mean;
    ``dma_transfer_ns`` sums each DMA's busiest-engine time, ``dma_time_ns`` adds the fixed per-DMA latency.

    Instructions emitted vs executed [CF, LOOPS]: ``instructions`` counts what ran (every iteration of every loop);
    ``emitted`` / ``emitted_instructions`` count the instructions of the compiled program, which is what specialization
    records: a Python loop (``range``, ``nl.static_range`` / ``affine_range`` / ``sequential_range``, all Python
    ``range`` since NKI 0.7 [LOOPS]) emits its body once per iteration; ``nl.fori_loop`` emits its body once, plus one
    ``fori_loop`` entry for the loop itself, whatever its trip count (``unroll=True``: the body times the trip count,
    no loop entry) [CF]. ``executed_instructions`` is the sum of ``instructions`` (its ``fori_loop`` entry counts
    loops entered).

    LNC: a launch at LNC=2 runs two programs, one per physical core [LNC]. The counters of a call are the
    totals over its programs (sums; the SBUF/PSUM figures are the largest program's, each physical core having
    its own SBUF and PSUM [LNC, TRN2]); ``programs[p]`` holds program ``p``'s own counters (at LNC=1 the one
    program's, equal to the totals), ``num_programs`` the LNC degree of the launch.
    """

    dma_hbm_to_sbuf_bytes: int = 0
    dma_sbuf_to_hbm_bytes: int = 0
    dma_hbm_to_hbm_bytes: int = 0
    dma_sbuf_to_sbuf_bytes: int = 0
    dma_instructions: int = 0
    matmul_instructions: int = 0
    matmul_macs: int = 0
    transpose_instructions: int = 0
    instructions: dict[str, int] = dataclasses.field(default_factory=dict)
    sbuf_bytes_per_partition: int = 0
    psum_bytes_per_partition: int = 0
    emitted_instructions: int = 0
    emitted: dict[str, int] = dataclasses.field(default_factory=dict)
    dma_descriptors: int = 0
    dma_src_runs: int = 0
    dma_dst_runs: int = 0
    dma_run_bytes: int = 0
    dma_run_hist: dict[int, int] = dataclasses.field(default_factory=dict)
    dma_run_bytes_min: int | None = None
    dma_transfer_ns: float = 0.0
    dma_time_ns: float = 0.0
    num_programs: int = 1
    programs: list[Counters] = dataclasses.field(default_factory=list)

    @property
    def dma_bytes(self) -> int:
        """HBM traffic: HBM->SBUF + SBUF->HBM + HBM->HBM bytes."""
        return self.dma_hbm_to_sbuf_bytes + self.dma_sbuf_to_hbm_bytes + self.dma_hbm_to_hbm_bytes

    @property
    def dma_mean_run_bytes(self) -> float:
        """Mean bytes per DMA descriptor (0 without DMA)."""
        return self.dma_run_bytes / self.dma_descriptors if self.dma_descriptors else 0.0

    @property
    def executed_instructions(self) -> int:
        """Instructions executed (every iteration counted)."""
        return sum(self.instructions.values())

    def count(self, op: str) -> None:
        """One executed instruction ``op``; also recorded as emitted by the running program (``KernelContext.emit``)."""
        self.instructions[op] = self.instructions.get(op, 0) + 1
        ctx().emit(op)

    @classmethod
    def total(cls, programs: list[Counters]) -> Counters:
        """The launch's counters from its programs' (each kept, as a copy, in ``programs``)."""
        out = cls(num_programs=len(programs), programs=[_detached(c) for c in programs])
        for f in dataclasses.fields(cls):
            if f.name in ("num_programs", "programs"):
                continue
            vals = [getattr(c, f.name) for c in programs]
            if f.name in _PER_CORE_MAX:
                setattr(out, f.name, max(vals))
            elif f.name == "dma_run_bytes_min":
                present = [v for v in vals if v is not None]
                setattr(out, f.name, min(present) if present else None)
            elif isinstance(vals[0], dict):
                merged: dict = {}
                for v in vals:
                    _merge_counts(merged, v)
                setattr(out, f.name, merged)
            else:
                setattr(out, f.name, sum(vals))
        return out


# Per-physical-core capacities: the launch reports the largest program's, never a sum [LNC].
_PER_CORE_MAX = frozenset({"sbuf_bytes_per_partition", "psum_bytes_per_partition"})


def _merge_counts(into: dict, other: dict) -> None:
    """Add ``other``'s counts into ``into``; nested dicts (histograms) merge key by key."""
    for k, v in other.items():
        if isinstance(v, dict):
            _merge_counts(into.setdefault(k, {}), v)
        else:
            into[k] = into.get(k, 0) + v


def _detached(c: Counters) -> Counters:
    """A copy of one program's counters without nested per-program lists."""
    d = copy.deepcopy(c)
    d.programs = []
    d.num_programs = 1
    return d


class KernelContext:
    """State of one program of a kernel call (one physical core): counters, allocation sites, engine accumulator
    registers. At LNC=2 each program has its own context, so SBUF/PSUM accounting, registers and counters are private
    per program [LNC]; ``launch`` is the state the programs share (shared-HBM outputs, cross-core rendezvous), None
    outside a launch."""

    def __init__(
        self, check_capacity: bool = True, program_id: int = 0, num_programs: int = 1, grid_ndim: int = 0
    ) -> None:
        self.counters = Counters()
        self.check_capacity = check_capacity
        self.sbuf_sites: dict[tuple, int] = {}
        self.psum_sites: dict[tuple, int] = {}
        # Per-partition fp32 accumulator registers of ScalarE (activation family) and VectorE
        # (range_select here) [ISA]; NaN until first reset.
        self.act_regs = np.full(PMAX, np.nan, np.float32)
        self.vec_regs = np.full(PMAX, np.nan, np.float32)
        self.runner_code: Any = None
        self.program_id = program_id
        self.num_programs = num_programs
        self.grid_ndim = grid_ndim
        self.launch: Any = None
        # shared_hbm allocations seen per site in this program (their occurrence number pairs them across programs)
        self.hbm_site_counts: dict[tuple, int] = {}
        # compiled loops being traced, innermost last (emission goes to the innermost loop's trace)
        self.loop_stack: list[LoopFrame] = []
        # dry: tracing a compiled loop body that runs zero times (see ``traced_only``): nothing is written
        self.dry = False

    # ---- emitted instructions [CF, LOOPS] ----
    def emit(self, op: str) -> None:
        """Record one emitted instruction: in the innermost compiled loop's trace (with its call site, so iterations
        can be compared), else straight into the counters."""
        if self.loop_stack:
            self.loop_stack[-1].trace.append((op, self._site()))
        else:
            self.counters.emitted_instructions += 1
            self.counters.emitted[op] = self.counters.emitted.get(op, 0) + 1

    def emit_loop(self, entry: tuple) -> None:
        """Record a finished compiled loop (``("fori_loop", site, body, unrolled_trips)``)."""
        if self.loop_stack:
            self.loop_stack[-1].trace.append(entry)
            return
        counts: dict[str, int] = {}
        _flatten(entry, counts, 1)
        for op, n in counts.items():
            self.counters.emitted[op] = self.counters.emitted.get(op, 0) + n
            self.counters.emitted_instructions += n

    def traced_only(self) -> KernelContext:
        """A context that traces without executing: a compiled loop whose trip count is 0 at run time still has its
        body in the compiled program (specialization traces it once [CF]), so the emulator runs the body once in
        this context to learn its instructions. Writes (tensors, HBM write-back, registers, PSUM matmul marks) are
        dropped, a dynamic index out of bounds reads index 0, an unset register reads 0, counters are its own;
        SBUF/PSUM allocation sites, the loop stack and the launch are shared with the parent."""
        d = KernelContext.__new__(KernelContext)
        d.__dict__.update(self.__dict__)
        d.counters = Counters()
        d.act_regs = self.act_regs.copy()
        d.vec_regs = self.vec_regs.copy()
        d.dry = True
        return d

    def sync_allocations(self) -> None:
        """Refresh the allocation totals after a traced-only body allocated into the shared site tables."""
        self.counters.sbuf_bytes_per_partition = sum(self.sbuf_sites.values())
        self.counters.psum_bytes_per_partition = sum(self.psum_sites.values())

    def site(self) -> tuple:
        """The chain of kernel-side (file, line) frames that led here, innermost first (emulator frames skipped)."""
        return self._site()

    def _site(self, depth: int = 2) -> tuple:
        frames = []
        stops = self.runner_code if isinstance(self.runner_code, tuple) else (self.runner_code,)
        f = sys._getframe(depth)
        while f is not None:
            if f.f_code in stops:
                break
            fn = os.path.abspath(f.f_code.co_filename)
            if not fn.startswith(_EMU_DIR):
                frames.append((fn, f.f_lineno))
            f = f.f_back
        return tuple(frames)

    def record_alloc(self, buffer: MemoryRegion, bytes_per_partition: int) -> None:
        if buffer is MemoryRegion.sbuf:
            sites, limit, cost, what = self.sbuf_sites, SBUF_BYTES_PER_PARTITION, bytes_per_partition, "SBUF"
        elif buffer is MemoryRegion.psum:
            banks = -(-bytes_per_partition // PSUM_BANK_BYTES)
            sites, limit, cost, what = self.psum_sites, PSUM_BYTES_PER_PARTITION, banks * PSUM_BANK_BYTES, "PSUM"
        else:
            return
        site = self._site()
        sites[site] = max(sites.get(site, 0), cost)
        total = sum(sites.values())
        if buffer is MemoryRegion.sbuf:
            self.counters.sbuf_bytes_per_partition = total
        else:
            self.counters.psum_bytes_per_partition = total
        if self.check_capacity and total > limit:
            where = ", ".join(f"{os.path.basename(fn)}:{ln}" for fn, ln in site[:2])
            raise errors.CapacityError(
                f"nl.ndarray: {what} allocations total {total} bytes per partition over "
                f"{len(sites)} allocation sites, exceeding the {limit}-byte capacity (latest site {where})"
            )


_FREE_CONTEXT = KernelContext(check_capacity=False)
_current: KernelContext | None = None


def ctx() -> KernelContext:
    return _current if _current is not None else _FREE_CONTEXT


def set_context(c: KernelContext | None) -> KernelContext | None:
    global _current
    prev = _current
    _current = c
    return prev


class LoopFrame:
    """One compiled loop being run: the instruction trace of the current iteration and the body (the first
    iteration's trace) every later iteration must repeat [CF]."""

    def __init__(self, site: tuple) -> None:
        self.site = site
        self.trace: list[tuple] = []
        self.body: tuple | None = None


def _flatten(entry: tuple, into: dict[str, int], mult: int) -> None:
    """Add the emitted instructions of one trace entry (an ``(op, site)`` pair or a loop entry) ``mult`` times."""
    if len(entry) == 4 and entry[0] == "fori_loop":
        _, _, body, unrolled = entry
        if unrolled is None:
            into["fori_loop"] = into.get("fori_loop", 0) + mult
        else:
            mult *= unrolled
        for e in body:
            _flatten(e, into, mult)
        return
    into[entry[0]] = into.get(entry[0], 0) + mult


class Storage:
    """One allocation: a flat byte buffer plus what was allocated (for partition stride and HBM write-back)."""

    def __init__(self, shape: tuple[int, ...], dtype: str, buffer: MemoryRegion, name: str) -> None:
        self.shape = shape
        self.dtype = dtype
        self.buffer = buffer
        self.name = name
        n = math.prod(shape)
        self.nbytes = n * dt.itemsize(dtype)
        self.raw = np.empty(self.nbytes, np.uint8)
        self.written = False
        onchip = not is_hbm(buffer)
        self.part_bytes = (self.nbytes // shape[0]) if onchip else None
        # PSUM words (4 bytes) last written by a matmul: drives accumulate=None [ISA nc_matmul].
        self.mm_written = np.zeros(self.nbytes // 4 + 1, bool) if buffer is MemoryRegion.psum else None

    def typed(self, dtype: str) -> np.ndarray:
        isz = dt.itemsize(dtype)
        if self.nbytes % isz:
            raise errors.ShapeError(f"storage '{self.name}' of {self.nbytes} bytes cannot be viewed as {dtype}")
        return self.raw.view(dt.np_dtype(dtype))

    def size_in(self, dtype: str) -> int:
        return self.nbytes // dt.itemsize(dtype)


@dataclasses.dataclass
class Indirect:
    """How an indirect view (``.ap(scalar_offset=...)``, ``.ap(vector_offset=...)``, ``select``) addresses
    its tensor."""

    kind: str  # "scalar" or "vector"
    source: Any  # VirtualRegister or NkiTensor
    dim: int  # result dim the dynamic index drives (vector: 0)
    mult: int  # elements per index step
    bound: int  # valid indices are [0, bound)


class VirtualRegister:
    """A 32-bit engine register [ISA VirtualRegister]; value set by register_* ops or fori_loop.

    Using it as a Python value (``if reg``, ``int(reg)``, ``range(reg)``) raises ``TypeError`` as the
    NKI tracer does [ISA VirtualRegister note]: a register's value is only known on the device.
    """

    def __init__(self, value: int | None = None, frozen: bool = False) -> None:
        self._value = None if value is None else _wrap32(value)
        self.frozen = frozen

    def read(self, what: str = "read") -> int:
        """The register's value; `what` names the reader in the error if it was never written."""
        if self._value is None:
            if ctx().dry:
                return 0  # tracing a body that never runs: the value is irrelevant
            raise errors.RegisterError(
                f"{what}: VirtualRegister read before it was written (register_alloc() without init)"
            )
        return self._value

    def write(self, value: int, what: str) -> None:
        """Set the value (wrapped to 32 bits); a fori_loop induction register refuses."""
        if self.frozen:
            raise errors.RegisterError(f"{what}: the fori_loop induction register is read-only [NL fori_loop]")
        if ctx().dry:
            return
        self._value = _wrap32(value)

    def __bool__(self) -> bool:
        raise errors.RegisterError("a VirtualRegister has no Python truth value (runtime value; use nl.fori_loop)")

    def __index__(self) -> int:
        raise errors.RegisterError("a VirtualRegister cannot be used as a Python int (runtime value)")

    __int__ = __index__

    def __repr__(self) -> str:
        return f"VirtualRegister({self._value})"


def _wrap32(v: int) -> int:
    v = int(v) & 0xFFFFFFFF
    return v - (1 << 32) if v >= (1 << 31) else v


def scalar_value(src: Any, what: str) -> int:
    """Runtime value of a scalar offset: a register or a 1-element SBUF tensor."""
    if isinstance(src, VirtualRegister):
        return src.read(what)
    if isinstance(src, NkiTensor):
        if src.size != 1:
            raise errors.ShapeError(f"{what}: scalar_offset tensor must hold one element, has shape {src.shape}")
        v = src.read_raw().reshape(-1)[0]
        return int(v) if np.issubdtype(v.dtype, np.integer) else int(np.rint(float(v)))
    raise errors.NkiValidationError(f"{what}: scalar_offset must be a VirtualRegister or a (1,1) SBUF tensor")


class DynSlice:
    """``nl.ds(start, size)``: a slice of ``size`` elements from ``start`` [NL]."""

    def __init__(self, start: int, size: int) -> None:
        if isinstance(start, (VirtualRegister, NkiTensor)):
            raise errors.NkiValidationError("nl.ds with a runtime start is not supported; use .ap(scalar_offset=...)")
        self.start = int(start)
        self.size = int(size)


class NkiTensor:
    """A view of a buffer [NL NkiTensor]. All views share storage; none copies data."""

    def __init__(
        self,
        st: Storage,
        dtype: str,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        offset: int,
        dyn: Indirect | None = None,
    ) -> None:
        self.storage = st
        self.dtype = dtype
        self.shape = tuple(int(s) for s in shape)
        self.strides = tuple(int(s) for s in strides)
        self.offset = int(offset)
        self.indirect = dyn
        self._idx: np.ndarray | None = None

    # ---- attributes ------------------------------------------------------------------------
    @property
    def buffer(self) -> MemoryRegion:
        return self.storage.buffer

    @property
    def name(self) -> str:
        return self.storage.name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def onchip(self) -> bool:
        return not is_hbm(self.storage.buffer)

    def partition_stride(self, dtype: str | None = None) -> int:
        """Elements of `dtype` (default the view's) between two partitions of an on-chip buffer."""
        return self.storage.part_bytes // dt.itemsize(dtype or self.dtype)

    def __repr__(self) -> str:
        return f"NkiTensor({self.name!r}, {self.shape}, {self.dtype}, {self.buffer.value})"

    def __len__(self) -> int:
        return self.shape[0]

    def _new(self, shape, strides, offset, dtype=None, dyn=None) -> NkiTensor:
        return NkiTensor(self.storage, dtype or self.dtype, tuple(shape), tuple(strides), offset, dyn)

    def _no_dyn(self, what: str) -> None:
        if self.indirect is not None:
            raise errors.NkiValidationError(f"{what}: not allowed on an indirect view [NL is_indirect]")

    # ---- index computation -----------------------------------------------------------------
    def _static_index(self, zero_dim: int | None = None) -> np.ndarray:
        idx = np.full((1,) * self.ndim, self.offset, np.int64)
        for k, (n, s) in enumerate(zip(self.shape, self.strides)):
            if k == zero_dim:
                continue
            sh = [1] * self.ndim
            sh[k] = n
            idx = idx + (np.arange(n, dtype=np.int64) * s).reshape(sh)
        return np.broadcast_to(idx, self.shape)

    def element_index(self) -> tuple[np.ndarray, np.ndarray | None, str | None]:
        """Element indices of the view (storage units of ``self.dtype``), an element validity mask
        (``None`` = all valid) and a description of the first invalid index."""
        if self.indirect is None:
            if self._idx is None:
                self._idx = self._static_index()
            return self._idx, None, None
        d = self.indirect
        n_storage = self.storage.size_in(self.dtype)
        if d.kind == "scalar":
            v = scalar_value(d.source, "indirect access")
            if ctx().dry and not 0 <= v < d.bound:
                v = 0  # tracing only (see KernelContext.traced_only)
            idx = self._static_index() + v * d.mult
            ok_index = 0 <= v < d.bound
            if ok_index and idx.size and (idx.min() < 0 or idx.max() >= n_storage):
                ok_index = False
            if ok_index:
                return idx, None, None
            valid = np.zeros(self.shape, bool)
            return idx, valid, f"scalar_offset value {v} (valid range [0, {d.bound}) on dim {d.dim})"
        vec = d.source.read_raw().reshape(-1)
        vals = vec.astype(np.int64) if np.issubdtype(vec.dtype, np.integer) else np.rint(vec.astype(np.float64))
        vals = vals.astype(np.int64)
        rows = self.shape[0]
        if vals.shape[0] != rows:
            raise errors.ShapeError(f"vector_offset has {vals.shape[0]} indices but the access has {rows} partitions")
        base = self._static_index(zero_dim=0)
        shp = (rows,) + (1,) * (self.ndim - 1)
        idx = base + (vals * d.mult).reshape(shp)
        if ctx().dry:  # tracing only: any index will do, the data moved is dropped
            vals = np.where((vals >= 0) & (vals < d.bound), vals, 0)
        row_ok = (vals >= 0) & (vals < d.bound)
        valid = np.broadcast_to(row_ok.reshape(shp), self.shape) & (idx >= 0) & (idx < n_storage)
        if valid.all():
            return idx, None, None
        bad_rows = np.nonzero(~valid.reshape(rows, -1).all(axis=1))[0]
        p = int(bad_rows[0])
        msg = f"vector_offset index {int(vals[p])} at partition {p} (valid range [0, {d.bound}))"
        return idx, valid, msg

    def _check_static_bounds(self, what: str) -> None:
        if self.indirect is not None or self.size == 0:
            return
        if self.strided_view(self.offset) is None:
            raise errors.OutOfBoundsError(f"{what}: view {self.shape} of '{self.name}' addresses outside its buffer")

    # ---- raw access ------------------------------------------------------------------------
    def base_offset(self) -> tuple[int, str | None]:
        """Storage offset of a static or scalar-indirect view, and an OOB description (or None)."""
        if self.indirect is None:
            return self.offset, None
        d = self.indirect
        v = scalar_value(d.source, "indirect access")
        if ctx().dry and not 0 <= v < d.bound:
            v = 0  # tracing only (see KernelContext.traced_only)
        msg = None if 0 <= v < d.bound else f"scalar_offset value {v} (valid range [0, {d.bound}) on dim {d.dim})"
        return self.offset + v * d.mult, msg

    def strided_view(self, offset: int) -> np.ndarray | None:
        """A NumPy view of the elements (no copy), or None if it would leave the buffer."""
        isz = dt.itemsize(self.dtype)
        lo = hi = offset
        for n, s in zip(self.shape, self.strides):
            if s >= 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        if lo < 0 or (hi + 1) * isz > self.storage.nbytes:
            return None
        return np.ndarray(
            self.shape, dt.np_dtype(self.dtype), self.storage.raw, offset * isz, tuple(s * isz for s in self.strides)
        )

    def _np(self, what: str) -> np.ndarray:
        """Writable NumPy view of a non-vector-indirect view; raises errors.OutOfBoundsError when outside."""
        off, msg = self.base_offset()
        view = None if msg else self.strided_view(off)
        if view is None:
            raise errors.OutOfBoundsError(f"{what}: out-of-bounds {msg or 'access'} on '{self.name}' {self.shape}")
        return view

    def read_raw(self, what: str = "read") -> np.ndarray:
        """The view's stored values in its dtype (no cast), shaped like the view; out of bounds raises."""
        if self.indirect is None or self.indirect.kind == "scalar":
            return self._np(what)
        idx, valid, msg = self.element_index()
        if valid is not None:
            raise errors.OutOfBoundsError(f"{what}: out-of-bounds {msg} on '{self.name}'")
        return self.storage.typed(self.dtype)[idx]

    def write_raw(self, values: np.ndarray, what: str = "write") -> None:
        """Store values already in the view's dtype (no cast) and mark an HBM buffer written (nothing while tracing a
        compiled loop body that does not run, ``KernelContext.traced_only``)."""
        if ctx().dry:
            return
        if self.indirect is None or self.indirect.kind == "scalar":
            self._np(what)[...] = np.asarray(values).reshape(self.shape)
        else:
            idx, valid, msg = self.element_index()
            if valid is not None:
                raise errors.OutOfBoundsError(f"{what}: out-of-bounds {msg} on '{self.name}'")
            self.storage.typed(self.dtype)[idx] = np.asarray(values).reshape(self.shape)
        if not self.onchip:
            self.storage.written = True

    # ---- views -----------------------------------------------------------------------------
    def __getitem__(self, key: Any) -> NkiTensor:
        self._no_dyn("indexing")
        if not isinstance(key, tuple):
            key = (key,)
        n_ell = sum(1 for k in key if k is Ellipsis)
        if n_ell > 1:
            raise IndexError("only one Ellipsis allowed")
        if n_ell:
            i = next(j for j, k in enumerate(key) if k is Ellipsis)
            key = key[:i] + (slice(None),) * (self.ndim - len(key) + 1) + key[i + 1 :]
        if len(key) > self.ndim:
            raise IndexError(f"too many indices ({len(key)}) for tensor of shape {self.shape}")
        key = key + (slice(None),) * (self.ndim - len(key))
        shape, strides, offset = [], [], self.offset
        dropped_last = False
        for k, (n, s, kk) in enumerate(zip(self.shape, self.strides, key)):
            if isinstance(kk, DynSlice):
                kk = slice(kk.start, kk.start + kk.size)
                if kk.stop > n or kk.start < 0:
                    raise errors.OutOfBoundsError(
                        f"nl.ds({kk.start}, {kk.stop - kk.start}) out of range for dim {k} size {n}"
                    )
            if isinstance(kk, slice):
                start, stop, step = kk.indices(n)
                if step < 1:
                    raise IndexError("slice step must be >= 1")
                if kk.stop is not None and not (-n <= kk.stop <= n):
                    raise errors.OutOfBoundsError(f"slice stop {kk.stop} out of range for dim {k} of size {n}")
                cnt = max(0, -(-(stop - start) // step))
                shape.append(cnt)
                strides.append(s * step)
                offset += start * s
            elif isinstance(kk, (int, np.integer)):
                kk = int(kk)
                if not -n <= kk < n:
                    raise errors.OutOfBoundsError(f"index {kk} out of range for dim {k} of size {n}")
                kk %= n
                offset += kk * s
                if k == 0 and self.onchip:
                    shape.append(1)
                    strides.append(s)
                elif k == self.ndim - 1:
                    dropped_last = True
            else:
                raise IndexError(f"unsupported index {kk!r} (ints, slices, ..., nl.ds)")
        min_nd = 2 if self.onchip else 1
        if len(shape) < min_nd:
            shape.append(1)
            strides.append(1 if dropped_last else 0)
        return self._new(shape, strides, offset)

    def __setitem__(self, key: Any, value: Any) -> None:
        raise errors.NkiValidationError(
            "NkiTensor.__setitem__ is undocumented in NKI 0.6; use an explicit dst= instruction"
        )

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> NkiTensor:
        if not (0 <= start < end <= self.shape[dim]) or step < 1:
            raise errors.OutOfBoundsError(f"slice({dim}, {start}, {end}, {step}) invalid for shape {self.shape}")
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim: int, index: Any) -> NkiTensor:
        if isinstance(index, (int, np.integer)):
            self._no_dyn("select")
            if not 0 <= index < self.shape[dim]:
                raise errors.OutOfBoundsError(f"select({dim}, {index}) out of range for shape {self.shape}")
            shape = self.shape[:dim] + self.shape[dim + 1 :]
            strides = self.strides[:dim] + self.strides[dim + 1 :]
            off = self.offset + int(index) * self.strides[dim]
            if self.onchip and dim == 0:
                raise errors.NkiValidationError("select on the partition dim of an on-chip tensor; slice it instead")
            return self._new(shape, strides, off)
        self._no_dyn("select")
        if self.onchip and dim == 0:
            raise errors.NkiValidationError("dynamic select on the partition dim of an on-chip tensor [NL select]")
        shape = self.shape[:dim] + self.shape[dim + 1 :]
        strides = self.strides[:dim] + self.strides[dim + 1 :]
        dyn = Indirect("scalar", index, dim, self.strides[dim], self.shape[dim])
        return self._new(shape, strides, self.offset, dyn=dyn)

    def vector_select(self, dim: int, vector_offset: NkiTensor) -> NkiTensor:
        self._no_dyn("vector_select")
        if dim != 0:
            raise errors.NkiValidationError("vector_select: dim must be 0 [NL vector_select]")
        if self.onchip:
            raise errors.NkiValidationError("vector_select: only HBM tensors can be indexed per partition [NL, APS]")
        _check_index_tensor(vector_offset, "vector_select")
        p = vector_offset.shape[0]
        dyn = Indirect("vector", vector_offset, 0, self.strides[0], self.shape[0])
        return self._new((p,) + self.shape[1:], (0,) + self.strides[1:], self.offset, dyn=dyn)

    def ap(
        self,
        pattern: list[list[int]],
        offset: int | None = None,
        scalar_offset: Any = None,
        vector_offset: NkiTensor | None = None,
        indirect_dim: int = 0,
        dtype: str | None = None,
    ) -> NkiTensor:
        """Explicit access pattern [APS, NL NkiTensor.ap]: element ``[i0, i1, ...]`` =
        ``storage[base + sum(stride_k * i_k)]`` with ``pattern = [[stride, count], ...]`` (outermost first).

        ``base`` = the view's storage offset plus ``offset`` (``None`` = 0): the NL docstring says an
        explicit offset composes with the base offset; APS says "from the beginning of the tensor" —
        the two agree when ``.ap`` is called on an unsliced tensor, which is what kernels should do
        (exact rule for sliced views UNCONFIRMED). ``scalar_offset`` (register or (1,1) SBUF tensor)
        adds ``value * prod(self.shape[indirect_dim+1:])`` and is bounds-checked against
        ``self.shape[indirect_dim]``; ``vector_offset`` (SBUF (P,1) indices, HBM tensors only,
        ``indirect_dim=0``) replaces the leading pattern stride by ``prod(self.shape[1:])`` and gives
        partition ``p`` the row ``vector_offset[p]`` [APS, ISA dma_copy]. The multiplier uses the
        shape of the tensor ``.ap`` is called on ("base tensor" [APS]).
        """
        self._no_dyn("ap")
        new_dtype = dt.normalize(dtype) if dtype is not None else self.dtype
        ratio_num, ratio_den = dt.itemsize(self.dtype), dt.itemsize(new_dtype)
        base_bytes = self.offset * ratio_num + (0 if offset is None else int(offset) * ratio_den)
        if base_bytes % ratio_den:
            raise errors.ShapeError(f"ap: offset not aligned to {new_dtype}")
        base = base_bytes // ratio_den
        if not pattern or any(len(p) != 2 for p in pattern):
            raise errors.ShapeError(f"ap: pattern must be a list of [stride, count] pairs, got {pattern!r}")
        strides = tuple(int(p[0]) for p in pattern)
        shape = tuple(int(p[1]) for p in pattern)
        if any(c < 1 for c in shape):
            raise errors.ShapeError(f"ap: counts must be >= 1, got {pattern!r}")
        if self.onchip:
            ps = self.partition_stride(new_dtype)
            if shape[0] > 1 and strides[0] != ps:
                raise errors.NkiValidationError(
                    f"ap on on-chip tensor '{self.name}': the first pattern pair is the partition access; its stride "
                    f"must be the per-partition element count {ps}, got {strides[0]} [APS]"
                )
            if shape[0] > PMAX:
                raise errors.PartitionLimitError(f"ap: partition count {shape[0]} exceeds {PMAX}")
        if scalar_offset is not None and vector_offset is not None:
            raise errors.NkiValidationError("ap: scalar_offset and vector_offset are mutually exclusive [APS]")
        scale = ratio_num / ratio_den
        dyn = None
        if scalar_offset is not None:
            if not 0 <= indirect_dim < self.ndim:
                raise errors.NkiValidationError(f"ap: indirect_dim {indirect_dim} out of range for shape {self.shape}")
            if isinstance(scalar_offset, NkiTensor):
                if scalar_offset.buffer is not MemoryRegion.sbuf or scalar_offset.size != 1:
                    raise errors.NkiValidationError("ap: scalar_offset tensor must be a (1,1) SBUF tensor [APS]")
            elif not isinstance(scalar_offset, VirtualRegister):
                raise errors.NkiValidationError(
                    "ap: scalar_offset must be a VirtualRegister or a (1,1) SBUF tensor [APS]"
                )
            mult = int(math.prod(self.shape[indirect_dim + 1 :]) * scale)
            dyn = Indirect("scalar", scalar_offset, indirect_dim, mult, self.shape[indirect_dim])
        elif vector_offset is not None:
            if indirect_dim != 0:
                raise errors.NkiValidationError("ap: vector_offset supports only indirect_dim=0 [APS]")
            if self.onchip:
                raise errors.NkiValidationError(
                    "ap: the tensor indexed with vector_offset must be in HBM [ISA dma_copy]"
                )
            _check_index_tensor(vector_offset, "ap")
            if vector_offset.shape[0] != shape[0]:
                raise errors.ShapeError(
                    f"ap: vector_offset has {vector_offset.shape[0]} indices but the pattern has {shape[0]} rows"
                )
            mult = int(math.prod(self.shape[1:]) * scale)
            dyn = Indirect("vector", vector_offset, 0, mult, self.shape[0])
            strides = (0,) + strides[1:]
        out = self._new(shape, strides, base, dtype=new_dtype, dyn=dyn)
        out._check_static_bounds("ap")
        return out

    def get_pattern(self) -> list[list[int]]:
        return [[s, n] for s, n in zip(self.strides, self.shape)]

    def is_indirect(self) -> bool:
        return self.indirect is not None

    def is_contiguous(self) -> bool:
        expect = 1
        for k in range(self.ndim - 1, 0 if self.onchip else -1, -1):
            if self.shape[k] != 1 and self.strides[k] != expect:
                return False
            expect *= self.shape[k]
        return True

    def permute(self, dims: tuple[int, ...]) -> NkiTensor:
        self._no_dyn("permute")
        if sorted(dims) != list(range(self.ndim)):
            raise errors.ShapeError(f"permute: {dims} is not a permutation of {self.ndim} dims")
        if self.onchip and dims[0] != 0:
            raise errors.NkiValidationError("permute: the partition dim must stay first on on-chip tensors [NL]")
        return self._new([self.shape[d] for d in dims], [self.strides[d] for d in dims], self.offset)

    def broadcast(self, dim: int, size: int) -> NkiTensor:
        if self.shape[dim] != 1:
            raise errors.ShapeError(f"broadcast: dim {dim} has size {self.shape[dim]}, must be 1")
        if self.onchip and dim == 0:
            raise errors.NkiValidationError("broadcast: cannot broadcast the partition dim of an on-chip tensor [NL]")
        shape = list(self.shape)
        strides = list(self.strides)
        shape[dim], strides[dim] = int(size), 0
        return self._new(shape, strides, self.offset, dyn=self.indirect)

    def expand_dim(self, dim: int) -> NkiTensor:
        if self.onchip and dim == 0:
            raise errors.NkiValidationError("expand_dim: cannot insert before the partition dim [NL]")
        shape = list(self.shape)
        strides = list(self.strides)
        shape.insert(dim, 1)
        strides.insert(dim, 0)
        return self._new(shape, strides, self.offset, dyn=self.indirect)

    def squeeze_dim(self, dim: int) -> NkiTensor:
        if self.shape[dim] != 1:
            raise errors.ShapeError(f"squeeze_dim: dim {dim} has size {self.shape[dim]}")
        if self.onchip and dim == 0:
            raise errors.NkiValidationError("squeeze_dim: cannot remove the partition dim [NL]")
        return self._new(
            self.shape[:dim] + self.shape[dim + 1 :], self.strides[:dim] + self.strides[dim + 1 :], self.offset
        )

    def reshape_dim(self, dim: int, shape: tuple[int, ...]) -> NkiTensor:
        self._no_dyn("reshape_dim")
        shape = list(shape)
        n = self.shape[dim]
        if shape.count(-1) == 1:
            rest = math.prod([s for s in shape if s != -1])
            shape[shape.index(-1)] = n // rest
        if math.prod(shape) != n:
            raise errors.ShapeError(f"reshape_dim: {tuple(shape)} does not multiply to {n}")
        if self.onchip and dim == 0 and len(shape) != 1:
            raise errors.NkiValidationError("reshape_dim: cannot split the partition dim [NL]")
        s = self.strides[dim]
        sub = []
        acc = s
        for k in reversed(shape):
            sub.insert(0, acc)
            acc *= k
        return self._new(
            self.shape[:dim] + tuple(shape) + self.shape[dim + 1 :],
            self.strides[:dim] + tuple(sub) + self.strides[dim + 1 :],
            self.offset,
        )

    def flatten_dims(self, start_dim: int, end_dim: int) -> NkiTensor:
        self._no_dyn("flatten_dims")
        if self.onchip and start_dim == 0:
            raise errors.NkiValidationError("flatten_dims: cannot merge the partition dim [NL]")
        for k in range(start_dim, end_dim):
            if self.shape[k] != 1 and self.strides[k] != self.strides[k + 1] * self.shape[k + 1]:
                raise errors.ShapeError(f"flatten_dims: dims {start_dim}..{end_dim} are not contiguous")
        n = math.prod(self.shape[start_dim : end_dim + 1])
        return self._new(
            self.shape[:start_dim] + (n,) + self.shape[end_dim + 1 :],
            self.strides[:start_dim] + (self.strides[end_dim],) + self.strides[end_dim + 1 :],
            self.offset,
        )

    def reshape(self, shape: tuple[int, ...] | list[int]) -> NkiTensor:
        self._no_dyn("reshape")
        shape = [int(s) for s in shape]
        if shape.count(-1) == 1:
            rest = math.prod([s for s in shape if s != -1])
            shape[shape.index(-1)] = self.size // rest
        if math.prod(shape) != self.size:
            raise errors.ShapeError(f"reshape: {tuple(shape)} has a different element count than {self.shape}")
        if self.onchip:
            if shape[0] != self.shape[0]:
                raise errors.NkiValidationError(
                    f"reshape: on-chip tensors keep the partition dim ({self.shape[0]}) [NL]"
                )
            if not self.is_contiguous():
                raise errors.ShapeError(f"reshape: view {self.shape} with strides {self.strides} is not contiguous")
            strides = [self.strides[0]]
            acc = 1
            free = []
            for k in reversed(shape[1:]):
                free.insert(0, acc)
                acc *= k
            return self._new(shape, strides + free, self.offset)
        if not self.is_contiguous():
            raise errors.ShapeError(f"reshape: view {self.shape} with strides {self.strides} is not contiguous")
        strides = []
        acc = 1
        for k in reversed(shape):
            strides.insert(0, acc)
            acc *= k
        return self._new(shape, strides, self.offset)

    def view(self, dtype: str) -> NkiTensor:
        self._no_dyn("view")
        dtype = dt.normalize(dtype)
        a, b = dt.itemsize(self.dtype), dt.itemsize(dtype)
        if a == b:
            return self._new(self.shape, self.strides, self.offset, dtype=dtype)
        if self.shape[-1] != 1 and self.strides[-1] != 1:
            raise errors.ShapeError("view: the last dimension must be contiguous [NL view]")
        last = self.shape[-1] * a
        if last % b:
            raise errors.ShapeError(f"view: last dim of {self.shape[-1]} x {a} bytes is not divisible into {dtype}")
        strides = []
        for s in self.strides[:-1]:
            if (s * a) % b:
                raise errors.ShapeError(f"view: stride {s} not representable in {dtype}")
            strides.append(s * a // b)
        if (self.offset * a) % b:
            raise errors.ShapeError(f"view: offset not aligned to {dtype}")
        return self._new(self.shape[:-1] + (last // b,), strides + [1], self.offset * a // b, dtype=dtype)

    reinterpret_cast = view


def _check_index_tensor(t: Any, what: str) -> None:
    if not isinstance(t, NkiTensor) or t.buffer is not MemoryRegion.sbuf:
        raise errors.NkiValidationError(f"{what}: vector_offset must be an SBUF tensor of shape (P, 1) [APS]")
    # issue 28 (nki-library peer suite): ``.ap(vector_offset=...)`` takes "an SBUF tensor" of offsets [APS], one per
    # partition; nki-library passes a (P, 1, 1) view [L-RTK]. Only ``vector_select`` documents the shape (P, 1) [NL].
    per_partition = t.ndim >= 2 and math.prod(t.shape[1:]) == 1
    if not (per_partition if what == "ap" else (t.ndim == 2 and t.shape[1] == 1)):
        raise errors.ShapeError(
            f"{what}: vector_offset must hold one index per partition ({'(P, 1, ...)' if what == 'ap' else '(P, 1)'}), "
            f"got {t.shape}"
        )
    if not dt.is_int(t.dtype):
        raise errors.NkiValidationError(f"{what}: vector_offset dtype must be an integer type, got {t.dtype}")


def allocate(shape: Any, dtype: Any, buffer: Any, name: str = "", fill: float | None = None) -> NkiTensor:
    """``nl.ndarray``: a fresh buffer, poisoned with NaN (floats) or 4 (ints) unless ``fill`` is given [SIM].

    Inside an LNC=2 launch a ``shared_hbm`` allocation is one tensor for both programs: the programs run one after
    the other and program 1's n-th allocation at a source site gets the tensor program 0's n-th allocation there
    created (and vice versa), unpoisoned a second time (see ``runtime.Launch``) [LNC]."""
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 1 for s in shape):
        raise errors.ShapeError(f"nl.ndarray: shape must be non-empty with positive sizes, got {shape}")
    dtype = dt.normalize(dtype)
    region = _region(buffer)
    if not is_hbm(region) and shape[0] > PMAX:
        raise errors.PartitionLimitError(
            f"nl.ndarray: {region.value} tensor '{name}' has partition dim {shape[0]} > {PMAX} [TILING]"
        )

    def fresh() -> Storage:
        st = Storage(shape, dtype, region, name or f"{region.value}_tensor")
        value = dt.poison_value(dtype) if fill is None else fill
        st.typed(dtype)[:] = dt.cast(np.asarray(value), dtype)
        return st

    kctx = ctx()
    if region is MemoryRegion.shared_hbm and kctx.launch is not None:
        st = kctx.launch.shared_hbm(kctx, shape, dtype, fresh)
    else:
        if not is_hbm(region):
            kctx.record_alloc(region, math.prod(shape[1:]) * dt.itemsize(dtype))
        st = fresh()
    return NkiTensor(st, dtype, shape, _row_major(shape), 0)


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for k in reversed(shape):
        strides.insert(0, acc)
        acc *= k
    return tuple(strides)


def from_numpy(arr: np.ndarray, buffer: MemoryRegion = MemoryRegion.shared_hbm, name: str = "") -> NkiTensor:
    """Wrap a copy of a NumPy array as an HBM tensor (kernel argument)."""
    dtype = dt.normalize(arr.dtype)
    arr = np.ascontiguousarray(arr)
    shape = arr.shape if arr.ndim else (1,)
    st = Storage(tuple(shape), dtype, buffer, name or "arg")
    st.typed(dtype)[:] = arr.reshape(-1).view(dt.np_dtype(dtype))
    strides = []
    acc = 1
    for k in reversed(shape):
        strides.insert(0, acc)
        acc *= k
    return NkiTensor(st, dtype, tuple(shape), tuple(strides), 0)


def to_numpy(t: NkiTensor) -> np.ndarray:
    """Copy of a tensor's values (a view's elements in row-major order, shape = view shape)."""
    return np.array(t.read_raw("to_numpy"))


def warn(msg: str) -> None:
    if ctx().dry:  # a traced-only body's data is not real (KernelContext.traced_only)
        return
    warnings.warn(msg, stacklevel=3)
