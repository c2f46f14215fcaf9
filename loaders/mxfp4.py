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

from dataclasses import dataclass

import torch

__all__ = [
    "BLOCK_SIZE",
    "CT_PACKED_SUFFIX",
    "CT_SCALE_SUFFIX",
    "E2M1_VALUES",
    "FP8_MAX",
    "GPT_OSS_BLOCKS_SUFFIX",
    "GPT_OSS_SCALES_SUFFIX",
    "MAX_ROW_SPREAD",
    "CheckpointFormatError",
    "ExpandedMatrix",
    "decode_mxfp4",
    "expand_rows",
    "from_gpt_oss",
    "quantize_rtn",
]

BLOCK_SIZE = 32  # elements per E8M0 scale
# compressed-tensors `mxfp4-pack-quantized`: <module>.weight_packed [out, in/2], <module>.weight_scale [out, in/32]
CT_PACKED_SUFFIX = ".weight_packed"
CT_SCALE_SUFFIX = ".weight_scale"
# gpt-oss: <param>_blocks [..., out, in/32, 16], <param>_scales [..., out, in/32]
GPT_OSS_BLOCKS_SUFFIX = "_blocks"
GPT_OSS_SCALES_SUFFIX = "_scales"

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8_MAX = 240.0  # Trainium2 E4M3 (IEEE-style, bias 7) largest finite value
ROW_HEADROOM = 5  # s_row = 2^(e_max - 5): the largest element 6 * 2^5 = 192 stays <= FP8_MAX
MAX_ROW_SPREAD = 13  # spread of nonzero block exponents that is exact whatever the codes
_E8M0_NAN = 0xFF
_E8M0_BIAS = 127
_ZERO_ROW_EMAX = _E8M0_BIAS + ROW_HEADROOM  # an all-zero row gets s_row = 1
_ROWS_PER_CHUNK_ELEMS = 1 << 22  # rows per chunk x in: bounds the temporaries to ~100 MB


class CheckpointFormatError(ValueError):
    """A checkpoint tensor that cannot be loaded as declared (the message names file and tensor)."""


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

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix in ``dtype`` (exact in float32: FP8 values times a power of two)."""
        if self.row_scale is None:
            return self.weight.to(dtype)
        return (self.weight.to(torch.float32) * self.row_scale.unsqueeze(-1)).to(dtype)


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
    bad = scales2 == _E8M0_NAN
    if bool(bad.any()):
        row, block = (int(i) for i in bad.nonzero()[0])
        raise CheckpointFormatError(
            f"{file}: tensor {tensor}: {_row_label(row, lead)}, block {block}: scale byte 0xFF is NaN in E8M0"
        )


def _block_stats(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: holds a nonzero element (sign bit ignored); per row: e_max over those blocks."""
    mags = (codes & 0x77).view(codes.shape[0], -1, BLOCK_SIZE // 2)
    nonzero = mags.amax(-1) > 0
    e = scales.to(torch.int16)
    e_max = torch.where(nonzero, e, -1).amax(-1)
    e_max = torch.where(e_max < 0, _ZERO_ROW_EMAX, e_max)
    return nonzero, e_max


_PAIR_TABLES: dict[torch.device, torch.Tensor] = {}


def _pair_table(device: torch.device) -> torch.Tensor:
    """int16 [(MAX_ROW_SPREAD + 1) * 256]: entry d * 256 + b holds the FP8 bytes of byte b's two E2M1 codes at
    shift d, c * 2^(5 - d): the low code's byte first in memory (little-endian), as the elements are ordered."""
    if device not in _PAIR_TABLES:
        import sys

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
        scale = torch.exp2(scales2[r0:r1].to(torch.float64) - _E8M0_BIAS)
        vals = _unpack_values(codes2[r0:r1], torch.float64).view(r1 - r0, -1, BLOCK_SIZE) * scale.unsqueeze(-1)
        out[r0:r1] = vals.view(r1 - r0, n_in).to(torch.bfloat16)
    if bool(torch.isinf(out).any()):
        row = int(torch.isinf(out).any(-1).nonzero()[0])
        raise CheckpointFormatError(f"{file}: tensor {tensor}: {_row_label(row, lead)}: value overflows bfloat16")
    return out.view(*lead, n_in)


def expand_rows(
    packed: torch.Tensor, scales: torch.Tensor, *, file: str, tensor: str, allow_bf16: bool = False
) -> ExpandedMatrix:
    """Exact MXFP4 -> FP8 expansion with one power-of-two scale per output row.

    ``packed`` uint8 [..., out, in/2], ``scales`` uint8 [..., out, in/32] (leading dims, e.g.
    stacked experts, are rows too). Returns w_fp8 = w / s_row (float8_e4m3fn, |x| <= 192) and
    s_row = 2^(e_max - 132) (float32), e_max over blocks holding a nonzero element (all-zero blocks
    carry no value, so their scale neither sets s_row nor limits exactness; an all-zero row gets
    s_row = 1).

    A row whose nonzero blocks span more than 13 octaves raises CheckpointFormatError naming file, tensor, row,
    block and spread; with ``allow_bf16`` the whole matrix is returned decoded to bf16 (exact)
    instead, with ``note`` saying why. A NaN scale byte (0xFF) always raises.
    """
    lead, codes2, scales2 = _rows(packed, scales, file, tensor)
    rows, n_in = codes2.shape[0], codes2.shape[1] * 2

    w_fp8 = torch.empty(rows, n_in, dtype=torch.float8_e4m3fn, device=packed.device)
    row_exp = torch.empty(rows, dtype=torch.int16, device=packed.device)
    pairs = torch.empty(min(rows, max(1, _ROWS_PER_CHUNK_ELEMS // n_in)) * n_in // 2, dtype=torch.int16)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // n_in)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        codes, sc = codes2[r0:r1], scales2[r0:r1]
        nonzero, e_max = _block_stats(codes, sc)
        shift = e_max.unsqueeze(-1) - sc.to(torch.int16)  # d = e_max - e, >= 0 on nonzero blocks
        bad = nonzero & (shift > MAX_ROW_SPREAD)
        if bool(bad.any()):
            row_in_chunk, block = (int(i) for i in bad.nonzero()[0])
            row = r0 + row_in_chunk
            e_nz = sc[row_in_chunk].to(torch.int16)[nonzero[row_in_chunk]]
            spread = int(e_nz.max() - e_nz.min())
            reason = (
                f"{_row_label(row, lead)}: block exponents span {spread} octaves (block {block} is "
                f"{int(shift[row_in_chunk, block])} below the row maximum); FP8 with one scale per row is exact "
                f"only up to {MAX_ROW_SPREAD} octaves"
            )
            if not allow_bf16:
                raise CheckpointFormatError(
                    f"{file}: tensor {tensor}: {reason} (VLLM_TRN_ALLOW_BF16=1 serves such a matrix in bf16 instead)"
                )
            return ExpandedMatrix(
                decode_mxfp4(packed, scales, file=file, tensor=tensor),
                None,
                f"{file}: tensor {tensor}: loaded as bfloat16 (exact), not FP8: {reason}",
            )
        # One table lookup per packed byte: both elements' FP8 bytes for the block's shift d (zero codes map
        # to +-0 whatever d, so zero blocks may take any clamped shift).
        base = (shift.clamp(0, MAX_ROW_SPREAD).to(torch.int32) << 8).unsqueeze(-1)  # [rows, blocks, 1]
        idx = (base + codes.view(r1 - r0, -1, BLOCK_SIZE // 2)).view(-1)  # int32, broadcast over each block's bytes
        torch.index_select(_pair_table(codes.device), 0, idx, out=pairs[: idx.numel()])
        w_fp8[r0:r1] = pairs[: idx.numel()].view(torch.float8_e4m3fn).view(r1 - r0, n_in)
        row_exp[r0:r1] = e_max
    row_scale = torch.exp2(row_exp.to(torch.float64) - (_E8M0_BIAS + ROW_HEADROOM)).to(torch.float32)
    return ExpandedMatrix(w_fp8.view(*lead, n_in), row_scale.view(lead))


def quantize_rtn(w: torch.Tensor, *, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest MXFP4 of a float matrix [..., out, in] (in a multiple of 32).

    Per block of 32: E = clamp(floor(log2(amax)) - 2, -127, 127), x = w / 2^E, codes = x rounded to
    the nearest E2M1 value (ties to the even code, |x| > 6 saturates to 6, a value that rounds to
    0 is +0). Returns (packed uint8 [..., out, in/2], scales uint8 [..., out, in/32], byte E + 127).
    An all-zero block gets its row's largest scale byte (127 if the whole row is 0), so it adds no
    spread for readers that count every block.
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
        r1 = min(rows, r0 + step)
        x = w2[r0:r1].to(calc).view(r1 - r0, nb, BLOCK_SIZE)
        amax = x.abs().amax(-1)
        _, ex = torch.frexp(amax)  # amax = m * 2^ex, m in [0.5, 1): floor(log2(amax)) = ex - 1, exact
        e = (ex - 1 - 2).clamp(-_E8M0_BIAS, _E8M0_BIAS)
        nonzero = amax > 0
        e_row = torch.where(nonzero, e, -_E8M0_BIAS - 1).amax(-1, keepdim=True)
        e = torch.where(nonzero, e, torch.where(e_row < -_E8M0_BIAS, 0, e_row))
        # x / 2^E as two exact power-of-two multiplies (2^-E alone may be out of float32's normal range)
        half = (-e).div(2, rounding_mode="floor")
        x = x * torch.exp2(half.to(calc)).unsqueeze(-1) * torch.exp2((-e - half).to(calc)).unsqueeze(-1)
        a = x.abs()
        # Midpoints of the E2M1 grid; at a tie the even code wins: down at 0.25, 1.25, 2.5, 5; up at 0.75, 1.75, 3.5.
        mag = (a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
        codes = mag | ((x < 0) & (mag > 0)).to(torch.uint8) << 3
        codes = codes.view(r1 - r0, n_in)
        packed[r0:r1] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales[r0:r1] = (e + _E8M0_BIAS).to(torch.uint8)
    return packed.view(*lead, n_in // 2), scales.view(*lead, nb)


def from_gpt_oss(
    blocks: torch.Tensor, scales: torch.Tensor, *, file: str = "?", tensor: str = "?"
) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss layout -> compressed-tensors layout.

    gpt-oss stores ``blocks`` uint8 [..., out, in/32, 16] (block g, byte b holds elements
    32g + 2b (low nibble) and 32g + 2b + 1 (high nibble)) and ``scales`` uint8 [..., out, in/32];
    flattening the last two dims gives byte j = 16g + b holding elements 2j and 2j + 1, i.e.
    ``weight_packed`` [..., out, in/2]. Scales are identical.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointFormatError(
            f"{file}: tensor {tensor}: gpt-oss blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise CheckpointFormatError(
            f"{file}: tensor {tensor}: gpt-oss blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} must be "
            "[..., out, in/32, 16] and [..., out, in/32]"
        )
    return blocks.reshape(*blocks.shape[:-2], -1), scales
