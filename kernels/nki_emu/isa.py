"""``nki.isa`` of the emulator: the NKI 0.6 instructions the project's kernels use.

Every instruction runs eagerly in NumPy, vectorised over the whole tile. Engines read operands as
fp32, compute in fp32 and cast on write (see ``dtypes``) [SHARED, TRN1, ISA]; TensorE sums each
matmul exactly (float64, then one rounding to fp32) and accumulates across matmuls in fp32 PSUM.
Checks raise subclasses of ``errors.NkiValidationError`` naming the instruction and the operand. Tags in
brackets are the sources listed in docs/nki-0.6.md.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

import numpy as np

from . import dtypes as dt
from . import errors, ops
from .memory import (
    PMAX,
    PSUM_BANK_BYTES,
    MemoryRegion,
    NkiTensor,
    VirtualRegister,
    ctx,
    is_hbm,
    warn,
)

__all__ = [
    "NkiValidationError",
    "VirtualRegister",
    "activation",
    "dge_mode",
    "dma_copy",
    "engine",
    "iota",
    "matmul_perf_mode",
    "memset",
    "nc_matmul",
    "nc_transpose",
    "oob_mode",
    "range_select",
    "reciprocal",
    "reduce_cmd",
    "register_alloc",
    "register_load",
    "scalar_tensor_tensor",
    "tensor_copy",
    "tensor_copy_predicated",
    "tensor_reduce",
    "tensor_scalar",
    "tensor_tensor",
]

NkiValidationError = errors.NkiValidationError  # ``nisa.NkiValidationError`` [ISA]

# ---- enums [ISA] ---------------------------------------------------------------------------------
engine = Enum("engine", {"unknown": 0, "tensor": 1, "scalar": 2, "gpsimd": 3, "dma": 4, "vector": 5, "sync": 6})
reduce_cmd = Enum("reduce_cmd", {"idle": 0, "reset": 1, "reduce": 2, "reset_reduce": 3, "load_reduce": 4})
dge_mode = Enum("dge_mode", {"unknown": 0, "swdge": 1, "hwdge": 2, "none": 3})
oob_mode = Enum("oob_mode", {"error": 0, "skip": 1})
matmul_perf_mode = Enum("matmul_perf_mode", {"none": "none", "double_row": "double_row"})

# Instruction parameters shadow the enum names (NKI's own signatures), so code refers to these aliases.
_OOB, _DGE, _ENGINE, _RCMD = oob_mode, dge_mode, engine, reduce_cmd


# ---- operand helpers ---------------------------------------------------------------------------
def _tensor(t: Any, op: str, name: str) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        raise errors.NkiValidationError(f"{op}: operand '{name}' must be an NkiTensor, got {type(t).__name__}")
    return t


def _onchip(t: Any, op: str, name: str, allow: tuple[MemoryRegion, ...] = (MemoryRegion.sbuf, MemoryRegion.psum)):
    t = _tensor(t, op, name)
    if t.buffer not in allow:
        where = "/".join(a.value.upper() for a in allow)
        raise errors.MemorySpaceError(f"{op}: operand '{name}' must be in {where}, is in {t.buffer.value}")
    if t.shape[0] > PMAX:
        raise errors.PartitionLimitError(f"{op}: {name} partition dimension {t.shape[0]} exceeds maximum {PMAX}")
    return t


def _free(t: NkiTensor) -> int:
    return math.prod(t.shape[1:]) if t.ndim > 1 else 1


def _same_layout(a: NkiTensor, b: NkiTensor, op: str, an: str, bn: str) -> None:
    if a.shape[0] != b.shape[0] or _free(a) != _free(b):
        raise errors.ShapeError(
            f"{op}: '{an}' {a.shape} and '{bn}' {b.shape} must have the same partition count and the same "
            "number of elements per partition [ISA]"
        )


def _like_dst(op: str, dst: Any, **operands: Any) -> tuple[NkiTensor, ...]:
    """dst and the named operands, each on chip (SBUF or PSUM) with dst's partition count and elements per
    partition [ISA]; at most one of the operands in PSUM."""
    out = [_onchip(dst, op, "dst")]
    for name, t in operands.items():
        out.append(_onchip(t, op, name))
        _same_layout(out[0], out[-1], op, "dst", name)
    in_psum = [name for name, t in zip(operands, out[1:]) if t.buffer is MemoryRegion.psum]
    if len(in_psum) > 1:
        raise errors.MemorySpaceError(f"{op}: {' and '.join(in_psum)} cannot both be in PSUM [ISA]")
    return tuple(out)


def _rd(t: NkiTensor, op: str) -> np.ndarray:
    """Engine read: values as fp32, shape (partitions, elements per partition)."""
    return dt.to_f32(t.read_raw(op)).reshape(t.shape[0], -1)


def _rd_raw(t: NkiTensor, op: str) -> np.ndarray:
    return t.read_raw(op).reshape(t.shape[0], -1)


def _wr(t: NkiTensor, vals: np.ndarray, op: str) -> None:
    t.write_raw(dt.cast(vals, t.dtype).reshape(t.shape), op)


def _count(op: str) -> None:
    ctx().counters.count(op)


def _scalar_or_column(v: Any, parts: int, op: str, name: str, fp32_only: bool = False) -> np.ndarray:
    """A compile-time scalar or a (P, 1) tile broadcast along the free dim, as fp32 (P, 1)."""
    if isinstance(v, NkiTensor):
        _onchip(v, op, name)
        if v.shape[0] != parts or _free(v) != 1:
            raise errors.ShapeError(f"{op}: '{name}' must be a scalar or a ({parts}, 1) tile, got {v.shape}")
        if fp32_only and v.dtype != dt.float32:
            raise errors.DtypeError(f"{op}: '{name}' tile must be float32, got {v.dtype} [ISA]")
        return _rd(v, op)
    if isinstance(v, VirtualRegister):
        raise errors.NkiValidationError(f"{op}: '{name}' cannot be a VirtualRegister")
    if isinstance(v, (bool, int, float, np.number)):
        return np.full((parts, 1), np.float32(v), np.float32)
    raise errors.NkiValidationError(f"{op}: '{name}' must be a number or a ({parts}, 1) tile, got {type(v).__name__}")


def _alu(name: str, a: np.ndarray, b: np.ndarray | None, op: str) -> np.ndarray:
    if name in _NOT_ON_TRN2:
        raise errors.NkiValidationError(f"{op}: {_NOT_ON_TRN2[name]}")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if name in ops.UNARY_ALU:
            return ops.UNARY_ALU[name](a).astype(np.float32)
        if name in ops.ARITH:
            if b is None:
                raise errors.NkiValidationError(f"{op}: binary op {name} needs an operand")
            return ops.ARITH[name](a, b).astype(np.float32)
    raise errors.NkiValidationError(
        f"{op}: {name} is not an arithmetic ALU op (bitvec ops need integer tiles) [SHARED]"
    )


_NOT_ON_TRN2 = {
    "divide": "nl.divide is not an ALU operator of the ISA [SHARED] (device compilers reject it); use "
    "nisa.reciprocal then nl.multiply",
    "abs_max": "nl.abs_max is NeuronCore-v4 only [SHARED, RN 0.4.0]",
    "abs_min": "nl.abs_min is NeuronCore-v4 only [SHARED, RN 0.4.0]",
}


def _is_bitvec(name: str) -> bool:
    return name in ops.BITVEC or name in ops.UNARY_BITVEC


def _int_vals(t: NkiTensor, op: str) -> np.ndarray:
    return _rd_raw(t, op).astype(np.int64)


# ---- data movement ---------------------------------------------------------------------------
def dma_copy(
    dst: NkiTensor,
    src: NkiTensor,
    priority: Any = None,
    oob_mode: oob_mode = oob_mode.error,
    dge_mode: dge_mode = dge_mode.unknown,
    engine: engine = engine.unknown,
    name: str | None = None,
) -> None:
    """``dst = src`` on the DMA queues [ISA dma_copy, DMAOV].

    src/dst in HBM or SBUF, never PSUM [ISA, MIG]; only the total element count must match, elements
    pair in row-major order of each view (implied, UNCONFIRMED) [ISA]. Different dtypes convert
    src -> fp32 -> dst [ISA]; ``dge_mode.hwdge`` requires equal dtypes and no vector_offset [MIG, DGE].
    Dynamic views (``.ap(scalar_offset=...)`` / ``.ap(vector_offset=...)``) are bounds-checked:
    ``oob_mode.error`` raises ``errors.OutOfBoundsError`` naming the index, ``oob_mode.skip`` leaves the
    destination elements of the out-of-bounds rows (vector) or of the whole transfer (scalar)
    untouched [ISA]. An index is in bounds when ``0 <= index < shape[indirect_dim]`` of the tensor
    ``.ap`` was called on and every addressed element lies inside the buffer; negative indices
    (int32 -1) and uint32 0xFFFFFFFF are out of bounds (exact hardware bound UNCONFIRMED).
    Counters: bytes actually moved (see ``Counters``), one DMA instruction per call.
    """
    op = "dma_copy"
    dst = _tensor(dst, op, "dst")
    src = _tensor(src, op, "src")
    for t, n in ((dst, "dst"), (src, "src")):
        if t.buffer is MemoryRegion.psum:
            raise errors.MemorySpaceError(
                f"{op}: '{n}' is in PSUM; DMA cannot access PSUM (copy to SBUF first) [ISA, MIG]"
            )
        if t.onchip and t.shape[0] > PMAX:
            raise errors.PartitionLimitError(f"{op}: {n} partition dimension {t.shape[0]} exceeds maximum {PMAX}")
    if dst.size != src.size:
        raise errors.ShapeError(
            f"{op}: element counts differ: dst {dst.shape} ({dst.size}) vs src {src.shape} ({src.size})"
        )
    for t, n in ((dst, "dst"), (src, "src")):
        if t.indirect is not None and t.indirect.kind == "vector" and dge_mode is _DGE.hwdge:
            raise errors.NkiValidationError(f"{op}: vector_offset on '{n}' needs swdge, not hwdge [DGE]")
    if dge_mode is _DGE.hwdge and dst.dtype != src.dtype:
        raise errors.DtypeError(
            f"{op}: hwdge requires equal dtypes (dst {dst.dtype}, src {src.dtype}); use .view() [MIG]"
        )
    if oob_mode not in (_OOB.error, _OOB.skip):
        raise errors.NkiValidationError(
            f"{op}: oob_mode must be nisa.oob_mode.error or .skip (raw ints rejected [MIG])"
        )
    skip = oob_mode is _OOB.skip
    vector = any(t.indirect is not None and t.indirect.kind == "vector" for t in (src, dst))
    if not vector:
        s_off, s_msg = src.base_offset()
        d_off, d_msg = dst.base_offset()
        s_view = None if s_msg else src.strided_view(s_off)
        d_view = None if d_msg else dst.strided_view(d_off)
        bad = [(m or "access", n) for v, m, n in ((s_view, s_msg, "src"), (d_view, d_msg, "dst")) if v is None]
        if bad and not skip:
            raise errors.OutOfBoundsError(f"{op}: out-of-bounds {bad[0][0]} on '{bad[0][1]}'")
        if bad:
            vals = np.zeros(0, dt.np_dtype(dst.dtype))
        else:
            vals = s_view.reshape(-1)
            if src.dtype != dst.dtype:
                vals = dt.cast(dt.to_f32(vals), dst.dtype)
            d_view[...] = vals.reshape(dst.shape)
    else:
        s_idx, s_valid, s_msg = src.element_index()
        d_idx, d_valid, d_msg = dst.element_index()
        if not skip:
            for valid, msg, n in ((s_valid, s_msg, "src"), (d_valid, d_msg, "dst")):
                if valid is not None:
                    raise errors.OutOfBoundsError(f"{op}: out-of-bounds {msg} on '{n}'")
        s_flat = s_idx.reshape(-1)
        d_flat = d_idx.reshape(-1)
        valid = np.ones(s_flat.shape, bool)
        if s_valid is not None:
            valid &= s_valid.reshape(-1)
        if d_valid is not None:
            valid &= d_valid.reshape(-1)
        if not valid.all():
            s_flat, d_flat = s_flat[valid], d_flat[valid]
        vals = src.storage.typed(src.dtype)[s_flat]
        if src.dtype != dst.dtype:
            vals = dt.cast(dt.to_f32(vals), dst.dtype)
        dst.storage.typed(dst.dtype)[d_flat] = vals
    n = int(vals.size)
    if not dst.onchip and n:
        dst.storage.written = True
    c = ctx().counters
    c.dma_instructions += 1
    c.count(op)
    s_h, d_h = is_hbm(src.buffer), is_hbm(dst.buffer)
    if s_h and d_h:
        c.dma_hbm_to_hbm_bytes += n * dt.itemsize(src.dtype)
    elif s_h:
        c.dma_hbm_to_sbuf_bytes += n * dt.itemsize(src.dtype)
    elif d_h:
        c.dma_sbuf_to_hbm_bytes += n * dt.itemsize(dst.dtype)
    else:
        c.dma_sbuf_to_sbuf_bytes += n * dt.itemsize(src.dtype)


def tensor_copy(dst: NkiTensor, src: NkiTensor, engine: engine = engine.unknown, name: str | None = None) -> None:
    """On-chip copy [ISA tensor_copy]: same partition count and elements per partition; equal dtypes
    copy bits exactly, different dtypes cast through fp32. GpSimd cannot access PSUM."""
    op = "tensor_copy"
    dst, src = _like_dst(op, dst, src=src)
    if engine is _ENGINE.gpsimd and MemoryRegion.psum in (dst.buffer, src.buffer):
        raise errors.MemorySpaceError(f"{op}: GpSimd cannot access PSUM [ISA]")
    _count(op)
    if src.dtype == dst.dtype:
        dst.write_raw(_rd_raw(src, op).reshape(dst.shape), op)
    else:
        _wr(dst, _rd(src, op), op)


def memset(dst: NkiTensor, value: Any, engine: engine = engine.unknown, name: str | None = None) -> None:
    """Fill ``dst`` with a compile-time constant [ISA memset]. Integer tiles need an integer literal
    (strict type matching since 0.3 [MIG]); float tiles accept ints or floats (the float case of the
    strict rule is UNCONFIRMED, so we accept both)."""
    op = "memset"
    dst = _onchip(dst, op, "dst")
    if isinstance(value, (NkiTensor, VirtualRegister)):
        raise errors.NkiValidationError(f"{op}: value must be a compile-time constant")
    if dt.is_int(dst.dtype) and not isinstance(value, (int, np.integer)):
        raise errors.DtypeError(
            f"{op}: integer dst '{dst.name}' ({dst.dtype}) needs an integer value, got {value!r} [MIG]"
        )
    _count(op)
    if dt.is_int(dst.dtype):
        vals = np.full(dst.shape, int(value), np.int64)
    else:
        vals = np.full(dst.shape, np.float32(value), np.float32)
    dst.write_raw(dt.cast(vals, dst.dtype), op)


def iota(dst: NkiTensor, pattern: Any, offset: int = 0, channel_multiplier: int = 0, name: str | None = None) -> None:
    """``dst[p, i...] = offset + p * channel_multiplier + sum(step_k * i_k)`` over ``pattern =
    [[step, num], ...]`` in int32 arithmetic, cast to dst [ISA iota]. dst in SBUF; the pattern's
    element count must equal dst's elements per partition."""
    op = "iota"
    dst = _onchip(dst, op, "dst", (MemoryRegion.sbuf,))
    steps = [int(p[0]) for p in pattern]
    nums = [int(p[1]) for p in pattern]
    if len(pattern) > 4 or math.prod(nums) != _free(dst):
        raise errors.ShapeError(
            f"{op}: pattern {pattern} has {math.prod(nums)} elements, dst has {_free(dst)} per partition"
        )
    _count(op)
    v = np.full((1,), int(offset), np.int64)
    for s, n in zip(steps, nums):
        v = (v[:, None] + s * np.arange(n, dtype=np.int64)[None, :]).reshape(-1)
    vals = np.arange(dst.shape[0], dtype=np.int64)[:, None] * int(channel_multiplier) + v[None, :]
    vals = vals.astype(np.int32).astype(np.int64)
    _wr(dst, vals if dt.is_int(dst.dtype) else vals.astype(np.float64), op)


# ---- Tensor Engine ---------------------------------------------------------------------------
def _perf(perf_mode: Any) -> str:
    if isinstance(perf_mode, matmul_perf_mode):
        return perf_mode.value
    if perf_mode in ("none", "double_row", None):
        return perf_mode or "none"
    raise errors.NkiValidationError(f"nc_matmul: unknown perf_mode {perf_mode!r}")


def _check_bank(dst: NkiTensor, op: str) -> None:
    """A matmul output must lie within one 2 KiB PSUM bank of each partition [ISA, TRN2]."""
    isz = dt.itemsize(dst.dtype)
    lo = dst.offset % dst.partition_stride()
    hi = lo + sum((n - 1) * s for n, s in zip(dst.shape[1:], dst.strides[1:]))
    lo_b, hi_b = lo * isz, hi * isz + isz - 1
    if lo_b // PSUM_BANK_BYTES != hi_b // PSUM_BANK_BYTES:
        raise errors.MatmulLimitError(
            f"{op}: dst '{dst.name}' {dst.shape} spans PSUM bytes {lo_b}..{hi_b} of each partition, crossing a "
            f"{PSUM_BANK_BYTES}-byte bank boundary (one matmul output must fit one bank) [ISA, TRN2]"
        )


def nc_matmul(
    dst: NkiTensor,
    stationary: NkiTensor,
    moving: NkiTensor,
    is_stationary_onezero: bool = False,
    is_moving_onezero: bool = False,
    is_transpose: bool = False,
    accumulate: bool | None = None,
    tile_position: tuple = (),
    tile_size: tuple = (),
    perf_mode: Any = matmul_perf_mode.none,
    name: str | None = None,
) -> None:
    """``dst = stationary.T @ moving`` on TensorE [ISA nc_matmul, TRN1, TRN2].

    Contraction over the partition dim (<= 128, equal for both operands); ``dst`` partitions =
    stationary free size (<= 128), ``dst`` free = moving free size (<= 512 on trn2); free dims of
    operands with > 2 dims are flattened (UNCONFIRMED order: row-major). stationary/moving in SBUF,
    dst in PSUM, dst float32 (trn2), one matmul output within one 2 KiB PSUM bank. fp32/tf32 only
    pair with fp32/tf32; ``float8_e4m3fn`` is trn3-only [ISA].

    ``perf_mode=double_row`` (enum, or the string ``'double_row'`` as nki-library spells it — string
    acceptance UNCONFIRMED): both operands FP8 (``float8_e4m3``/``float8_e5m2``), layouts
    ``stationary [Kp, 2, M]``, ``moving [Kp, 2, N]``, ``dst [M, N]``,
    ``dst[m, n] = sum_p sum_h st[p, h, m] * mv[p, h, n]`` (contraction 2 x Kp <= 256); not with
    ``is_transpose`` [ISA, TRN2].

    Accumulation in fp32 PSUM: each instruction's K-sum is computed exactly (float64) and rounded
    once to fp32 (the hardware's internal order is not modelled); ``accumulate=False`` overwrites,
    ``True`` adds to the fp32 PSUM content (warns on locations no matmul wrote), ``None`` overwrites
    locations not yet written by a matmul since allocation and adds elsewhere (tracked per PSUM
    element; the 0.6 granularity is UNCONFIRMED) [ISA, RN 0.6.0].

    ``is_transpose=True``: bit-exact PE transpose, ``moving`` must be the [K, K] identity and
    ``dst.dtype == stationary.dtype`` (16-bit PSUM output for 16-bit inputs [TRN2]); FP8 is rejected
    (transpose via bf16 [L-ABT]).
    """
    op = "nc_matmul"
    dst = _onchip(dst, op, "dst", (MemoryRegion.psum,))
    st = _onchip(stationary, op, "stationary", (MemoryRegion.sbuf,))
    mv = _onchip(moving, op, "moving", (MemoryRegion.sbuf,))
    mode = _perf(perf_mode)
    k = st.shape[0]
    if mv.shape[0] != k:
        raise errors.MatmulLimitError(f"{op}: stationary ({k}) and moving ({mv.shape[0]}) partition sizes differ [ISA]")
    row_max, col_max = PMAX, PMAX
    if tile_size:
        row_max, col_max = int(tile_size[0]), int(tile_size[1])
        if mode == "double_row" and col_max != PMAX:
            raise errors.MatmulLimitError(f"{op}: double_row cannot be combined with column tiling [ISA]")
    if k > row_max:
        raise errors.MatmulLimitError(f"{op}: contraction (partition) size {k} exceeds {row_max} [ISA]")
    for t, n in ((st, "stationary"), (mv, "moving")):
        if t.dtype == dt.float8_e4m3fn:
            raise errors.DtypeError(f"{op}: {n} dtype float8_e4m3fn is NeuronCore-v4 only; trn2 uses float8_e4m3 [ISA]")
    fp32ish = {dt.float32, dt.tfloat32}
    if (st.dtype in fp32ish) != (mv.dtype in fp32ish):
        raise errors.DtypeError(
            f"{op}: float32/tfloat32 operands must pair with float32/tfloat32 ({st.dtype}, {mv.dtype})"
        )
    if mode == "double_row":
        if is_transpose:
            raise errors.MatmulLimitError(f"{op}: double_row cannot be combined with is_transpose [ISA, TRN2]")
        for t, n in ((st, "stationary"), (mv, "moving")):
            if t.dtype not in (dt.float8_e4m3, dt.float8_e5m2):
                raise errors.DtypeError(f"{op}: double_row needs fp8 operands; {n} is {t.dtype} [ISA]")
            if t.ndim < 3 or t.shape[1] != 2:
                raise errors.MatmulLimitError(
                    f"{op}: double_row {n} must be laid out [K/2 partitions, 2, free], got {t.shape} [ISA, TRN2]"
                )
        m = math.prod(st.shape[2:])
        nfree = math.prod(mv.shape[2:])
        kk = 2 * k
    else:
        m, nfree, kk = _free(st), _free(mv), k
    if m > col_max:
        raise errors.MatmulLimitError(f"{op}: stationary free size {m} exceeds {col_max} [ISA]")
    if nfree > 512:
        raise errors.MatmulLimitError(f"{op}: moving free size {nfree} exceeds 512 (one PSUM bank of fp32) [ISA]")
    if dst.shape[0] != m or _free(dst) != nfree:
        raise errors.ShapeError(f"{op}: dst {dst.shape} must be [{m}, {nfree}] (stationary free x moving free) [ISA]")
    _count(op)
    c = ctx().counters
    c.matmul_instructions += 1
    c.matmul_macs += kk * m * nfree
    if is_transpose:
        if st.dtype in dt.FP8_DTYPES:
            raise errors.DtypeError(f"{op}: is_transpose with fp8 is not supported; transpose via bf16 [L-ABT]")
        if dst.dtype != st.dtype:
            raise errors.DtypeError(
                f"{op}: is_transpose dst dtype {dst.dtype} must equal stationary dtype {st.dtype} [TRN2]"
            )
        if nfree != k or not np.array_equal(_rd(mv, op), np.eye(k, dtype=np.float32)):
            raise errors.MatmulLimitError(f"{op}: is_transpose needs moving = the [{k}, {k}] identity [ISA]")
        _check_bank(dst, op)
        dst.write_raw(_rd_raw(st, op).reshape(k, m).T.reshape(dst.shape), op)
        return
    if dst.dtype != dt.float32:
        raise errors.DtypeError(f"{op}: dst must be float32 on trn2, got {dst.dtype} [ISA]")
    _check_bank(dst, op)
    a = _rd(st, op).astype(np.float64).reshape(kk, m)
    b = _rd(mv, op).astype(np.float64).reshape(kk, nfree)
    res = (a.T @ b).astype(np.float32)
    _psum_accumulate(dst, res, accumulate, op)


def _psum_accumulate(dst: NkiTensor, res: np.ndarray, accumulate: bool | None, op: str) -> None:
    mask = np.ndarray(dst.shape, np.bool_, dst.storage.mm_written, dst.offset, dst.strides)
    written = mask.reshape(dst.shape[0], -1)
    if accumulate is None:
        out = np.where(written, _rd(dst, op) + res, res).astype(np.float32)
    elif accumulate:
        if not written.all():
            warn(f"{op}: accumulate=True onto PSUM '{dst.name}' locations no matmul has written (undefined on hw)")
        out = (_rd(dst, op) + res).astype(np.float32)
    else:
        out = res
    _wr(dst, out, op)
    mask[...] = True


def nc_transpose(dst: NkiTensor, data: NkiTensor, engine: engine = engine.unknown, name: str | None = None) -> None:
    """Swap the partition axis and the (flattened) free axis, bit-exact [ISA nc_transpose].

    TensorE (``engine.tensor``, or unknown with data in SBUF and dst in PSUM): data SBUF <= [128, 128]
    -> dst PSUM. VectorE: <= [32, 32], SBUF or PSUM on both sides. ``dst.dtype == data.dtype``;
    fp8 rejected on TensorE (nki-library detours via bf16 [L-ABT]).
    """
    op = "nc_transpose"
    dst = _onchip(dst, op, "dst")
    data = _onchip(data, op, "data")
    p, f = data.shape[0], _free(data)
    if dst.shape[0] != f or _free(dst) != p:
        raise errors.ShapeError(f"{op}: dst {dst.shape} must be the transpose [{f}, {p}] of data {data.shape}")
    if dst.dtype != data.dtype:
        raise errors.DtypeError(f"{op}: dst dtype {dst.dtype} must equal data dtype {data.dtype} [ISA]")
    use_pe = engine is _ENGINE.tensor or (
        engine is _ENGINE.unknown and data.buffer is MemoryRegion.sbuf and dst.buffer is MemoryRegion.psum
    )
    if use_pe:
        if data.buffer is not MemoryRegion.sbuf or dst.buffer is not MemoryRegion.psum:
            raise errors.MemorySpaceError(f"{op}: TensorE transpose reads SBUF and writes PSUM [ISA]")
        if f > PMAX:
            raise errors.MatmulLimitError(f"{op}: data free size {f} exceeds 128 [ISA]")
        if data.dtype in dt.FP8_DTYPES:
            raise errors.DtypeError(f"{op}: fp8 transpose is not supported; transpose via bf16 [L-ABT]")
        _check_bank(dst, op)
        ctx().counters.transpose_instructions += 1
    else:
        if p > 32 or f > 32:
            raise errors.MatmulLimitError(f"{op}: VectorE transpose is limited to [32, 32], got [{p}, {f}] [ISA]")
    _count(op)
    dst.write_raw(_rd_raw(data, op).T.reshape(dst.shape), op)


# ---- Scalar Engine ---------------------------------------------------------------------------
def _reduce_regs(regs: np.ndarray, y: np.ndarray, rn: str, cmd: Any, reduce_res: NkiTensor | None, op: str) -> None:
    """An engine's per-partition fp32 accumulator registers under ``reduce_cmd`` [ISA]: ``reset`` sets them to the
    identity of ``rn``, ``reduce`` folds in the ``rn``-reduction of each row of ``y``, ``reset_reduce`` does both,
    ``idle`` leaves them; ``reduce_res`` (P, 1) receives them."""
    if not isinstance(cmd, _RCMD):
        raise errors.NkiValidationError(f"{op}: reduce_cmd must be a nisa.reduce_cmd value")
    if cmd is _RCMD.load_reduce:
        raise errors.NkiValidationError(f"{op}: reduce_cmd.load_reduce is not emulated")
    parts = y.shape[0]
    if cmd in (_RCMD.reset, _RCMD.reset_reduce):
        regs[:parts] = ops.REDUCE_INIT[rn]
    if cmd in (_RCMD.reduce, _RCMD.reset_reduce):
        rows = ops.reduce_arith(rn, y, (1,))
        regs[:parts] = ops.reduce_arith(rn, np.stack([regs[:parts], rows], axis=1), (1,))
    if reduce_res is not None:
        _wr(reduce_res, regs[:parts].reshape(parts, 1), op)


def activation(
    dst: NkiTensor,
    op: Any,
    data: NkiTensor,
    bias: Any = None,
    scale: Any = 1.0,
    reduce_op: Any = None,
    reduce_res: NkiTensor | None = None,
    reduce_cmd: reduce_cmd = reduce_cmd.idle,
    name: str | None = None,
) -> None:
    """``dst = op(data * scale + bias)`` on ScalarE in fp32 [ISA activation].

    ``scale``: compile-time float or (P, 1) float32 tile; ``bias``: (P, 1) tile (any dtype) or, on v3+,
    a scalar; both broadcast along the free dim. The multiply and the add round separately in fp32
    (fused-ness on hardware UNCONFIRMED). Reduction: ``reduce_op`` must be ``nl.add``; per-partition
    fp32 registers shared by the activation family persist across instructions; ``reduce_cmd``
    ``reset`` zeroes them, ``idle`` leaves them, ``reduce`` adds the row sums of this instruction's
    fp32 output, ``reset_reduce`` zeroes then adds (the docstring's pseudocode is ambiguous; this is
    docs/nki-0.6.md's reading, UNCONFIRMED); ``reduce_res`` (P, 1) receives the registers. Registers are
    NaN-poisoned at kernel start, so reading them with ``idle`` before any reset shows NaN.
    """
    opn = "activation"
    fn_name = ops.op_name(op, opn)
    if fn_name not in ops.ACTIVATIONS:
        raise errors.NkiValidationError(f"{opn}: op {fn_name} is not an activation function [SHARED]")
    dst, data = _like_dst(opn, dst, data=data)
    parts = data.shape[0]
    if isinstance(bias, NkiTensor) and bias.dtype == dt.tfloat32:
        raise errors.DtypeError(f"{opn}: bias cannot be tfloat32 [ISA]")
    sc = _scalar_or_column(scale, parts, opn, "scale", fp32_only=True)
    bi = None if bias is None else _scalar_or_column(bias, parts, opn, "bias")
    if reduce_op is not None and ops.op_name(reduce_op, opn) != "add":
        raise errors.NkiValidationError(f"{opn}: reduce_op must be nl.add [ISA]")
    if reduce_res is not None:
        reduce_res = _onchip(reduce_res, opn, "reduce_res")
        if reduce_res.shape[0] != parts or _free(reduce_res) != 1:
            raise errors.ShapeError(f"{opn}: reduce_res must be ({parts}, 1), got {reduce_res.shape}")
    _count(opn)
    x = _rd(data, opn)
    with np.errstate(invalid="ignore", over="ignore"):
        t = x * sc
        if bi is not None:
            t = t + bi
    y = ops.activation_fn(fn_name)(t)
    _wr(dst, y, opn)
    _reduce_regs(ctx().act_regs, y, "add", reduce_cmd, reduce_res, opn)


# ---- Vector Engine ---------------------------------------------------------------------------
def tensor_tensor(
    dst: NkiTensor,
    data1: NkiTensor,
    data2: NkiTensor,
    op: Any,
    engine: engine = engine.unknown,
    name: str | None = None,
) -> None:
    """``dst = data1 op data2`` elementwise [ISA tensor_tensor].

    Same partition count and elements per partition for all three; data1 and data2 not both in PSUM.
    Float math in fp32, cast on write; when data1, data2 and dst are all integer tiles the arithmetic
    is exact integer math (GpSimd) wrapped to dst's width; bitvec ops need integer tiles [ISA, SHARED].
    """
    opn = "tensor_tensor"
    name_ = ops.op_name(op, opn)
    dst, a, b = _like_dst(opn, dst, data1=data1, data2=data2)
    all_int = dt.is_int(a.dtype) and dt.is_int(b.dtype) and dt.is_int(dst.dtype)
    _count(opn)
    if _is_bitvec(name_) or (all_int and name_ in ("add", "subtract", "multiply", "maximum", "minimum")):
        if not all_int:
            raise errors.DtypeError(f"{opn}: bitvec op {name_} needs integer tiles [SHARED]")
        x, y = _int_vals(a, opn), _int_vals(b, opn)
        fn = (
            ops.BITVEC.get(name_)
            or {
                "add": np.add,
                "subtract": np.subtract,
                "multiply": np.multiply,
                "maximum": np.maximum,
                "minimum": np.minimum,
            }[name_]
        )
        _wr(dst, fn(x, y), opn)
        return
    _wr(dst, _alu(name_, _rd(a, opn), _rd(b, opn), opn), opn)


def _ts_apply(x: np.ndarray, name: str, operand: np.ndarray | None, reverse: bool, op: str) -> np.ndarray:
    if name in ops.UNARY_ALU:
        return _alu(name, x, None, op)
    return _alu(name, operand, x, op) if reverse else _alu(name, x, operand, op)


def tensor_scalar(
    dst: NkiTensor,
    data: NkiTensor,
    op0: Any,
    operand0: Any,
    reverse0: bool = False,
    op1: Any = None,
    operand1: Any = None,
    reverse1: bool = False,
    engine: engine = engine.unknown,
    name: str | None = None,
) -> None:
    """``dst = (data op0 operand0) op1 operand1`` [ISA tensor_scalar].

    Operands: compile-time scalars (rounded to fp32) or (P, 1) float32 tiles broadcast along the free
    dim; ``reverse0`` computes ``operand0 op0 data``, ``reverse1`` ``operand1 op1 tmp``; ``op1`` and
    ``operand1`` both None when unused; unary op0 (``nl.abs`` ...) ignores operand0. fp32 math, one
    rounding per op, cast on write. Bitvec ops (integer data, integer scalar operands) work on raw
    integers; both ops must be of the same kind [ISA].
    """
    opn = "tensor_scalar"
    dst, data = _like_dst(opn, dst, data=data)
    n0 = ops.op_name(op0, opn)
    n1 = None if op1 is None else ops.op_name(op1, opn)
    if (op1 is None) != (operand1 is None) and n1 not in ops.UNARY_ALU:
        raise errors.NkiValidationError(f"{opn}: op1 and operand1 must both be given or both be None [ISA]")
    parts = data.shape[0]
    _count(opn)
    if _is_bitvec(n0) or (n1 is not None and _is_bitvec(n1)):
        if not (_is_bitvec(n0) and (n1 is None or _is_bitvec(n1))):
            raise errors.NkiValidationError(f"{opn}: op0 and op1 must both be bitvec or both arithmetic [ISA]")
        if not (dt.is_int(data.dtype) and dt.is_int(dst.dtype)):
            raise errors.DtypeError(f"{opn}: bitvec ops need integer data and dst [ISA]")
        x = _int_vals(data, opn)
        for nm, operand, rev in ((n0, operand0, reverse0), (n1, operand1, reverse1)):
            if nm is None:
                continue
            if nm in ops.UNARY_BITVEC:
                x = ops.UNARY_BITVEC[nm](x)
                continue
            v = _int_vals(operand, opn) if isinstance(operand, NkiTensor) else np.int64(int(operand))
            x = ops.BITVEC[nm](v, x) if rev else ops.BITVEC[nm](x, v)
        _wr(dst, x, opn)
        return
    x = _rd(data, opn)
    v0 = None if n0 in ops.UNARY_ALU else _scalar_or_column(operand0, parts, opn, "operand0", fp32_only=True)
    x = _ts_apply(x, n0, v0, reverse0, opn)
    if n1 is not None:
        v1 = None if n1 in ops.UNARY_ALU else _scalar_or_column(operand1, parts, opn, "operand1", fp32_only=True)
        x = _ts_apply(x, n1, v1, reverse1, opn)
    _wr(dst, x, opn)


def scalar_tensor_tensor(
    dst: NkiTensor,
    data: NkiTensor,
    op0: Any,
    operand0: Any,
    op1: Any,
    operand1: NkiTensor,
    reverse0: bool = False,
    reverse1: bool = False,
    name: str | None = None,
) -> None:
    """``dst = (data op0 operand0) op1 operand1`` on VectorE [ISA scalar_tensor_tensor].

    ``operand0``: scalar or (P, 1) tile; ``operand1``: a full tile like ``data``; data and operand1
    not both in PSUM. ``reverse0``: ``operand0 op0 data``; ``reverse1``: ``operand1 op1 tmp``. fp32
    math with one rounding per op (so ``S*lam + kv`` rounds twice, like unfused torch), cast on write.
    """
    opn = "scalar_tensor_tensor"
    dst, data, t1 = _like_dst(opn, dst, data=data, operand1=operand1)
    n0, n1 = ops.op_name(op0, opn), ops.op_name(op1, opn)
    _count(opn)
    x = _rd(data, opn)
    v0 = None if n0 in ops.UNARY_ALU else _scalar_or_column(operand0, data.shape[0], opn, "operand0")
    x = _ts_apply(x, n0, v0, reverse0, opn)
    x = _ts_apply(x, n1, _rd(t1, opn), reverse1, opn)
    _wr(dst, x, opn)


def _axes(axis: Any, ndim: int, op: str) -> tuple[int, ...]:
    ax = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    ax = tuple(int(a) % ndim for a in ax)
    if 0 in ax or sorted(ax) != list(range(ndim - len(ax), ndim)):
        raise errors.NkiValidationError(
            f"{op}: axis {axis} must be trailing free dims ending at the last dim (never the partition dim) [ISA]"
        )
    return tuple(sorted(ax))


def tensor_reduce(
    dst: NkiTensor,
    op: Any,
    data: NkiTensor,
    axis: Any,
    negate: bool = False,
    keepdims: bool = False,
    name: str | None = None,
) -> None:
    """``dst = reduce_op(data, axis)`` over trailing free axes [ISA tensor_reduce].

    Arithmetic ops in fp32 (sums and products computed exactly in float64 then rounded once; the
    hardware order is not modelled), cast on write; ``negate`` multiplies the result by -1; bitvec ops
    on raw integers. dst: same partitions, elements per partition = product of the kept free dims.
    """
    opn = "tensor_reduce"
    name_ = ops.op_name(op, opn)
    dst = _onchip(dst, opn, "dst")
    data = _onchip(data, opn, "data")
    ax = _axes(axis, data.ndim, opn)
    kept = math.prod(data.shape[k] for k in range(1, data.ndim) if k not in ax)
    if dst.shape[0] != data.shape[0] or _free(dst) != kept:
        raise errors.ShapeError(f"{opn}: dst {dst.shape} must have {data.shape[0]} partitions x {kept} elements [ISA]")
    if name_ not in ops.REDUCE_INIT:
        raise errors.NkiValidationError(f"{opn}: {name_} is not a reduction op [SHARED]")
    _count(opn)
    if _is_bitvec(name_):
        if not dt.is_int(data.dtype):
            raise errors.DtypeError(f"{opn}: bitvec reduce needs integer data")
        x = data.read_raw(opn).astype(np.int64)
        r = ops.reduce_bitvec(name_, x, ax)
        _wr(dst, r.reshape(dst.shape[0], -1), opn)
        return
    x = dt.to_f32(data.read_raw(opn))
    r = ops.reduce_arith(name_, x, ax)
    if negate:
        r = -r
    _wr(dst, r.reshape(dst.shape[0], -1), opn)


def reciprocal(dst: NkiTensor, data: NkiTensor, name: str | None = None) -> None:
    """``dst = 1 / data`` on VectorE, correctly rounded fp32 [ISA reciprocal]."""
    opn = "reciprocal"
    dst, data = _like_dst(opn, dst, data=data)
    _count(opn)
    with np.errstate(divide="ignore"):
        _wr(dst, (np.float32(1.0) / _rd(data, opn)).astype(np.float32), opn)


def tensor_copy_predicated(
    dst: NkiTensor, src: Any, predicate: NkiTensor, reverse_pred: bool = False, name: str | None = None
) -> None:
    """Where ``predicate`` is nonzero copy ``src`` (tile or scalar) into ``dst``, else leave ``dst``
    unchanged [ISA tensor_copy_predicated]. predicate uint8/uint16/uint32; src/dst same dtype; src and
    predicate not both in PSUM; ``reverse_pred`` inverts the predicate."""
    opn = "tensor_copy_predicated"
    tile = {"src": src} if isinstance(src, NkiTensor) else {}
    dst, pred, *src_tile = _like_dst(opn, dst, predicate=predicate, **tile)
    if pred.dtype not in (dt.uint8, dt.uint16, dt.uint32):
        raise errors.DtypeError(f"{opn}: predicate must be uint8/uint16/uint32, got {pred.dtype} [ISA]")
    p = _rd_raw(pred, opn) != 0
    if reverse_pred:
        p = ~p
    cur = _rd_raw(dst, opn)
    if src_tile:
        if src_tile[0].dtype != dst.dtype:
            raise errors.DtypeError(f"{opn}: src ({src_tile[0].dtype}) and dst ({dst.dtype}) must share a dtype [ISA]")
        val = _rd_raw(src_tile[0], opn)
    else:
        val = dt.cast(np.full(cur.shape, src, np.float64 if dt.is_float(dst.dtype) else np.int64), dst.dtype)
    _count(opn)
    dst.write_raw(np.where(p, val, cur).reshape(dst.shape), opn)


FP32_MIN = float(np.finfo(np.float32).min)


def range_select(
    dst: NkiTensor,
    on_true_tile: NkiTensor,
    comp_op0: Any,
    comp_op1: Any,
    bound0: NkiTensor,
    bound1: NkiTensor,
    reduce_cmd: reduce_cmd = reduce_cmd.reset_reduce,
    reduce_res: NkiTensor | None = None,
    reduce_op: Any = None,
    range_start: int = 0,
    on_false_value: float = FP32_MIN,
    name: str | None = None,
) -> None:
    """Keep element ``j`` of partition ``p`` when ``comp_op0(j + range_start, bound0[p])`` and
    ``comp_op1(j + range_start, bound1[p])``, else ``on_false_value`` (must be FP32_MIN); the row max
    goes to the VectorE registers / ``reduce_res`` [ISA range_select]. Bounds are fp32 (P, 1)."""
    opn = "range_select"
    if on_false_value != FP32_MIN:
        raise errors.NkiValidationError(f"{opn}: on_false_value must be FP32_MIN (-3.4028235e38) [ISA]")
    dst, on_true = _like_dst(opn, dst, on_true_tile=on_true_tile)
    parts = dst.shape[0]
    b0 = _scalar_or_column(bound0, parts, opn, "bound0", fp32_only=True)
    b1 = _scalar_or_column(bound1, parts, opn, "bound1", fp32_only=True)
    c0, c1 = ops.op_name(comp_op0, opn), ops.op_name(comp_op1, opn)
    for c in (c0, c1):
        if c not in ("equal", "less", "less_equal", "greater", "greater_equal"):
            raise errors.NkiValidationError(f"{opn}: comparison {c} not allowed [ISA]")
    j = (np.arange(_free(dst), dtype=np.float32) + np.float32(range_start))[None, :]
    keep = (_alu(c0, j, b0, opn) != 0) & (_alu(c1, j, b1, opn) != 0)
    y = np.where(keep, _rd(on_true, opn), np.float32(on_false_value)).astype(np.float32)
    _count(opn)
    _wr(dst, y, opn)
    rn = "maximum" if reduce_op is None else ops.op_name(reduce_op, opn)
    res = None if reduce_res is None else _onchip(reduce_res, opn, "reduce_res")
    _reduce_regs(ctx().vec_regs, y, rn, reduce_cmd, res, opn)


# ---- registers [ISA, LG] ---------------------------------------------------------------------
def _scalar_tensor_value(t: NkiTensor, op: str) -> int:
    if t.size != 1:
        raise errors.ShapeError(f"{op}: source tensor must hold exactly one element, has shape {t.shape}")
    if t.buffer is MemoryRegion.psum:
        raise errors.MemorySpaceError(f"{op}: registers load from SBUF or HBM [ISA]")
    v = t.read_raw(op).reshape(-1)[0]
    if np.issubdtype(v.dtype, np.integer):
        return int(v)
    return int(dt.cast(np.asarray([float(v)]), dt.int32)[0])


def register_alloc(x: Any = None) -> VirtualRegister:
    """A new 32-bit register, initialised from an int or a one-element tensor (fp values are rounded
    to the nearest int, UNCONFIRMED), or unset (reading it raises) [ISA register_alloc]."""
    _count("register_alloc")
    if x is None:
        return VirtualRegister()
    if isinstance(x, NkiTensor):
        return VirtualRegister(_scalar_tensor_value(x, "register_alloc"))
    if isinstance(x, VirtualRegister):
        return VirtualRegister(x.read("register_alloc"))
    return VirtualRegister(int(x))


def register_load(dst: VirtualRegister, src: NkiTensor) -> None:
    """``dst = src[0]`` from a one-element SBUF/HBM tensor [ISA register_load]."""
    if not isinstance(dst, VirtualRegister):
        raise errors.RegisterError("register_load: dst must be a VirtualRegister")
    _count("register_load")
    dst.write(_scalar_tensor_value(_tensor(src, "register_load", "src"), "register_load"), "register_load")
