"""MXFP4 (OCP Microscaling v1.0) weights and their exact expansion to Trainium2 FP8.

MXFP4: FP4 E2M1 elements (sign bit 3; magnitude codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6) in
blocks of 32 along the input dimension, one E8M0 scale byte per block (2^(e - 127); 0xFF is
NaN). Element 2j sits in the low nibble of byte j, element 2j + 1 in the high nibble.

Expansion per output row (see docs/packed-format.md):

    e_max = largest exponent among the row's blocks that hold a nonzero element
    s_row = 2^(e_max - 127 - 5)
    w_fp8 = w / s_row                      (|w_fp8| <= 6 * 2^5 = 192 <= 240)

Every w_fp8 value is c * 2^(5 - d) with c an E2M1 magnitude and d = e_max - e >= 0. With
d <= 13 the smallest nonzero value, 0.5 * 2^-8 = 2^-9, is E4M3's smallest subnormal, so every code
of every block lands on the grid (Trainium2's IEEE-style E4M3 and torch's float8_e4m3fn agree for
|x| <= 240). The loader's rule is exactly that: a row whose nonzero blocks span more than 13
octaves is refused (some such rows would happen to be exact, when their far blocks hold only
large codes; accepting them would make whether a checkpoint loads depend on its codes, not on its
exponents, so the rule is the documented one).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from vllm_trn_plugin.loaders import expand_native
from vllm_trn_plugin.loaders.io import CheckpointFormatError

__all__ = [
    "BLOCK_SIZE",
    "CT_PACKED_SUFFIX",
    "CT_SCALE_SUFFIX",
    "E2M1_VALUES",
    "E8M0_BIAS",
    "MAX_ROW_SPREAD",
    "ExpandedMatrix",
    "decode_mxfp4",
    "exact_pow2",
    "expand_rows",
    "limit_spread",
    "pack_codes",
    "quantize_codes",
    "quantize_rtn",
    "round_scaled",
    "round_to_grid",
    "rtn_exponents",
]

BLOCK_SIZE = 32  # elements per E8M0 scale
# compressed-tensors `mxfp4-pack-quantized`: <module>.weight_packed [out, in/2], <module>.weight_scale [out, in/32]
CT_PACKED_SUFFIX = ".weight_packed"
CT_SCALE_SUFFIX = ".weight_scale"

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
ROW_HEADROOM = 5  # s_row = 2^(e_max - 5): the largest element 6 * 2^5 = 192 stays <= 240 (kernels/fp8.FP8_MAX)
MAX_ROW_SPREAD = 13  # spread of nonzero block exponents that is exact whatever the codes
E8M0_BIAS = 127  # scale byte = block exponent + 127
_E8M0_NAN = 0xFF
_E_MIN, _E_MAX = -E8M0_BIAS, E8M0_BIAS  # block exponents of scale bytes 0..254
_ZERO_BLOCK = -1000  # `rtn_exponents`' mark of an all-zero block, until `limit_spread` gives it its row's exponent
_ZERO_ROW_EMAX = E8M0_BIAS + ROW_HEADROOM  # an all-zero row gets s_row = 1
_ROWS_PER_CHUNK_ELEMS = 1 << 22  # rows per chunk x in: bounds the temporaries to ~100 MB
# Expansion chunks: small enough that a chunk's index words (4 bytes per 4 elements, 1 MB) stay in cache between
# the passes over them, large enough that the ~15 torch ops per chunk cost little next to the work (measured on
# 2 cores: 2^20 beat 2^18, 2^19 and 2^21).
_EXPAND_CHUNK_ELEMS = 1 << 20


@dataclass(frozen=True)
class ExpandedMatrix:
    """A weight matrix as it will be loaded: ``weight * row_scale[..., None]`` is the checkpoint's matrix, exactly.

    FP8 (the normal case): ``weight`` float8_e4m3fn [..., out, in] with |x| <= 240, ``row_scale``
    float32 [..., out] (a power of two for MXFP4 rows), ``note`` empty.
    bf16 (only with ``allow_bf16``, when some row cannot be FP8 exactly): ``weight`` bfloat16 holding
    the exact decoded values, ``row_scale`` None, ``note`` says which rows and why; the caller must
    report it.
    """

    weight: torch.Tensor
    row_scale: torch.Tensor | None
    note: str = ""

    @property
    def is_fp8(self) -> bool:
        return self.row_scale is not None


def _row_label(flat: int, lead: tuple[int, ...]) -> str:
    """'row 17' for a matrix, 'row (3, 17)' (expert, row) for stacked matrices."""
    if len(lead) == 1:
        return f"row {flat}"
    idx = []
    for size in reversed(lead):
        flat, r = divmod(flat, size)
        idx.append(r)
    return f"row {tuple(reversed(idx))}"


def _check_packed(packed: torch.Tensor, scales: torch.Tensor, file: str, tensor: str) -> None:
    where = f"{file}: tensor {tensor}"
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointFormatError(
            f"{where}: MXFP4 codes and scales must be uint8, got codes {packed.dtype} and scales {scales.dtype}"
        )
    if packed.dim() < 2 or scales.dim() != packed.dim():
        raise CheckpointFormatError(
            f"{where}: codes {tuple(packed.shape)} and scales {tuple(scales.shape)} must be [..., out, in/2] and "
            "[..., out, in/32]"
        )
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] != scales.shape[-1] * (BLOCK_SIZE // 2):
        raise CheckpointFormatError(
            f"{where}: codes {tuple(packed.shape)} do not match scales {tuple(scales.shape)} "
            f"(expected codes [..., out, 16 * blocks] for scales [..., out, blocks])"
        )
    if scales.shape[-1] == 0:
        raise CheckpointFormatError(f"{where}: empty input dimension")


def _check_nan_scales(scales2: torch.Tensor, lead: tuple[int, ...], file: str, tensor: str) -> None:
    if scales2.numel() and int(scales2.max()) == _E8M0_NAN:  # one reduction; the comparison only to name the block
        row, block = (int(i) for i in (scales2 == _E8M0_NAN).nonzero()[0])
        raise CheckpointFormatError(
            f"{file}: tensor {tensor}: {_row_label(row, lead)}, block {block}: scale byte 0xFF is NaN in E8M0"
        )


_PAIR_TABLES: dict[torch.device, torch.Tensor] = {}


def _pair_table(device: torch.device) -> torch.Tensor:
    """int16 [(MAX_ROW_SPREAD + 1) * 256]: entry d * 256 + b holds the FP8 bytes of byte b's two E2M1 codes at
    shift d, c * 2^(5 - d): the low code's byte first in memory (little-endian), as the elements are ordered."""
    if device not in _PAIR_TABLES:
        if sys.byteorder != "little":
            raise RuntimeError("the MXFP4 -> FP8 pair table assumes a little-endian host")
        lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64)
        d = torch.arange(MAX_ROW_SPREAD + 1, dtype=torch.float64)
        vals = lut[None, :] * torch.exp2(ROW_HEADROOM - d)[:, None]  # [d, code]
        fp8 = vals.to(torch.float8_e4m3fn)
        if not torch.equal(fp8.to(torch.float64), vals):  # every value on the grid: the 13-octave rule
            raise RuntimeError("MXFP4 -> FP8 table is not exact")
        b = fp8.view(torch.uint8).to(torch.int32)  # [d, code]
        byte = torch.arange(256)
        pair = b[:, byte & 15] | (b[:, byte >> 4] << 8)  # [d, 256]
        _PAIR_TABLES[device] = pair.to(torch.int16).reshape(-1).to(device)  # wraps to int16 bit patterns
    return _PAIR_TABLES[device]


def _unpack_values(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E2M1 codes [rows, in/2] -> element values [rows, in] (unscaled)."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=codes.device)
    lo, hi = lut[(codes & 0xF).long()], lut[(codes >> 4).long()]
    return torch.stack((lo, hi), dim=-1).view(codes.shape[0], -1)


def _rows(
    packed: torch.Tensor, scales: torch.Tensor, file: str, tensor: str
) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor]:
    """Checked codes and scales as 2-D row matrices, with the leading (row-labelling) shape."""
    _check_packed(packed, scales, file, tensor)
    lead = tuple(packed.shape[:-1])
    codes2, scales2 = packed.reshape(-1, packed.shape[-1]), scales.reshape(-1, scales.shape[-1])
    _check_nan_scales(scales2, lead, file, tensor)
    return lead, codes2, scales2


def decode_mxfp4(packed: torch.Tensor, scales: torch.Tensor, *, file: str = "?", tensor: str = "?") -> torch.Tensor:
    """Exact decode to bfloat16 [..., out, in]: w = c * 2^(e - 127).

    c has at most two significant bits and bf16 has float32's exponent range, so every value is
    exact; only 6 * 2^127 and similar (scale bytes >= 253 with large codes) overflow, which raises.
    """
    lead, codes2, scales2 = _rows(packed, scales, file, tensor)
    rows, n_in = codes2.shape[0], codes2.shape[1] * 2
    out = torch.empty(rows, n_in, dtype=torch.bfloat16, device=packed.device)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // n_in)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        # float64 keeps 2^(e - 127) normal for every byte (float32 would need subnormal scales)
        scale = torch.exp2(scales2[r0:r1].to(torch.float64) - E8M0_BIAS)
        vals = _unpack_values(codes2[r0:r1], torch.float64).view(r1 - r0, -1, BLOCK_SIZE) * scale.unsqueeze(-1)
        out[r0:r1] = vals.view(r1 - r0, n_in).to(torch.bfloat16)
    if bool(torch.isinf(out).any()):
        row = int(torch.isinf(out).any(-1).nonzero()[0])
        raise CheckpointFormatError(f"{file}: tensor {tensor}: {_row_label(row, lead)}: value overflows bfloat16")
    return out.view(*lead, n_in)


_QUAD_TABLES: dict[torch.device, torch.Tensor] = {}
_QUAD_OFFSET = 1 << 15  # a pair of code bytes read as int16 w sits at entry w + 2^15 of its shift's 2^16 entries
_NONZERO_MASK = 0x7777777777777777  # the magnitude bits of the 16 codes in 8 bytes (sign bits ignored)
_TWO_LANES = (1 << 32) + 1  # x * _TWO_LANES: an int64 holding x in both int32 halves (0 <= x < 2^31), either byte order


def _quad_table(device: torch.device) -> torch.Tensor:
    """int32 [(MAX_ROW_SPREAD + 1) * 65536]: entry d * 65536 + w + 32768, for w two consecutive code bytes read as one
    little-endian int16, holds the FP8 bytes of their four E2M1 codes at shift d, in element order.

    One lookup yields four output bytes (the pair table's two): half the lookups and half the index bytes, which is
    what the expansion's time goes to. 3.7 MB, built once from `_pair_table`, so both agree bit for bit."""
    if device not in _QUAD_TABLES:
        pair = (_pair_table(torch.device("cpu")).to(torch.int64) & 0xFFFF).view(MAX_ROW_SPREAD + 1, 256)
        u = (torch.arange(1 << 16) - _QUAD_OFFSET) & 0xFFFF  # the two bytes (first one low) that entry k stands for
        quad = pair[:, u & 0xFF] | (pair[:, u >> 8] << 16)  # [d, k]: the first byte's two elements first in memory
        _QUAD_TABLES[device] = quad.to(torch.int32).reshape(-1).to(device)  # wraps to int32 bit patterns
    return _QUAD_TABLES[device]


def _words(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The code bytes [n, k] reinterpreted as `dtype` words [n, k / size] (a copy only when the bytes are not laid
    out so that a view can do it, e.g. an odd storage offset)."""
    try:
        return codes.view(dtype)
    except RuntimeError:
        return codes.clone(memory_format=torch.contiguous_format).view(dtype)


def _span(part: tuple[int, int] | None, size: int, what: str) -> tuple[int, int]:
    if part is None:
        return 0, size
    lo, hi = (int(x) for x in part)
    if not 0 <= lo <= hi <= size:
        raise ValueError(f"expand_rows: {what} range {part} is not within 0..{size}")
    return lo, hi


@dataclass(frozen=True)
class _Spread:
    """A chunk's first row over the 13-octave limit: row and block within the chunk, its spread, the block's shift."""

    row: int
    block: int
    spread: int
    shift: int


def _chunk(
    codes: torch.Tensor, sc: torch.Tensor, kb0: int, kb1: int, out: torch.Tensor, work: list[torch.Tensor]
) -> torch.Tensor | _Spread:
    """Expand one chunk of whole rows, keeping blocks kb0..kb1: `codes` uint8 [n, in/2] and `sc` uint8 [n, blocks] are
    the full rows (the row maximum e_max is over every block of the row, kept or not), `out` float8 [n, kept
    elements] (any row stride). Returns e_max per row (int16 [n]) or the first row over the spread limit."""
    n, nb = sc.shape
    native = expand_native.loop() if codes.device.type == "cpu" else None
    if native is not None and codes.stride(-1) == sc.stride(-1) == out.stride(-1) == 1:
        e_max = torch.empty(n, dtype=torch.int16)
        pair = _pair_table(codes.device)
        bad = native(
            codes.data_ptr(), codes.stride(0), sc.data_ptr(), sc.stride(0), n, nb, kb0, kb1,
            out.data_ptr(), out.stride(0), pair.data_ptr(), e_max.data_ptr(), MAX_ROW_SPREAD, _ZERO_ROW_EMAX,
        )  # fmt: skip
        if bad < 0:
            return e_max
        # a row over the spread limit: the torch path below finds it again and names its block
    # Nonzero blocks from 8-byte words: 16 bytes = two words per block, sign bits masked off.
    words = _words(codes, torch.int64).view(n, nb, 2)
    nonzero = torch.bitwise_or(words[..., 0], words[..., 1]).bitwise_and_(_NONZERO_MASK) != 0
    e = sc.to(torch.int16)
    top = torch.where(nonzero, e, -1).amax(-1)  # -1: no nonzero block
    if bool((top - torch.where(nonzero, e, _E8M0_NAN).amin(-1) > MAX_ROW_SPREAD).any()):  # rare: find the block
        shift = top.unsqueeze(-1) - e
        row, block = (int(i) for i in (nonzero & (shift > MAX_ROW_SPREAD)).nonzero()[0])
        e_nz = e[row][nonzero[row]]
        return _Spread(row, block, int(e_nz.max() - e_nz.min()), int(shift[row, block]))
    e_max = torch.where(top < 0, _ZERO_ROW_EMAX, top)
    kb = kb1 - kb0
    if n == 0 or kb == 0:
        return e_max
    # Index d * 2^16 + w + 2^15 per int16 word w (4 codes), d = e_max - e the block's shift: the per-block part is
    # written once per block as 8-byte words holding it twice (a broadcast over 4 lanes, where one over the 8 int32
    # lanes runs 8-element inner loops), then added in one contiguous int32 pass. Zero codes map to +-0 at any
    # shift, so zero blocks may take any clamped shift; nonzero ones are within 0..13 (checked above).
    base = (e_max.to(torch.int64).unsqueeze(-1) - sc[:, kb0:kb1]).clamp_(0, MAX_ROW_SPREAD)
    base.mul_((1 << 16) * _TWO_LANES).add_(_QUAD_OFFSET * _TWO_LANES)
    idx, lanes = work[0][: n * kb * 8].view(n, kb, 8), work[1][: n * kb * 8]
    lanes.view(torch.int64).view(n, kb, 4).copy_(base.unsqueeze(-1).expand(n, kb, 4))
    idx.copy_(_words(codes[:, kb0 * 16 : kb1 * 16], torch.int16).view(n, kb, 8))
    idx.view(-1).add_(lanes)
    out32 = out.view(torch.int32)
    if out32.is_contiguous():
        torch.index_select(_quad_table(codes.device), 0, idx.view(-1), out=out32.view(-1))
    else:  # a column part inside a wider matrix: expand in cache, then one strided copy
        tmp = work[2][: n * kb * 8]
        torch.index_select(_quad_table(codes.device), 0, idx.view(-1), out=tmp)
        out32.copy_(tmp.view(n, kb * 8))
    return e_max


def _parallel_chunks(tasks: list[Callable[[list[torch.Tensor]], object]], words: int) -> list[object]:
    """Run the chunk tasks on every intra-op thread the caller has (torch.get_num_threads()), each task's torch ops
    single-threaded: torch releases the GIL inside its ops, so the threads run side by side, and whole chunks per
    thread need no synchronisation per op (at two threads, one op's parallel region per op costs more than it
    saves on chunk-sized tensors). `words`: the int32 scratch each thread needs. Results in task order.

    A new thread inherits its creator's CPU affinity: where the calling thread is pinned to fewer cores than it has
    intra-op threads (vLLM's CPU workers pin each OpenMP thread, the calling one included, to one core), threads of
    ours would share its core, so the chunks run in turn, each op spread over torch's own (pinned) threads."""
    threads = min(torch.get_num_threads(), len(tasks))
    if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < threads:
        threads = 1

    def scratch() -> list[torch.Tensor]:
        return [torch.empty(words, dtype=torch.int32) for _ in range(3)]

    if threads <= 1:
        work = scratch()
        return [task(work) for task in tasks]
    results: list[object] = [None] * len(tasks)

    def worker(k: int) -> None:
        torch.set_num_threads(1)  # this thread's OpenMP team only
        work = scratch()
        for i in range(k, len(tasks), threads):
            results[i] = tasks[i](work)

    saved = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
    finally:
        torch.set_num_threads(saved)  # set_num_threads also records the count process-wide: put the caller's back
    return results


_OVERFLOW_EMAX = 253  # rows with e_max >= 253 can hold values >= 2^128: 4 x 2^126 and up (float32's and bf16's inf)


def _check_overflow(
    out3: torch.Tensor,
    row_exp: torch.Tensor,
    lead: tuple[int, ...],
    n_out: int,
    r0: int,
    kb0: int,
    file: str,
    tensor: str,
) -> None:
    """Refuse a row holding a value w_fp8 * s_row >= 2^128, which float32 (the row scale's product) and bf16 cannot
    hold, as `decode_mxfp4` does: only rows with e_max >= 253 can (scale bytes 253/254 with large codes), so only
    those are read back. |w_fp8| >= 2^(260 - e_max) is exactly such a value (s_row = 2^(e_max - 132))."""
    hot = (row_exp >= _OVERFLOW_EMAX).nonzero()
    for m, r in (tuple(int(i) for i in x) for x in hot):
        e = int(row_exp[m, r])
        over = (out3[m, r].to(torch.float32).abs() >= 2.0 ** (260 - e)).nonzero()
        if len(over):
            col = int(over[0])
            raise CheckpointFormatError(
                f"{file}: tensor {tensor}: {_row_label(m * n_out + r0 + r, lead)}, block {kb0 + col // BLOCK_SIZE}: "
                f"value {float(out3[m, r, col].to(torch.float64)) * 2.0 ** (e - 132):.4g} overflows float32 and "
                f"bfloat16 (the row's largest block scale byte is {e})"
            )


def expand_rows(
    packed: torch.Tensor,
    scales: torch.Tensor,
    *,
    file: str,
    tensor: str,
    allow_bf16: bool = False,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> ExpandedMatrix:
    """Exact MXFP4 -> FP8 expansion with one power-of-two scale per output row.

    ``packed`` uint8 [..., out, in/2], ``scales`` uint8 [..., out, in/32] (leading dims, e.g.
    stacked experts, are rows too). Returns w_fp8 = w / s_row (float8_e4m3fn, |x| <= 192) and
    s_row = 2^(e_max - 132) (float32), e_max over blocks holding a nonzero element (all-zero blocks
    carry no value, so their scale neither sets s_row nor limits exactness; an all-zero row gets
    s_row = 1).

    A row whose nonzero blocks span more than 13 octaves raises CheckpointFormatError naming file, tensor, row,
    block and spread; with ``allow_bf16`` the whole matrix (or part) is returned decoded to bf16 (exact)
    instead, with ``note`` saying why. A NaN scale byte (0xFF) anywhere in the matrix always raises.

    A part (tensor parallelism: a rank keeps some output rows of a column-parallel matrix, some input columns of a
    row-parallel one): ``rows`` = (start, stop) of the output dimension (of every matrix of a stack), ``cols`` =
    (start, stop) of the input dimension, in elements. The result is [..., stop - start, ...] and bit for bit the
    same slice of the whole matrix's expansion, with the same row scales: s_row depends on every block of a row,
    so e_max and the spread check read the codes and scales of the kept rows in full (words of 8 bytes and one
    byte per block: a fraction of the expansion's cost) and only the kept columns are expanded. Rows outside
    ``rows`` are not read: a row another rank holds is its concern (a refusal or a bf16 fallback there is that
    rank's). A column range not on 32-element block boundaries expands whole rows and slices them (blocks are the
    unit of the format; the models' parts are block-aligned). ``out``: a float8_e4m3fn tensor of the result's
    shape to write into (a view of a larger one, e.g. the full-size tensor vLLM's weight loaders narrow, is fine;
    merged leading dims must be viewable as one); ignored when the result is bf16.

    The expansion runs in row chunks on every thread of torch's intra-op pool (`_parallel_chunks`): each chunk by
    the compiled loop (`expand_native`, one 2-code lookup per code byte) where it is available, else on torch ops,
    one 4-code table lookup per two code bytes (`_quad_table`); both bit for bit the same.
    """
    lead, codes2, scales2 = _rows(packed, scales, file, tensor)
    n_out, nb = packed.shape[-2], scales2.shape[1]
    n_in = nb * BLOCK_SIZE
    r0, r1 = _span(rows, n_out, "row")
    c0, c1 = _span(cols, n_in, "column")
    if c0 % BLOCK_SIZE or c1 % BLOCK_SIZE:  # not block-aligned: whole rows, then the slice
        m = expand_rows(packed, scales, file=file, tensor=tensor, allow_bf16=allow_bf16, rows=(r0, r1))
        w = m.weight[..., c0:c1]
        if out is not None and m.is_fp8:
            return ExpandedMatrix(out.copy_(w), m.row_scale, m.note)
        return ExpandedMatrix(w.contiguous(), m.row_scale, m.note)
    kb0, kb1 = c0 // BLOCK_SIZE, c1 // BLOCK_SIZE
    n_mats, n_rows, n_cols = math.prod(lead[:-1]), r1 - r0, c1 - c0
    part_lead = (*lead[:-1], n_rows)
    if out is None:
        out = torch.empty(*part_lead, n_cols, dtype=torch.float8_e4m3fn, device=packed.device)
    elif out.dtype != torch.float8_e4m3fn or tuple(out.shape) != (*part_lead, n_cols):
        raise ValueError(
            f"expand_rows: out must be float8_e4m3fn {(*part_lead, n_cols)}, got {out.dtype} {tuple(out.shape)}"
        )
    out3 = out.view(n_mats, n_rows, n_cols)
    codes3, scales3 = codes2.view(n_mats, n_out, -1), scales2.view(n_mats, n_out, nb)

    step = max(1, min(_ROWS_PER_CHUNK_ELEMS, _EXPAND_CHUNK_ELEMS) // n_in)
    spans = [(m, s, min(r1, s + step)) for m in range(n_mats) for s in range(r0, r1, step)]
    tasks = [partial(_chunk, codes3[m, s:e], scales3[m, s:e], kb0, kb1, out3[m, s - r0 : e - r0]) for m, s, e in spans]
    results = _parallel_chunks(tasks, step * (kb1 - kb0) * 8)
    row_exp = torch.empty(n_mats, n_rows, dtype=torch.int16, device=packed.device)
    for (m, s, e), res in zip(spans, results):
        if isinstance(res, _Spread):
            reason = (
                f"{_row_label(m * n_out + s + res.row, lead)}: block exponents span {res.spread} octaves (block "
                f"{res.block} is {res.shift} below the row maximum); FP8 with one scale per row is exact "
                f"only up to {MAX_ROW_SPREAD} octaves"
            )
            if not allow_bf16:
                raise CheckpointFormatError(
                    f"{file}: tensor {tensor}: {reason} (VLLM_TRN_ALLOW_BF16=1 serves such a matrix in bf16 instead)"
                )
            part_codes = packed.narrow(-2, r0, n_rows)[..., kb0 * 16 : kb1 * 16]
            part_scales = scales.narrow(-2, r0, n_rows)[..., kb0:kb1]
            return ExpandedMatrix(
                decode_mxfp4(part_codes, part_scales, file=file, tensor=tensor),
                None,
                f"{file}: tensor {tensor}: loaded as bfloat16 (exact), not FP8: {reason}",
            )
        row_exp[m, s - r0 : e - r0] = res
    _check_overflow(out3, row_exp, lead, n_out, r0, kb0, file, tensor)
    row_scale = torch.exp2(row_exp.to(torch.float64) - (E8M0_BIAS + ROW_HEADROOM)).to(torch.float32)
    return ExpandedMatrix(out, row_scale.view(part_lead))


# ---------------------------------------------------------------- quantization: one rounding for RTN and GPTQ


def rtn_exponents(w: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest block exponents of w [..., out, in] (in a multiple of 32): E = floor(log2(amax)) - 2, clamped
    to [-127, 127], int16 [..., out, in/32]; an all-zero block is marked with -1000, below every exponent, until
    `limit_spread` gives it its row's.

    The block's largest value then lands in [4, 8) x 2^E: values over 6 x 2^E saturate (the OCP rule)."""
    amax = w.reshape(*w.shape[:-1], -1, BLOCK_SIZE).abs().amax(-1)
    _, ex = torch.frexp(amax)  # amax = m * 2^ex, m in [0.5, 1): floor(log2(amax)) = ex - 1, exact
    e = (ex - 3).clamp(_E_MIN, _E_MAX).to(torch.int16)
    return torch.where(amax > 0, e, _ZERO_BLOCK)


def limit_spread(exp: torch.Tensor, max_spread: int | None = MAX_ROW_SPREAD) -> torch.Tensor:
    """Final block exponents [..., out, in/32]: all-zero blocks (marked by `rtn_exponents`) take their row's largest
    exponent (0 for an all-zero row), so that they add no spread even for readers that count every block; with
    `max_spread`, every other block is raised to at least the row's largest minus `max_spread` (13: the row then
    expands exactly to FP8)."""
    zero = exp == _ZERO_BLOCK
    top = torch.where(zero, _E_MIN - 1, exp).amax(-1, keepdim=True)
    top = torch.where(top < _E_MIN, 0, top)
    if max_spread is not None:
        exp = exp.clamp(min=top - max_spread)
    return torch.where(zero, top, exp).clamp(_E_MIN, _E_MAX)


def exact_pow2(exp: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^exp for integer exp in [-127, 127], built from float32 bits (exact; 2^-127 is float32's subnormal 2^22 ulp)."""
    e = exp.to(torch.int32)
    bits = torch.where(e > -127, (e + 127) << 23, 1 << 22)
    return bits.view(torch.float32).to(dtype)


def _round_magnitude(a: torch.Tensor) -> torch.Tensor:
    """|x| -> nearest E2M1 magnitude, ties to the even code, saturating at 6.

    The grid's step is 0.5 below 2, 1 in [2, 4) and 2 from 4 on, and a value's code has the parity of its
    multiple of the step (1.5 = 3 x 0.5 is code 3, 4 = 2 x 2 is code 6), so rounding a / step half to even is
    rounding to the even code; the division by a power of two is exact.
    """
    step = (a >= 2).to(a.dtype).mul_(0.5).add_((a >= 4).to(a.dtype)).add_(0.5)  # 0.5, 1 or 2
    return torch.round(a / step).mul_(step).clamp_(max=6.0)


def round_scaled(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Nearest c * scale of each w (c an E2M1 value, ties to the even code; `scale` a power of two broadcast to w)."""
    x = w / scale
    return torch.copysign(_round_magnitude(x.abs()), x).mul_(scale)


def round_to_grid(w: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
    """Nearest MXFP4 value c * 2^exp of each w (exp broadcast to w's shape), in w's dtype."""
    return round_scaled(w, exact_pow2(exp, w.dtype))


def quantize_codes(w: torch.Tensor, exp: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
    """E2M1 codes uint8 [..., out, in] (sign bit 3; a value that rounds to 0 is +0) of w [..., out, in] rounded to
    the nearest MXFP4 value at block exponents exp [..., out, in/32]. With `exact` the values must be on that grid
    already (GPTQ's output): a value the rounding moves raises ValueError."""
    x = w / exact_pow2(exp.repeat_interleave(BLOCK_SIZE, -1), w.dtype)
    a = x.abs()
    v = _round_magnitude(a)
    if exact and not torch.equal(v, a):
        raise ValueError("quantize_codes: values are not on the MXFP4 grid of their exponents")
    mag = torch.where(v < 2, v * 2, torch.where(v < 4, v + 2, v / 2 + 4)).to(torch.uint8)  # 0, 0.5, ..., 6 -> 0..7
    return mag | (((x < 0) & (mag > 0)).to(torch.uint8) << 3)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., in] -> bytes [..., in/2]: element 2j in the low nibble of byte j (compressed-tensors layout)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_rtn(w: torch.Tensor, *, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest MXFP4 of a float matrix [..., out, in] (in a multiple of 32).

    Per block of 32: E from `rtn_exponents`, codes = w / 2^E rounded to the nearest E2M1 value (ties to the even
    code, |x| > 6 saturates to 6, a value that rounds to 0 is +0); all-zero blocks take their row's largest
    exponent (`limit_spread` without a spread limit). Returns (packed uint8 [..., out, in/2], scales uint8
    [..., out, in/32], byte E + 127).
    """
    if not w.is_floating_point() or w.dtype.itemsize < 2 or w.dim() < 2:
        raise ValueError(
            f"quantize_rtn: {name}: expected a float16/bfloat16/float32 matrix, got {w.dtype} {tuple(w.shape)}"
        )
    n_in = w.shape[-1]
    if n_in % BLOCK_SIZE or n_in == 0:
        raise ValueError(f"quantize_rtn: {name}: input dimension {n_in} is not a positive multiple of {BLOCK_SIZE}")
    lead = tuple(w.shape[:-1])
    w2 = w.reshape(-1, n_in)
    if not bool(torch.isfinite(w2).all()):
        raise ValueError(f"quantize_rtn: {name}: contains inf or NaN")
    rows, nb = w2.shape[0], n_in // BLOCK_SIZE
    packed = torch.empty(rows, n_in // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(rows, nb, dtype=torch.uint8, device=w.device)
    calc = torch.float64 if w.dtype == torch.float64 else torch.float32  # exact for bf16/f16/f32 inputs
    step = max(1, _ROWS_PER_CHUNK_ELEMS // n_in)
    for r0 in range(0, rows, step):
        x = w2[r0 : r0 + step].to(calc)
        exp = limit_spread(rtn_exponents(x), max_spread=None)
        packed[r0 : r0 + step] = pack_codes(quantize_codes(x, exp))
        scales[r0 : r0 + step] = (exp + E8M0_BIAS).to(torch.uint8)
    return packed.view(*lead, n_in // 2), scales.view(*lead, nb)
