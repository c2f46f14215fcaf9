"""MXFP4 -> FP8 expansion, RTN packing and the packed checkpoint format, against independent float64 references."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.references.packed import expanded_values
from vllm_trn_plugin.loaders import mxfp4, packed
from vllm_trn_plugin.loaders.io import CheckpointFormatError
from vllm_trn_plugin.loaders.mxfp4 import ExpandedMatrix, decode_mxfp4, expand_rows, quantize_rtn
from vllm_trn_plugin.loaders.packed import declares_packed, iter_checkpoint, pack, quantize_fp8_rows

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
SIGNED = np.concatenate([GRID, -GRID])  # code -> value (code 8 is -0)


# ---------------------------------------------------------------- independent float64 references


def ref_codes(packed_u8: torch.Tensor) -> np.ndarray:
    """[rows, in/2] bytes -> [rows, in] 4-bit codes, element 2j = low nibble of byte j."""
    b = packed_u8.numpy().astype(np.int64)
    out = np.empty((b.shape[0], b.shape[1] * 2), dtype=np.int64)
    for j in range(b.shape[1]):
        out[:, 2 * j] = b[:, j] % 16
        out[:, 2 * j + 1] = b[:, j] // 16
    return out


def ref_decode(packed_u8: torch.Tensor, scales_u8: torch.Tensor) -> np.ndarray:
    codes = ref_codes(packed_u8)
    e = scales_u8.numpy().astype(np.int64)
    vals = SIGNED[codes]
    for g in range(e.shape[1]):
        vals[:, 32 * g : 32 * (g + 1)] *= 2.0 ** (e[:, g : g + 1] - 127)
    return vals


def ref_expand(packed_u8: torch.Tensor, scales_u8: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """w / 2^(e_max - 5) with e_max over blocks holding a nonzero code (an all-zero row: e_max = 132)."""
    codes = ref_codes(packed_u8) % 8
    e = scales_u8.numpy().astype(np.int64)
    rows, nb = e.shape
    e_max = np.full(rows, 132)
    for r in range(rows):
        live = [e[r, g] for g in range(nb) if codes[r, 32 * g : 32 * (g + 1)].any()]
        if live:
            e_max[r] = max(live)
    scale = 2.0 ** (e_max - 127 - 5)
    return ref_decode(packed_u8, scales_u8) / scale[:, None], scale


def assert_exact_fp8(w8: torch.Tensor, ref: np.ndarray) -> None:
    got = w8.to(torch.float64).numpy()
    np.testing.assert_array_equal(got, ref)
    # representable: the float64 value survives a round trip through torch's e4m3fn and Trainium2's IEEE e4m3
    back = torch.from_numpy(ref).to(torch.float8_e4m3fn).to(torch.float64).numpy()
    np.testing.assert_array_equal(back, ref)
    ieee = ref.astype(ml_dtypes.float8_e4m3)
    np.testing.assert_array_equal(ieee.astype(np.float64), ref)
    # and the two formats share the bit patterns for |x| <= 240
    np.testing.assert_array_equal(w8.view(torch.uint8).numpy(), ieee.view(np.uint8))
    assert np.abs(ref).max() <= 192


def make_codes(rng: np.random.Generator, rows: int, n_in: int, allowed: list[int] | None = None) -> np.ndarray:
    pool = np.array(allowed if allowed is not None else list(range(16)))
    return pool[rng.integers(0, len(pool), size=(rows, n_in))]


def pack_codes(codes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8))


def ref_rtn(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force RTN: E = floor(log2 amax) - 2, nearest signed grid value to w / 2^E, ties to the even code."""
    rows, n_in = w.shape
    vals = np.zeros_like(w)
    e_bytes = np.zeros((rows, n_in // 32), dtype=np.int64)
    for r in range(rows):
        live = []
        for g in range(n_in // 32):
            blk = w[r, 32 * g : 32 * (g + 1)]
            amax = float(np.abs(blk).max())
            if amax == 0:
                e_bytes[r, g] = -1
                continue
            E = min(max(math.floor(math.log2(amax)) - 2, -127), 127)
            e_bytes[r, g] = E + 127
            live.append(E + 127)
            for i, x in enumerate(blk / 2.0**E):
                dist = np.abs(SIGNED[:8] - abs(x))
                best = [c for c in range(8) if dist[c] == dist.min()]
                c = best[0] if len(best) == 1 else next(c for c in best if c % 2 == 0)
                vals[r, 32 * g + i] = math.copysign(GRID[c], x) * 2.0**E
        e_bytes[r][e_bytes[r] < 0] = max(live) if live else 127
    return vals, e_bytes


# ---------------------------------------------------------------- expansion


def test_expand_random_rows_exact_up_to_spread_13() -> None:
    rng = np.random.default_rng(0)
    rows, nb = 24, 6
    codes = make_codes(rng, rows, 32 * nb)
    e_max = rng.integers(60, 200, size=rows)
    scales = e_max[:, None] - rng.integers(0, 14, size=(rows, nb))
    scales[:, 0] = e_max
    scales[::2, nb - 1] = e_max[::2] - 13  # exactly 13 octaves, with the smallest codes present:
    codes[::2, 32 * (nb - 1) : 32 * (nb - 1) + 4] = [1, 3, 9, 11]  # +-0.5, +-1.5 -> 2^-9 and 3 * 2^-10 in FP8
    p, s = pack_codes(codes), torch.from_numpy(scales.astype(np.uint8))
    m = expand_rows(p, s, file="f.safetensors", tensor="w")
    ref, scale = ref_expand(p, s)
    assert m.is_fp8 and m.note == "" and m.weight.dtype == torch.float8_e4m3fn and m.row_scale.dtype == torch.float32
    assert_exact_fp8(m.weight, ref)
    np.testing.assert_array_equal(m.row_scale.to(torch.float64).numpy(), scale)
    np.testing.assert_array_equal(expanded_values(m).numpy(), ref_decode(p, s))
    assert (m.weight.float().abs() == 2.0**-9).any()  # the smallest FP8 subnormal is reached


def test_expand_rejects_spread_14_naming_file_tensor_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mxfp4, "_ROWS_PER_CHUNK_ELEMS", 64)  # one row per chunk: row numbers across chunks
    rng = np.random.default_rng(1)
    codes = make_codes(rng, 8, 64)
    scales = np.full((8, 2), 130)
    scales[5, 1] = 130 - 14
    codes[5, 40] = 1  # 0.5 * 2^-14 relative to the row's top: 2^-10 after scaling, below the FP8 grid
    with pytest.raises(
        CheckpointFormatError, match=r"f\.safetensors: tensor mlp\.w\.weight_packed: row 5: .*14 octaves"
    ):
        expand_rows(
            pack_codes(codes),
            torch.from_numpy(scales.astype(np.uint8)),
            file="f.safetensors",
            tensor="mlp.w.weight_packed",
        )


@pytest.mark.parametrize("large_codes_only", [False, True])
def test_expand_rejects_every_row_over_13_octaves(large_codes_only: bool) -> None:
    """The rule is on exponents: a 14-octave row is refused even when its far block holds only codes
    (4.0, 6.0) that would happen to land on the FP8 grid."""
    rng = np.random.default_rng(14)
    codes = make_codes(rng, 3, 64)
    codes[:, 0] = 7  # the top block is nonzero
    codes[:, 32:] = make_codes(rng, 3, 32, [6, 7] if large_codes_only else None)
    codes[:, 32] = 7  # the far block is nonzero
    scales = np.array([[150, 136], [150, 137], [150, 136]])
    p, s = pack_codes(codes), torch.from_numpy(scales.astype(np.uint8))
    with pytest.raises(CheckpointFormatError, match="row 0: block exponents span 14 octaves"):
        expand_rows(p, s, file="f", tensor="t")


def test_expand_zero_blocks_set_neither_scale_nor_spread() -> None:
    rng = np.random.default_rng(2)
    codes = make_codes(rng, 3, 96, allowed=[1, 3, 7, 9, 15])
    codes[0, 32:64] = 0  # zero block with a huge scale: does not set e_max
    codes[1, 64:96] = 8  # -0 block with a tiny scale: does not count in the spread
    codes[2, :] = 0  # all-zero row: row scale 1
    scales = np.array([[120, 250, 115], [120, 117, 1], [3, 200, 90]])
    p, s = pack_codes(codes), torch.from_numpy(scales.astype(np.uint8))
    m = expand_rows(p, s, file="f", tensor="t")
    ref, scale = ref_expand(p, s)
    assert_exact_fp8(m.weight, ref)
    assert m.row_scale.tolist() == [2.0 ** (120 - 132), 2.0 ** (120 - 132), 1.0]
    assert torch.equal(m.weight.view(torch.uint8)[1, 64:], torch.full((32,), 0x80, dtype=torch.uint8))  # -0 kept


def test_expand_stacked_experts_label_rows() -> None:
    codes = np.full((2 * 4, 64), 1)
    scales = np.full((2, 4, 2), 140)
    scales[1, 2, 1] = 140 - 20
    p = pack_codes(codes).view(2, 4, 32)
    with pytest.raises(CheckpointFormatError, match=r"row \(1, 2\)"):
        expand_rows(p, torch.from_numpy(scales.astype(np.uint8)), file="f", tensor="experts")
    scales[1, 2, 1] = 139
    m = expand_rows(p, torch.from_numpy(scales.astype(np.uint8)), file="f", tensor="experts")
    assert m.weight.shape == (2, 4, 64) and m.row_scale.shape == (2, 4)
    assert_exact_fp8(
        m.weight.view(8, 64), ref_expand(p.view(8, 32), torch.from_numpy(scales.reshape(8, 2).astype(np.uint8)))[0]
    )


@pytest.mark.parametrize("zero_block", [False, True])
def test_expand_rejects_nan_scale(zero_block: bool) -> None:
    codes = np.full((5, 64), 3)
    if zero_block:
        codes[3, 32:] = 0
    scales = np.full((5, 2), 127, dtype=np.uint8)
    scales[3, 1] = 0xFF
    with pytest.raises(CheckpointFormatError, match=r"file\.st: tensor a\.weight_packed: row 3, block 1: .*NaN"):
        expand_rows(pack_codes(codes), torch.from_numpy(scales), file="file.st", tensor="a.weight_packed")


@pytest.mark.parametrize(
    ("p", "s", "what"),
    [
        (torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.uint8), "uint8"),
        (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float32), "uint8"),
        (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), "do not match"),
        (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.uint8), "do not match"),
        (torch.zeros(16, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8), "must be"),
        (torch.zeros(4, 0, dtype=torch.uint8), torch.zeros(4, 0, dtype=torch.uint8), "empty"),
    ],
)
def test_expand_rejects_bad_dtypes_and_shapes(p: torch.Tensor, s: torch.Tensor, what: str) -> None:
    with pytest.raises(CheckpointFormatError, match=rf"x\.safetensors: tensor m\.weight_packed: .*{what}"):
        expand_rows(p, s, file="x.safetensors", tensor="m.weight_packed")


def test_allow_bf16_returns_exact_bf16_with_note() -> None:
    codes = np.full((3, 64), 11)
    scales = np.array([[130, 130], [130, 100], [250, 0]], dtype=np.uint8)
    p, s = pack_codes(codes), torch.from_numpy(scales)
    m = expand_rows(p, s, file="f.st", tensor="w", allow_bf16=True)
    assert not m.is_fp8 and m.row_scale is None and m.weight.dtype == torch.bfloat16
    assert "f.st: tensor w" in m.note and "row 1" in m.note and "bfloat16" in m.note
    np.testing.assert_array_equal(
        m.weight.to(torch.float64).numpy(), ref_decode(p, s)
    )  # down to 1.5 * 2^-127: exact in bf16


def test_decode_overflow_is_an_error() -> None:
    with pytest.raises(CheckpointFormatError, match="overflows"):
        decode_mxfp4(pack_codes(np.full((1, 32), 7)), torch.tensor([[254]], dtype=torch.uint8), file="f", tensor="t")


@pytest.mark.parametrize("allow_bf16", [False, True])
def test_expand_overflow_is_an_error_like_decode(allow_bf16: bool) -> None:
    """Scale bytes 253/254 with large codes: values >= 2^128, inf in float32 once the row scale multiplies them (and
    in bf16), so expansion refuses them as decode_mxfp4 does, naming file, tensor, row and block; the largest values
    that fit (1.5 x 2^127) expand exactly."""
    codes = np.ones((3, 64), dtype=np.int64)  # 0.5 everywhere
    scales = np.array([[127, 127], [250, 253], [250, 254]], dtype=np.uint8)
    codes[1, 40] = 5  # 3 x 2^126: fits
    codes[2, 33] = 3  # 1.5 x 2^127: fits
    p, s = pack_codes(codes), torch.from_numpy(scales)
    m = expand_rows(p, s, file="f.st", tensor="w", allow_bf16=allow_bf16)
    assert m.is_fp8
    w = m.weight.to(torch.float64) * m.row_scale.to(torch.float64)[:, None]
    assert torch.isfinite(w).all() and torch.equal(w, torch.from_numpy(ref_decode(p, s)))
    for row, code in ((1, 6), (2, 4)):  # 4 x 2^126 = 2 x 2^127 = 2^128
        bad = codes.copy()
        bad[row, 45] = code
        with pytest.raises(
            CheckpointFormatError, match=rf"f\.st: tensor w: row {row}, block 1: value 3\.403e\+38 overflows"
        ):
            expand_rows(pack_codes(bad), s, file="f.st", tensor="w", allow_bf16=allow_bf16)
        with pytest.raises(CheckpointFormatError, match="overflows"):
            decode_mxfp4(pack_codes(bad), s, file="f.st", tensor="w")


def test_nan_bias_correction_vector_refused(tmp_path: Path) -> None:
    """A bias-correction vector is added to every output of its matrix: a NaN in one is a broken checkpoint, refused
    at load naming file, tensor and row (it used to load and turn every output of that matrix NaN)."""
    write_src(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "dst")
    name = "model.layers.0.mlp.down_proj.bias"
    f = next(f for f in sorted((tmp_path / "dst").glob("*.safetensors")) if name in load_file(str(f)))
    t = load_file(str(f))
    t[name][5] = float("nan")
    save_file(t, str(f))
    with pytest.raises(CheckpointFormatError, match=rf"{re.escape(str(f))}: tensor {re.escape(name)}: row 5: .*nan"):
        list(iter_checkpoint(tmp_path / "dst"))


def test_header_length_capped_before_reading(tmp_path: Path) -> None:
    """A header length no writer produces (160 MB) is refused from the 8 bytes that claim it, as safetensors does,
    instead of being read into memory first."""
    f = tmp_path / "model.safetensors"
    with open(f, "wb") as h:  # a sparse file that holds the claimed header: the old reader read all of it
        h.write((160_000_000).to_bytes(8, "little"))
        h.truncate(8 + 160_000_000 + 16)
    with pytest.raises(CheckpointFormatError, match=rf"{re.escape(str(f))}: safetensors header length 160000000"):
        list(iter_checkpoint(tmp_path))


# ---------------------------------------------------------------- RTN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rtn_matches_bruteforce(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    rows, n_in = 6, 32 * 5
    w = torch.randn(rows, n_in, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(-1)
    w[0, :32] = torch.tensor(
        [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9, 6.5, 0.1, -0.25, -5.0, -3.5] + [0.0] * 18
    )
    w[1, 32:64] = 0  # zero block: gets the row's top scale byte
    w[2, :] = 0
    w[3, 64:96] = 2.0**-140  # tiny block: exponent clamps at -127
    w[4, 96:128] = torch.tensor([2.0**-126 * 3] * 32)
    w = w.to(dtype)
    p, s = quantize_rtn(w)
    assert p.dtype == torch.uint8 and p.shape == (rows, n_in // 2) and s.shape == (rows, n_in // 32)
    vals, e_bytes = ref_rtn(w.to(torch.float64).numpy())
    np.testing.assert_array_equal(s.numpy().astype(np.int64), e_bytes)
    np.testing.assert_array_equal(ref_decode(p, s), vals)
    assert (ref_codes(p)[w.float().numpy() == 0] == 0).all()  # zeros are +0
    # the tie row: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, 7.9/6.5->6 (saturated), 0.1->0
    assert ref_decode(p, s)[0, :14].tolist() == [4, 0, 1, 1, 2, 2, 4, 4, 6, 6, 0, 0, -4, -4]


def test_quantize_rtn_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_rtn(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_rtn(torch.full((2, 32), float("nan")))
    with pytest.raises(ValueError, match="matrix"):
        quantize_rtn(torch.zeros(2, 32, dtype=torch.int32))


def test_rtn_then_expand_is_exact() -> None:
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(4))
    p, s = quantize_rtn(w)
    m = expand_rows(p, s, file="f", tensor="t")
    np.testing.assert_array_equal(expanded_values(m).numpy(), ref_rtn(w.double().numpy())[0])


def test_gptq_path_at_rtn_exponents_is_quantize_rtn() -> None:
    """The functions the GPTQ tool writes with (`rtn_exponents`, `limit_spread`, `round_to_grid`, `quantize_codes`
    on grid values, `pack_codes`) give `quantize_rtn`'s bytes exactly when given its exponents: ties, saturation,
    zero blocks and rows, exponents clamped at -127, rows spanning 13 octaves."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(8, 32 * 6, generator=g) * torch.logspace(-20, 20, 8).unsqueeze(-1)
    w[0] = torch.randn(32 * 6, generator=g)
    w[0, :14] = torch.tensor([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9, 6.5, 0.1, -0.25, -5.0, -3.5])
    w[1, 32:64] = 0
    w[2] = 0
    w[3] = torch.randn(32 * 6, generator=g) * 2.0**-122
    w[3, 64:96] = 2.0**-140  # exponent clamped at -127
    w[4, 96:128] *= 2.0**-13  # 13 octaves below the rest of its row
    exp = mxfp4.limit_spread(mxfp4.rtn_exponents(w))
    q = mxfp4.round_to_grid(w, exp.repeat_interleave(32, -1))
    codes = mxfp4.pack_codes(mxfp4.quantize_codes(q, exp, exact=True))
    p, s = quantize_rtn(w)
    assert torch.equal(codes, p) and torch.equal((exp + 127).to(torch.uint8), s)
    np.testing.assert_array_equal(q.double().numpy(), ref_rtn(w.double().numpy())[0])


# ---------------------------------------------------------------- packed checkpoints

D, F, V = 64, 96, 40
MLP = ("gate_proj", "up_proj", "down_proj")


def write_src(root: Path, seed: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": randn(V, D), "model.norm.weight": randn(D), "lm_head.weight": randn(V, D)}
    for i in range(2):
        p = f"model.layers.{i}."
        t[p + "self_attn.gate_proj.weight"] = randn(D, D)  # attention gate: not an MLP matrix
        t[p + "self_attn.q_proj.weight"] = randn(D, D)
        t[p + "mlp.router.gate.weight"] = randn(4, D)
        mods = [p + "mlp."] if i == 0 else [p + "mlp.shared_experts."] + [p + f"mlp.experts.{e}." for e in range(2)]
        for m in mods:
            t[m + "gate_proj.weight"] = randn(F, D)
            t[m + "up_proj.weight"] = randn(F, D)
            t[m + "down_proj.weight"] = randn(D, F)
    t["model.layers.0.mlp.gate_proj.weight"][3] *= 40  # a row with a wide range
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(t)
    save_file({k: t[k] for k in names[: len(names) // 2]}, str(root / "model-00001-of-00002.safetensors"))
    save_file({k: t[k] for k in names[len(names) // 2 :]}, str(root / "model-00002-of-00002.safetensors"))
    (root / "config.json").write_text(json.dumps({"model_type": "afmoe", "hidden_size": D}))
    (root / "tokenizer.json").write_text("{}")
    (root / "tokenizer_config.json").write_text("{}")
    return t


def test_pack_then_iter_checkpoint_round_trip(tmp_path: Path) -> None:
    src = write_src(tmp_path / "src")
    report = pack(tmp_path / "src", tmp_path / "dst", shard_bytes=40_000)
    dst = tmp_path / "dst"
    mlp = [k[: -len(".weight")] for k in src if ".mlp." in k and k.rsplit(".", 2)[-2] in MLP]
    assert sorted(report.quantized) == sorted(mlp) and len(mlp) == 3 * 4
    assert report.fp8 == ["lm_head"] and len(report.shards) > 1
    assert sorted(report.files) == ["tokenizer.json", "tokenizer_config.json"]
    assert (dst / "tokenizer.json").read_text() == "{}"
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(report.shards)

    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert cfg["model_type"] == "afmoe" and qc == report.quantization_config
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mixed-precision"
    g0, g1 = qc["config_groups"]["group_0"], qc["config_groups"]["group_1"]
    assert g0["format"] == "mxfp4-pack-quantized" and g0["weights"]["group_size"] == 32 and g1["targets"] == ["lm_head"]
    target = re.compile(g0["targets"][0].removeprefix("re:"))
    assert all(target.match(m) for m in mlp) and not target.match("model.layers.0.self_attn.gate_proj")
    assert declares_packed(qc) and not declares_packed(json.loads((tmp_path / "src" / "config.json").read_text()))

    on_disk = {}
    for shard in report.shards:
        on_disk.update(load_file(str(dst / shard)))
    assert on_disk["model.layers.0.mlp.up_proj.weight_packed"].shape == (F, D // 2)
    assert on_disk["model.layers.0.mlp.up_proj.weight_scale"].shape == (F, D // 32)
    assert on_disk["lm_head.weight_scale"].shape == (V, 1)

    got = dict(iter_checkpoint(dst))
    assert set(got) == set(src) | {m + ".bias" for m in mlp}
    for name, w in src.items():
        module = name[: -len(".weight")]
        if module in mlp:
            m = got[name]
            assert isinstance(m, ExpandedMatrix) and m.is_fp8
            vals, _ = ref_rtn(w.double().numpy())
            np.testing.assert_array_equal(expanded_values(m).numpy(), vals)
            bias = got[module + ".bias"]
            assert bias.dtype == torch.bfloat16 and bias.shape == (w.shape[0],) and not bias.any()
        elif name == "lm_head.weight":
            m = got[name]
            assert isinstance(m, ExpandedMatrix) and m.weight.dtype == torch.float8_e4m3fn
            s = m.row_scale.double().numpy()
            amax = w.double().abs().amax(-1).numpy()
            assert (np.log2(s) == np.round(np.log2(s))).all() and (amax <= 240 * s).all() and (amax > 120 * s).all()
            ref = (w.double().numpy() / s[:, None]).astype(ml_dtypes.float8_e4m3)  # Trainium2's format, RNE
            np.testing.assert_array_equal(m.weight.view(torch.uint8).numpy(), ref.view(np.uint8))
        else:
            assert torch.equal(got[name], w) and got[name].dtype == w.dtype

    from compressed_tensors.quantization import QuantizationConfig  # vLLM's dependency: a missing one is a failure

    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.config_groups["group_0"].weights.group_size == 32


def test_iter_checkpoint_skips_what_another_rank_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank under expert parallelism neither reads nor expands the matrices `skip` names (another rank's
    experts): they and their bias vectors are absent, every other tensor is as without `skip`."""
    write_src(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "dst")
    expanded: list[str] = []
    real = packed.expand_rows
    monkeypatch.setattr(packed, "expand_rows", lambda *a, **k: expanded.append(k["tensor"]) or real(*a, **k))
    whole = dict(iter_checkpoint(tmp_path / "dst"))
    expanded.clear()
    layer0 = "model.layers.0.mlp."
    part = dict(iter_checkpoint(tmp_path / "dst", skip=lambda name: name.startswith(layer0)))
    assert set(part) == {n for n in whole if not n.startswith(layer0)} and len(part) < len(whole)
    assert expanded and not any(t.startswith(layer0) for t in expanded)
    for name, t in part.items():
        w = whole[name]
        assert torch.equal(t.weight, w.weight) if isinstance(t, ExpandedMatrix) else torch.equal(t, w), name


def test_pack_refuses_quantized_or_nonmatching_sources(tmp_path: Path) -> None:
    write_src(tmp_path / "src")
    with pytest.raises(ValueError, match="matched"):
        pack(tmp_path / "src", tmp_path / "a", matrices=r"nothing")
    report = pack(tmp_path / "src", tmp_path / "b", matrices=lambda m: m.endswith("experts.0.down_proj"), lm_head=False)
    assert report.quantized == ["model.layers.1.mlp.experts.0.down_proj"] and report.shards == ["model.safetensors"]
    assert report.quantization_config["config_groups"]["group_0"]["targets"] == report.quantized
    assert report.quantization_config["format"] == "mxfp4-pack-quantized"
    with pytest.raises(ValueError, match="already has a quantization_config"):
        pack(tmp_path / "b", tmp_path / "c")
    with pytest.raises(FileExistsError):
        pack(tmp_path / "src", tmp_path / "b")


def test_truncated_file_names_file_and_tensor(tmp_path: Path) -> None:
    write_src(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "dst")
    f = tmp_path / "dst" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointFormatError, match=rf"{re.escape(str(f))}: tensor \S+: file truncated"):
        list(iter_checkpoint(tmp_path / "dst"))
    f.write_bytes(data[:5])
    with pytest.raises(CheckpointFormatError, match=re.escape(str(f))):
        list(iter_checkpoint(tmp_path / "dst"))


def test_missing_partner_names_file_and_tensor(tmp_path: Path) -> None:
    p, s = quantize_rtn(torch.randn(8, 64))
    d = tmp_path / "ck"
    d.mkdir()
    save_file({"a.weight_packed": p, "other": torch.zeros(2)}, str(d / "one.safetensors"))
    with pytest.raises(CheckpointFormatError, match=r"one\.safetensors: tensor a\.weight_packed: .*a\.weight_scale"):
        list(iter_checkpoint(d))
    save_file({"a.weight_scale": s, "other": torch.zeros(2)}, str(d / "one.safetensors"))
    with pytest.raises(CheckpointFormatError, match=r"one\.safetensors: tensor a\.weight_scale: scale without"):
        list(iter_checkpoint(d))
    save_file({"h.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)}, str(d / "one.safetensors"))
    with pytest.raises(CheckpointFormatError, match=r"tensor h\.weight: FP8 weight without"):
        list(iter_checkpoint(d))
    save_file({"a.weight_packed": p, "a.weight_scale": s.float()}, str(d / "one.safetensors"))
    with pytest.raises(CheckpointFormatError, match=r"one\.safetensors: tensor a\.weight_packed: .*uint8"):
        list(iter_checkpoint(d))


def test_fp8_head_beyond_trainium_range_rejected(tmp_path: Path) -> None:
    w = torch.zeros(4, 8)
    w[2, 5] = 448.0  # valid e4m3fn, not Trainium2 FP8
    save_file(
        {"lm_head.weight": w.to(torch.float8_e4m3fn), "lm_head.weight_scale": torch.ones(4, 1)},
        str(tmp_path / "m.safetensors"),
    )
    with pytest.raises(CheckpointFormatError, match=r"m\.safetensors: tensor lm_head\.weight: row 2"):
        list(iter_checkpoint(tmp_path))


def test_iter_checkpoint_stacked_and_allow_bf16(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Stacked experts [E, out, in/2] with a row over 13 octaves: refused naming (expert, row); with allow_bf16
    read exactly as bf16 and reported (logged), followed by its zero bias (the file has none)."""
    codes = np.full((2 * 4, 64), 9)
    scales = np.full((2, 4, 2), 127, dtype=np.uint8)
    scales[0, 1, 1] = 100  # 27 octaves: not FP8-exact
    m = "model.layers.0.mlp.experts.down_proj"
    save_file(
        {m + ".weight_packed": pack_codes(codes).view(2, 4, 32), m + ".weight_scale": torch.from_numpy(scales)},
        str(tmp_path / "g.safetensors"),
    )
    with pytest.raises(
        CheckpointFormatError, match=r"g\.safetensors: tensor \S+down_proj\.weight_packed: row \(0, 1\)"
    ):
        list(iter_checkpoint(tmp_path))
    with caplog.at_level(logging.WARNING):
        got = list(iter_checkpoint(tmp_path, allow_bf16=True))
    assert [name for name, _ in got] == [m + ".weight", m + ".bias"]
    w = got[0][1]
    assert w.weight.dtype == torch.bfloat16 and w.weight.shape == (2, 4, 64) and "row (0, 1)" in w.note
    assert w.note in caplog.text
    ref = ref_decode(pack_codes(codes), torch.from_numpy(scales.reshape(8, 2)))
    np.testing.assert_array_equal(w.weight.double().numpy().reshape(8, 64), ref)
    assert not got[1][1].any() and got[1][1].shape == (2, 4)


def test_quantize_fp8_rows_zero_row_and_range() -> None:
    w = torch.tensor([[0.0] * 4, [240.0, -1, 0.5, 3], [241.0, 1, 1, 1], [1e-3, 0, 0, 0]])
    q, s = quantize_fp8_rows(w)
    assert s.tolist() == [1.0, 1.0, 2.0, 2.0**-17]
    assert q.float().abs().max() <= 240
    assert q[1].float().tolist() == [240.0, -1.0, 0.5, 3.0]
