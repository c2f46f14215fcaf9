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
one ``ExpandedMatrix`` under its unpacked name (``<m>.weight``; a gpt-oss ``<p>_blocks`` pair under
``<p>``).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from vllm_trn_plugin.loaders.mxfp4 import (
    CT_PACKED_SUFFIX,
    CT_SCALE_SUFFIX,
    FP8_MAX,
    GPT_OSS_BLOCKS_SUFFIX,
    GPT_OSS_SCALES_SUFFIX,
    CheckpointFormatError,
    ExpandedMatrix,
    expand_rows,
    from_gpt_oss,
    quantize_rtn,
)

__all__ = [
    "DEFAULT_MATRIX_PATTERN",
    "LM_HEAD",
    "PACKED_FORMAT",
    "PackReport",
    "StoredWeight",
    "declares_packed",
    "is_packed_checkpoint",
    "iter_checkpoint",
    "pack",
    "quantization_config",
    "quantize_fp8_rows",
    "stored_weights",
]

logger = logging.getLogger(__name__)

PACKED_FORMAT = "mxfp4-pack-quantized"
LM_HEAD = "lm_head"
# Module names (tensor name without ".weight") of the MLP/expert matrices: AFMoE/Trinity dense MLPs,
# routed experts and shared experts, and Laplace's GLU FFN (W1 = gate_proj, W2 = up_proj, W3 = down_proj).
DEFAULT_MATRIX_PATTERN = r"model\.layers\.\d+\.mlp\.(?:experts\.\d+\.|shared_experts\.)?(?:gate_proj|up_proj|down_proj)"
SHARD_BYTES = 1 << 30
_BIAS_DTYPE = torch.bfloat16
_UNSUPPORTED_SUFFIXES = (".weight_zero_point", ".weight_global_scale")
_ROWS_PER_CHUNK_ELEMS = 1 << 24
_FP8_MAX_BITS = 0x77  # float8_e4m3fn bits of 240

# compressed-tensors QuantizationArgs as its own model_dump writes them (version 0.17).
_MXFP4_WEIGHTS = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "group_size": 32,
    "strategy": "group",
    "block_structure": None,
    "dynamic": False,
    "actorder": None,
    "scale_dtype": "torch.uint8",
    "zp_dtype": None,
    "observer": "memoryless_minmax",
    "observer_kwargs": {},
}
_FP8_CHANNEL_WEIGHTS = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "group_size": None,
    "strategy": "channel",
    "block_structure": None,
    "dynamic": False,
    "actorder": None,
    "scale_dtype": None,
    "zp_dtype": None,
    "observer": "memoryless_minmax",
    "observer_kwargs": {},
}


def quantization_config(targets: list[str], *, fp8_lm_head: bool) -> dict:
    """config.json ``quantization_config`` of a packed checkpoint (compressed-tensors schema).

    ``targets``: compressed-tensors targets of the MXFP4 matrices (module names or ``re:`` regexes).
    With the FP8 LM head the format is ``mixed-precision`` with one format per group, as
    compressed-tensors writes models that mix formats.
    """
    groups: dict[str, dict] = {
        "group_0": {
            "targets": list(targets),
            "weights": dict(_MXFP4_WEIGHTS),
            "input_activations": None,
            "output_activations": None,
            "format": PACKED_FORMAT,
        }
    }
    if fp8_lm_head:
        groups["group_1"] = {
            "targets": [LM_HEAD],
            "weights": dict(_FP8_CHANNEL_WEIGHTS),
            "input_activations": None,
            "output_activations": None,
            "format": "float-quantized",
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision" if fp8_lm_head else PACKED_FORMAT,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": [],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def declares_packed(qc: dict) -> bool:
    """True if a ``quantization_config`` dict declares MXFP4 groups (compressed-tensors schema)."""
    if qc.get("quant_method") != "compressed-tensors":
        return False
    formats = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()}
    return PACKED_FORMAT in formats


def is_packed_checkpoint(path_dir: str | Path) -> bool:
    """True if config.json declares MXFP4 groups in ``quantization_config``."""
    cfg = Path(path_dir) / "config.json"
    return cfg.is_file() and declares_packed(json.loads(cfg.read_text()).get("quantization_config") or {})


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    begin: int


def _scan(path: Path) -> dict[str, _Entry]:
    """A safetensors file's header, checked against the file size so that truncation names the first cut tensor."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise CheckpointFormatError(
                f"{path}: not a complete safetensors file (header cut off; file is {size} bytes)"
            )
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointFormatError(f"{path}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: corrupt safetensors header")
    data = size - 8 - n
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            entry = _Entry(path, str(info["dtype"]), tuple(int(d) for d in info["shape"]), begin)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointFormatError(f"{path}: tensor {name}: corrupt safetensors header entry ({e})") from e
        if end > data:
            raise CheckpointFormatError(
                f"{path}: tensor {name}: file truncated (tensor needs data bytes {begin}..{end}, file holds {data})"
            )
        entries[name] = entry
    # Order by offset so that reading in this order walks the file front to back.
    return dict(sorted(entries.items(), key=lambda kv: kv[1].begin))


def _scan_dir(root: Path) -> dict[str, _Entry]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointFormatError(f"{root}: no *.safetensors files")
    entries: dict[str, _Entry] = {}
    for path in files:
        for name, entry in _scan(path).items():
            if name in entries:
                raise CheckpointFormatError(f"{path}: tensor {name}: also in {entries[name].file}")
            entries[name] = entry
    return entries


class _Reader:
    """One open safe_open handle per file; each tensor is read only when asked for."""

    def __init__(self, stack: ExitStack) -> None:
        self._stack = stack
        self._handles: dict[Path, Any] = {}

    def get(self, name: str, entry: _Entry) -> torch.Tensor:
        try:
            handle = self._handles.get(entry.file)
            if handle is None:
                handle = self._handles[entry.file] = self._stack.enter_context(safe_open(str(entry.file), "pt"))
            return handle.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointFormatError(f"{entry.file}: tensor {name}: cannot read: {e}") from e


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


def _role(name: str, entry: _Entry) -> tuple[str, str, str] | None:
    """(kind, yielded name, partner tensor) for a member of a quantized pair, None for a plain tensor."""
    if name.endswith(CT_PACKED_SUFFIX):
        base = name[: -len(CT_PACKED_SUFFIX)]
        return "mxfp4", base + ".weight", base + CT_SCALE_SUFFIX
    if name.endswith(".weight") and entry.dtype == "F8_E4M3":
        return "fp8", name, name[: -len(".weight")] + CT_SCALE_SUFFIX
    if name.endswith(CT_SCALE_SUFFIX):
        return "scale", "", name[: -len(CT_SCALE_SUFFIX)] + CT_PACKED_SUFFIX
    if entry.dtype == "U8" and name.endswith(GPT_OSS_BLOCKS_SUFFIX):
        base = name[: -len(GPT_OSS_BLOCKS_SUFFIX)]
        return "gpt-oss", base, base + GPT_OSS_SCALES_SUFFIX
    if entry.dtype == "U8" and name.endswith(GPT_OSS_SCALES_SUFFIX):
        return "scale", "", name[: -len(GPT_OSS_SCALES_SUFFIX)] + GPT_OSS_BLOCKS_SUFFIX
    return None


_KIND_TEXT = {"mxfp4": "MXFP4 codes", "gpt-oss": "MXFP4 blocks", "fp8": "FP8 weight"}


def _check_pair(
    name: str, entry: _Entry, roles: dict[str, tuple[str, str, str] | None], entries: dict[str, _Entry]
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


def _checked_headers(root: Path) -> tuple[dict[str, _Entry], dict[str, tuple[str, str, str] | None]]:
    """Every tensor's header entry and role; a broken pair fails here, before anything is read."""
    entries = _scan_dir(root)
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
    ``<m>.weight_packed``; a gpt-oss ``<p>_blocks`` pair under ``<p>``), from the safetensors headers alone."""
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


def iter_checkpoint(
    path_dir: str | Path, *, allow_bf16: bool = False, skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor | ExpandedMatrix]]:
    """Stream a (packed or plain) safetensors checkpoint directory one tensor at a time.

    Yields ``(name, tensor)`` for plain tensors and ``(name, ExpandedMatrix)`` for quantized ones:
    ``<m>.weight_packed`` + ``<m>.weight_scale`` -> ``<m>.weight`` (exact FP8 + per-row scale, see
    ``expand_rows``); gpt-oss ``<p>_blocks`` + ``<p>_scales`` -> ``<p>`` (leading dims kept);
    FP8 ``<m>.weight`` + ``<m>.weight_scale`` (LM head) -> ``<m>.weight``; when no MXFP4 matrix has a
    ``<m>.bias`` (compressed-tensors' files), a zero bf16 one follows each. Peak extra memory is about
    one expanded matrix. Headers are all checked before the first tensor is yielded, so a missing
    partner, a duplicate or a truncated file fails early; every error names the file and tensor.
    With ``allow_bf16`` a matrix that cannot be exact in FP8 comes back as bf16 (``note`` set, also
    logged as a warning); the caller must report it. Names (as yielded) for which ``skip`` is true are neither
    read nor expanded (another rank's experts).
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

    with ExitStack() as stack:
        reader = _Reader(stack)

        def get(name: str) -> torch.Tensor:
            return reader.get(name, entries[name])

        for name, entry in entries.items():
            role = roles[name]
            if skip is not None and skip(name if role is None else role[1]):
                continue
            if role is None:
                yield name, get(name)
                continue
            kind, out, partner = role
            if kind == "scale":
                continue  # read together with its codes or FP8 weight
            if kind == "fp8":
                m = _fp8_matrix(get(name), get(partner), entry.file, name, partner)
            else:
                packed, scales = get(name), get(partner)
                if kind == "gpt-oss":
                    packed, scales = from_gpt_oss(packed, scales, file=str(entry.file), tensor=name)
                m = expand_rows(packed, scales, file=str(entry.file), tensor=name, allow_bf16=allow_bf16)
            if m.note:
                logger.warning(m.note)
            yield out, m
            if kind == "mxfp4" and zero_bias:
                yield out.removesuffix(".weight") + ".bias", torch.zeros(m.weight.shape[:-1], dtype=_BIAS_DTYPE)


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


class _ShardWriter:
    """Collects tensors into shards of at most ~max_bytes (one tensor may exceed it) and writes each when full."""

    def __init__(self, dst: Path, max_bytes: int) -> None:
        self.dst, self.max_bytes = dst, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.done: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.pending and self.size + n > self.max_bytes:
            self._flush()
        self.pending[name] = t.contiguous()
        self.size += n
        self.total += n

    def _flush(self) -> None:
        path = self.dst / f".packing-{len(self.done):05d}.safetensors.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.done.append((path, list(self.pending)))
        self.pending, self.size = {}, 0

    def finish(self) -> list[str]:
        if self.pending or not self.done:
            self._flush()
        n = len(self.done)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map: dict[str, str] = {}
        for (tmp, tensors), final in zip(self.done, names):
            tmp.rename(self.dst / final)
            weight_map.update(dict.fromkeys(tensors, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


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
    False. Everything else is copied unchanged; config.json gains ``quantization_config``; other
    non-weight files (tokenizer, generation config) are copied. Output shards hold at most about
    ``shard_bytes`` each (plus ``model.safetensors.index.json`` when there are several); memory
    peaks at about one shard plus one source tensor.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"pack: destination {dst} is the source directory")
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"pack: {cfg_path} not found (the packed format is declared in config.json)")
    config = json.loads(cfg_path.read_text())
    if config.get("quantization_config"):
        raise ValueError(f"pack: {cfg_path} already has a quantization_config; pack needs an unquantized checkpoint")
    select, target = _selector(matrices)
    entries = _scan_dir(src)
    if not any(select(n[: -len(".weight")]) for n in entries if n.endswith(".weight")):
        raise ValueError(f"pack: no tensor of {src} matched the matrix selection")
    dst.mkdir(parents=True, exist_ok=True)
    if any(dst.glob("*.safetensors")) or (dst / "config.json").exists():
        raise FileExistsError(f"pack: {dst} already holds a checkpoint")
    report = PackReport(dst=dst)
    writer = _ShardWriter(dst, shard_bytes)
    with ExitStack() as stack:
        reader = _Reader(stack)
        for name, entry in entries.items():
            t = reader.get(name, entry)
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            if module is not None and select(module):
                if t.dim() != 2 or t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                    raise CheckpointFormatError(
                        f"{entry.file}: tensor {name}: selected for MXFP4 but is {t.dtype} {tuple(t.shape)}, "
                        "not a bf16/fp16/fp32 matrix"
                    )
                try:
                    packed, scales = quantize_rtn(t, name=name)
                except ValueError as e:
                    raise CheckpointFormatError(f"{entry.file}: tensor {name}: {e}") from e
                writer.add(module + CT_PACKED_SUFFIX, packed)
                writer.add(module + CT_SCALE_SUFFIX, scales)
                if module + ".bias" not in entries:
                    writer.add(module + ".bias", torch.zeros(t.shape[0], dtype=_BIAS_DTYPE))
                report.quantized.append(module)
            elif lm_head and name == LM_HEAD + ".weight":
                try:
                    q, s = quantize_fp8_rows(t)
                except ValueError as e:
                    raise CheckpointFormatError(f"{entry.file}: tensor {name}: {e}") from e
                writer.add(name, q)
                writer.add(LM_HEAD + CT_SCALE_SUFFIX, s.unsqueeze(-1))
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
    config["quantization_config"] = report.quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for p in sorted(src.iterdir()):
        if p.is_file() and p.suffix != ".safetensors" and p.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(p, dst / p.name)
            report.files.append(p.name)
    return report
