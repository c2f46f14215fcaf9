"""Packed checkpoints: MXFP4 MLP/expert matrices, per-row FP8 LM head (format: docs/packed-format.md).

On disk (safetensors, declared in config.json's ``quantization_config`` with compressed-tensors'
conventions):

- ``<m>.weight_packed`` uint8 [out, in/2] and ``<m>.weight_scale`` uint8 [out, in/32]: MXFP4
  (``mxfp4-pack-quantized``), and ``<m>.bias`` bf16 [out] (the bias-correction vector) for every
  quantized matrix ``<m>`` (or for none: compressed-tensors writes none, read as zero);
- ``lm_head.weight`` float8_e4m3fn [vocab, hidden] with |x| <= 240 and ``lm_head.weight_scale``
  float32 [vocab, 1] (compressed-tensors ``float-quantized``, channel strategy);
- everything else as in the unpacked checkpoint.

``iter_checkpoint`` streams it back as ``(name, tensor)`` pairs in which every quantized matrix is
one ``ExpandedMatrix`` under its unpacked name (``<m>.weight``). File access goes through ``loaders/io.py``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_trn_plugin.kernels.fp8 import FP8_DTYPE, FP8_MAX
from vllm_trn_plugin.loaders.io import (
    SHARD_BYTES,
    Checkpoint,
    CheckpointFormatError,
    ShardWriter,
    StagedCheckpoint,
    TensorEntry,
    TensorReader,
    copy_side_files,
    scan_dir,
    write_config,
)
from vllm_trn_plugin.loaders.mxfp4 import CT_PACKED_SUFFIX, CT_SCALE_SUFFIX, ExpandedMatrix, expand_rows, quantize_rtn

__all__ = [
    "DEFAULT_MATRIX_PATTERN",
    "LM_HEAD",
    "PACKED_FORMAT",
    "PackReport",
    "Part",
    "StoredWeight",
    "declares_packed",
    "iter_checkpoint",
    "pack",
    "quantization_config",
    "quantize_fp8_rows",
    "stored_weights",
    "write_fp8_lm_head",
    "write_mxfp4",
]

logger = logging.getLogger(__name__)

PACKED_FORMAT = "mxfp4-pack-quantized"
QUANT_NAME = "trn-mxfp4-fp8"  # the vLLM quantization method that serves this format (model_executors/mxfp4_fp8*.py)
LM_HEAD = "lm_head"
# Module names (tensor name without ".weight") of the MLP/expert matrices: AFMoE/Trinity dense MLPs,
# routed experts and shared experts, and Laplace's GLU FFN (W1 = gate_proj, W2 = up_proj, W3 = down_proj).
DEFAULT_MATRIX_PATTERN = r"model\.layers\.\d+\.mlp\.(?:experts\.\d+\.|shared_experts\.)?(?:gate_proj|up_proj|down_proj)"
_BIAS_DTYPE = torch.bfloat16
_UNSUPPORTED_SUFFIXES = (".weight_zero_point", ".weight_global_scale")
_ROWS_PER_CHUNK_ELEMS = 1 << 24
_FP8_MAX_BITS = int(torch.tensor(FP8_MAX, dtype=FP8_DTYPE).view(torch.uint8))  # 0x77: magnitude bits of 240


def quantization_config(targets: list[str], *, fp8_lm_head: bool) -> dict:
    """config.json ``quantization_config`` of a packed checkpoint, as compressed-tensors' own models dump it.

    ``targets``: compressed-tensors targets of the MXFP4 matrices (module names or ``re:`` regexes). With the FP8
    LM head the format is ``mixed-precision`` with one format per group, as compressed-tensors writes models that
    mix formats.
    """
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    mxfp4 = QuantizationArgs(
        num_bits=4, type="float", symmetric=True, group_size=32, strategy="group", scale_dtype=torch.uint8
    )
    groups = {"group_0": QuantizationScheme(targets=list(targets), weights=mxfp4, format=PACKED_FORMAT)}
    if fp8_lm_head:
        fp8_rows = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        groups["group_1"] = QuantizationScheme(targets=[LM_HEAD], weights=fp8_rows, format="float-quantized")
    config = QuantizationConfig(
        config_groups=groups,
        format="mixed-precision" if fp8_lm_head else PACKED_FORMAT,
        quantization_status="compressed",
    )
    return config.model_dump(mode="json")


def declares_packed(qc: dict) -> bool:
    """True if a ``quantization_config`` dict declares MXFP4 groups (compressed-tensors schema)."""
    if qc.get("quant_method") != "compressed-tensors":
        return False
    formats = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()}
    return PACKED_FORMAT in formats


def _fp8_matrix(weight: torch.Tensor, scale: torch.Tensor, file: Path, name: str, scale_name: str) -> ExpandedMatrix:
    where = f"{file}: tensor {name}"
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        raise CheckpointFormatError(
            f"{where}: FP8 weight must be float8_e4m3fn with float32 {scale_name}, got {weight.dtype} and {scale.dtype}"
        )
    lead = tuple(weight.shape[:-1])
    if weight.dim() < 2 or tuple(scale.shape) not in (lead, (*lead, 1)):
        raise CheckpointFormatError(
            f"{where}: FP8 weight {tuple(weight.shape)} needs one scale per row, {scale_name} is {tuple(scale.shape)}"
        )
    scale = scale.reshape(lead)
    # Magnitude bits above 0x77 (= 240) are 256..448 or NaN (0x7F) in float8_e4m3fn; Trainium2's E4M3 stops at 240.
    bad = (weight.view(torch.uint8) & 0x7F) > _FP8_MAX_BITS
    if bool(bad.any()):
        row = int(bad.reshape(-1, weight.shape[-1]).any(-1).nonzero()[0])
        raise CheckpointFormatError(f"{where}: row {row}: value is NaN or beyond Trainium2's FP8 range +-{FP8_MAX:g}")
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        row = int((~(torch.isfinite(scale) & (scale > 0))).reshape(-1).nonzero()[0])
        raise CheckpointFormatError(f"{file}: tensor {scale_name}: row {row}: scale is not a positive finite number")
    return ExpandedMatrix(weight, scale)


def _role(name: str, entry: TensorEntry) -> tuple[str, str, str] | None:
    """(kind, yielded name, partner tensor) for a member of a quantized pair, None for a plain tensor."""
    if name.endswith(CT_PACKED_SUFFIX):
        base = name[: -len(CT_PACKED_SUFFIX)]
        return "mxfp4", base + ".weight", base + CT_SCALE_SUFFIX
    if name.endswith(".weight") and entry.dtype == "F8_E4M3":
        return "fp8", name, name[: -len(".weight")] + CT_SCALE_SUFFIX
    if name.endswith(CT_SCALE_SUFFIX):
        return "scale", "", name[: -len(CT_SCALE_SUFFIX)] + CT_PACKED_SUFFIX
    return None


_KIND_TEXT = {"mxfp4": "MXFP4 codes", "fp8": "FP8 weight"}


def _check_pair(
    name: str, entry: TensorEntry, roles: dict[str, tuple[str, str, str] | None], entries: dict[str, TensorEntry]
) -> None:
    where = f"{entry.file}: tensor {name}"
    if name.endswith(_UNSUPPORTED_SUFFIXES):
        raise CheckpointFormatError(f"{where}: zero points and global scales are not part of the packed format")
    role = roles[name]
    if role is None:
        return
    kind, out, partner = role
    if kind == "scale":
        lead = [partner]
        if name.endswith(CT_SCALE_SUFFIX):
            lead.append(name[: -len(CT_SCALE_SUFFIX)] + ".weight")  # the FP8 LM head's weight
        if not any(roles.get(n) is not None and roles[n][2] == name for n in lead):
            raise CheckpointFormatError(f"{where}: scale without its codes ({' or FP8 '.join(lead)})")
        return
    if partner not in entries:
        raise CheckpointFormatError(f"{where}: {_KIND_TEXT[kind]} without its scale tensor {partner}")
    if kind != "fp8" and out in entries:
        raise CheckpointFormatError(f"{where}: checkpoint also holds the unpacked {out}")


def _checked_headers(root: Path) -> tuple[dict[str, TensorEntry], dict[str, tuple[str, str, str] | None]]:
    """Every tensor's header entry and role; a broken pair fails here, before anything is read."""
    entries = scan_dir(root)
    roles = {name: _role(name, entry) for name, entry in entries.items()}
    for name, entry in entries.items():
        _check_pair(name, entry, roles, entries)
    return entries, roles


@dataclass(frozen=True)
class StoredWeight:
    """How a checkpoint stores one module's weight: ``kind`` "mxfp4" (codes and E8M0 block scales), "fp8" (FP8
    weight and row scales) or "plain", in ``file`` under ``tensor`` (the codes, or the weight)."""

    kind: str
    file: str
    tensor: str


def stored_weights(path_dir: str | Path) -> dict[str, StoredWeight]:
    """Every module's weight in a checkpoint directory by module name (``<m>`` of ``<m>.weight`` or
    ``<m>.weight_packed``), from the safetensors headers alone."""
    entries, roles = _checked_headers(Path(path_dir))
    out: dict[str, StoredWeight] = {}
    for name, e in entries.items():
        role = roles[name]
        if role is None and name.endswith(".weight"):
            out[name.removesuffix(".weight")] = StoredWeight("plain", str(e.file), name)
        elif role is not None and role[0] != "scale":
            kind = "fp8" if role[0] == "fp8" else "mxfp4"
            out[role[1].removesuffix(".weight")] = StoredWeight(kind, str(e.file), name)
    return out


# A rank's part of a matrix (tensor parallelism): (rows, cols), each None (all) or (start, stop) of that dimension.
Part = tuple[tuple[int, int] | None, tuple[int, int] | None]


def iter_checkpoint(
    path_dir: str | Path,
    *,
    allow_bf16: bool = False,
    skip: Callable[[str], bool] | None = None,
    part: Callable[[str, tuple[int, ...]], Part | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor | ExpandedMatrix]]:
    """Stream a (packed or plain) safetensors checkpoint directory one tensor at a time.

    Yields ``(name, tensor)`` for plain tensors and ``(name, ExpandedMatrix)`` for quantized ones:
    ``<m>.weight_packed`` + ``<m>.weight_scale`` -> ``<m>.weight`` (exact FP8 + per-row scale, see
    ``expand_rows``; leading dims, e.g. stacked experts, kept); FP8 ``<m>.weight`` + ``<m>.weight_scale``
    (LM head) -> ``<m>.weight``; when no MXFP4 matrix has a ``<m>.bias`` (compressed-tensors' files), a zero
    bf16 one follows each. Peak extra memory is about one expanded matrix. Headers are all checked before the
    first tensor is yielded, so a missing partner, a duplicate or a truncated file fails early; every error
    names the file and tensor.
    With ``allow_bf16`` a matrix that cannot be exact in FP8 comes back as bf16 (``note`` set, also
    logged as a warning); the caller must report it. Names (as yielded) for which ``skip`` is true are neither
    read nor expanded (another rank's experts).

    ``part(name, shape)`` (tensor parallelism; name as yielded, shape the whole matrix's [..., out, in]) may name
    the rows and columns of an MXFP4 matrix this rank keeps: only those are expanded (``expand_rows``' ``rows`` and
    ``cols``), into a tensor of the whole matrix's shape, so that the weight loaders, which narrow every matrix to
    their rank's part themselves, find it where they look; everything outside the part is left unwritten (the
    allocation of pages nobody touches costs nothing) and must not be read. The row scales outside the part are
    1. A part that falls back to bf16 comes as a whole-size bf16 tensor, zero outside the part.
    """
    entries, roles = _checked_headers(Path(path_dir))
    # compressed-tensors writes no bias-correction vectors: then each MXFP4 matrix gets a zero one. A checkpoint
    # with some must have all (serving without a lost vector would silently change the model).
    codes = {role[1]: name for name, role in roles.items() if role is not None and role[0] == "mxfp4"}
    unbiased = [name for out, name in codes.items() if out.removesuffix(".weight") + ".bias" not in entries]
    zero_bias = len(unbiased) == len(codes)
    if unbiased and not zero_bias:
        name = unbiased[0]
        raise CheckpointFormatError(
            f"{entries[name].file}: tensor {name}: no bias vector {name.removesuffix(CT_PACKED_SUFFIX)}.bias, "
            f"while {len(codes) - len(unbiased)} other MXFP4 matrices have one"
        )

    biases = {out.removesuffix(".weight") + ".bias" for out in codes}  # the bias-correction vectors

    with TensorReader() as reader:

        def get(name: str) -> torch.Tensor:
            return reader.get(name, entries[name])

        for name, entry in entries.items():
            role = roles[name]
            if skip is not None and skip(name if role is None else role[1]):
                continue
            if role is None:
                t = get(name)
                if name in biases:
                    _check_finite_bias(t, entry.file, name)
                yield name, t
                continue
            kind, out, partner = role
            if kind == "scale":
                continue  # read together with its codes or FP8 weight
            if kind == "fp8":
                m = _fp8_matrix(get(name), get(partner), entry.file, name, partner)
            else:
                codes, scales = get(name), get(partner)
                keep = part(out, (*codes.shape[:-1], codes.shape[-1] * 2)) if part is not None else None
                if keep is None:
                    m = expand_rows(codes, scales, file=str(entry.file), tensor=name, allow_bf16=allow_bf16)
                else:
                    m = _expand_part(codes, scales, keep, file=str(entry.file), tensor=name, allow_bf16=allow_bf16)
            if m.note:
                logger.warning(m.note)
            yield out, m
            if kind == "mxfp4" and zero_bias:
                yield out.removesuffix(".weight") + ".bias", torch.zeros(m.weight.shape[:-1], dtype=_BIAS_DTYPE)


def _check_finite_bias(t: torch.Tensor, file: Path, name: str) -> None:
    """A bias-correction vector is added to every output of its matrix: a NaN or inf in it is a broken checkpoint."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        row = int((~torch.isfinite(t)).reshape(-1).nonzero()[0])
        raise CheckpointFormatError(
            f"{file}: tensor {name}: row {row}: bias-correction value {float(t.reshape(-1)[row])} is not finite"
        )


def _expand_part(
    codes: torch.Tensor, scales: torch.Tensor, keep: Part, *, file: str, tensor: str, allow_bf16: bool
) -> ExpandedMatrix:
    """`iter_checkpoint`'s whole-size matrix holding only the part `keep` (see there), written in place."""
    shape = (*codes.shape[:-1], codes.shape[-1] * 2)
    (r0, r1), (c0, c1) = ((0, n) if k is None else k for k, n in zip(keep, shape[-2:]))
    whole = torch.empty(shape, dtype=torch.float8_e4m3fn)
    m = expand_rows(
        codes,
        scales,
        file=file,
        tensor=tensor,
        allow_bf16=allow_bf16,
        rows=(r0, r1),
        cols=(c0, c1),
        out=whole[..., r0:r1, c0:c1],
    )
    if not m.is_fp8:
        whole = torch.zeros(shape, dtype=m.weight.dtype)
        whole[..., r0:r1, c0:c1] = m.weight
        return ExpandedMatrix(whole, None, m.note)
    row_scale = torch.ones(shape[:-1], dtype=torch.float32)
    row_scale[..., r0:r1] = m.row_scale
    return ExpandedMatrix(whole, row_scale, m.note)


def quantize_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 for Trainium2: s = 2^k, the smallest power of two with amax <= 240 * s; q = RNE_e4m3(w / s).

    A power-of-two scale makes w / s exact (the FP8 rounding is the only one) and q * s exact in
    any float format; it costs at most one octave of the subnormal range against amax / 240.
    |q| <= 240 (240 is on the grid, so rounding never exceeds it). An all-zero row gets s = 1;
    k >= -126 keeps s a normal float32. Returns (q float8_e4m3fn [..., out, in], s float32 [..., out]).
    """
    if not w.is_floating_point() or w.dim() < 2:
        raise ValueError(f"quantize_fp8_rows: expected a float matrix, got {w.dtype} {tuple(w.shape)}")
    lead, n_in = tuple(w.shape[:-1]), w.shape[-1]
    w2 = w.reshape(-1, n_in)
    if not bool(torch.isfinite(w2).all()):
        raise ValueError("quantize_fp8_rows: contains inf or NaN")
    q = torch.empty(w2.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(w2.shape[0], dtype=torch.float32)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // max(n_in, 1))
    for r0 in range(0, w2.shape[0], step):
        x = w2[r0 : r0 + step].to(torch.float32)  # float64 input is rounded to float32 first
        amax = x.abs().amax(-1).to(torch.float64)
        mant, ex = torch.frexp(amax / FP8_MAX)  # amax / 240 = mant * 2^ex, mant in [0.5, 1)
        k = torch.where(mant == 0.5, ex - 1, ex)
        k = k + (amax > FP8_MAX * torch.exp2(k.to(torch.float64))).to(k.dtype)  # guard the rounded division
        k = torch.where(amax > 0, k, 0).clamp(min=-126)
        scale = torch.exp2(k.to(torch.float32))
        q[r0 : r0 + step] = (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)  # exact division, one rounding
        s[r0 : r0 + step] = scale
    return q.view(w.shape), s.view(lead)


def write_mxfp4(
    writer: ShardWriter, module: str, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Module `module`'s MXFP4 matrix under the packed format's names: codes, E8M0 scales and (unless None) its
    bias-correction vector in bf16."""
    writer.add(module + CT_PACKED_SUFFIX, packed)
    writer.add(module + CT_SCALE_SUFFIX, scales)
    if bias is not None:
        writer.add(module + ".bias", bias.to(_BIAS_DTYPE))


def write_fp8_lm_head(writer: ShardWriter, weight: torch.Tensor, where: str) -> None:
    """The LM head as per-row FP8 (`quantize_fp8_rows`) and its [vocab, 1] scales; `where` (file and tensor)
    prefixes the error for a weight that cannot be quantized."""
    try:
        q, s = quantize_fp8_rows(weight)
    except ValueError as e:
        raise CheckpointFormatError(f"{where}: {e}") from e
    writer.add(LM_HEAD + ".weight", q)
    writer.add(LM_HEAD + CT_SCALE_SUFFIX, s.unsqueeze(-1))


@dataclass
class PackReport:
    """What ``pack`` wrote."""

    dst: Path
    quantized: list[str] = field(default_factory=list)  # MXFP4 module names
    fp8: list[str] = field(default_factory=list)  # FP8 per-row module names (the LM head)
    copied: list[str] = field(default_factory=list)  # tensors copied unchanged
    shards: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # non-weight files copied (tokenizer etc.)
    bytes_written: int = 0
    quantization_config: dict = field(default_factory=dict)
    note: str = "RTN: no calibration data, so every bias-correction vector is zero"


def _selector(matrices: str | re.Pattern[str] | Callable[[str], bool]) -> tuple[Callable[[str], bool], str | None]:
    """(predicate on module names, compressed-tensors regex target or None when only a list can describe it)."""
    if callable(matrices) and not isinstance(matrices, re.Pattern):
        return matrices, None
    pattern = re.compile(matrices) if isinstance(matrices, str) else matrices
    return (lambda name: pattern.fullmatch(name) is not None), f"re:^(?:{pattern.pattern})$"


def pack(
    src_dir: str | Path,
    dst_dir: str | Path,
    *,
    matrices: str | re.Pattern[str] | Callable[[str], bool] = DEFAULT_MATRIX_PATTERN,
    lm_head: bool = True,
    shard_bytes: int = SHARD_BYTES,
) -> PackReport:
    """Write the packed checkpoint of a bf16/fp16/fp32 safetensors checkpoint, tensor by tensor.

    ``matrices`` selects module names (tensor name minus ``.weight``; a regex is full-matched) to
    quantize with ``quantize_rtn`` (default: every MLP/expert matrix of AFMoE/Trinity and Laplace).
    Each gets ``weight_packed``/``weight_scale`` and a zero bf16 ``bias`` (round-to-nearest uses no
    calibration data, so there is no bias correction to store; a bias already in the source is kept
    instead). ``lm_head.weight`` becomes per-row FP8 (``quantize_fp8_rows``) unless ``lm_head`` is
    False. Everything else is copied unchanged; config.json gains ``quantization_config``; the tokenizer and
    generation config (``io.SIDE_FILES``) are copied, nothing else. ``dst`` must be absent or an empty directory;
    the checkpoint appears there whole or not at all (``io.StagedCheckpoint``). Output shards hold at most about
    ``shard_bytes`` each (plus ``model.safetensors.index.json`` when there are several); memory
    peaks at about one shard plus one source tensor.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    select, target = _selector(matrices)
    report = PackReport(dst=dst)
    with Checkpoint(src) as ckpt:
        if ckpt.config.get("quantization_config"):
            raise ValueError(
                f"pack: {ckpt.config_path} already has a quantization_config; pack needs an unquantized checkpoint"
            )
        if not any(select(n.removesuffix(".weight")) for n in ckpt.entries if n.endswith(".weight")):
            raise ValueError(f"pack: no tensor of {src} matched the matrix selection")
        with StagedCheckpoint(dst, src) as out:  # dst absent or empty; written whole or not at all
            writer = ShardWriter(out, shard_bytes)
            for name in ckpt.entries:
                t = ckpt.get(name)
                module = name.removesuffix(".weight") if name.endswith(".weight") else None
                if module is not None and select(module):
                    if t.dim() != 2 or t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                        raise CheckpointFormatError(
                            f"{ckpt.where(name)}: selected for MXFP4 but is {t.dtype} {tuple(t.shape)}, "
                            "not a bf16/fp16/fp32 matrix"
                        )
                    try:
                        packed, scales = quantize_rtn(t, name=name)
                    except ValueError as e:
                        raise CheckpointFormatError(f"{ckpt.where(name)}: {e}") from e
                    kept = module + ".bias" in ckpt.entries  # written when its turn comes
                    write_mxfp4(writer, module, packed, scales, None if kept else torch.zeros(t.shape[0]))
                    report.quantized.append(module)
                elif lm_head and name == LM_HEAD + ".weight":
                    write_fp8_lm_head(writer, t, ckpt.where(name))
                    report.fp8.append(LM_HEAD)
                else:
                    writer.add(name, t)
                    report.copied.append(name)
                del t
            report.shards = writer.finish()
            report.bytes_written = writer.total
            report.quantization_config = quantization_config(
                [target] if target is not None else sorted(report.quantized), fp8_lm_head=bool(report.fp8)
            )
            write_config(out, {**ckpt.config, "quantization_config": report.quantization_config})
            report.files = copy_side_files(src, out)
    return report
