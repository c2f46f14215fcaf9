"""MXFP4 -> FP8 expansion: the threaded expansion against references, both ways it runs (the compiled loop and the
torch ops' 4-code lookup), and the parts a tensor-parallel rank expands.

Three references, none of them the code under test:
- `old_expand`: the implementation before the lookup was rewritten (one 2-code lookup per byte, one thread), kept
  here verbatim in substance as the byte-for-byte oracle;
- `plain_expand`: a straightforward per-element float64 decode (code value x 2^(scale - 127) / s_row, cast to
  float8_e4m3fn), written from the format, not from the loader;
- slices of the whole matrix's expansion, for every part.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from vllm_trn_plugin import envs, native
from vllm_trn_plugin.loaders import expand_native, mxfp4, packed
from vllm_trn_plugin.loaders.io import CheckpointFormatError
from vllm_trn_plugin.loaders.mxfp4 import ExpandedMatrix, decode_mxfp4, expand_rows
from vllm_trn_plugin.loaders.packed import iter_checkpoint, pack

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ---------------------------------------------------------------- references


def old_expand(p: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-rewrite expansion (2-D input, no refusals): FP8 bytes [rows, in] and row scales."""
    rows, nb = s.shape
    mags = (p & 0x77).view(rows, nb, 16)
    nonzero = mags.amax(-1) > 0
    e = s.to(torch.int16)
    e_max = torch.where(nonzero, e, -1).amax(-1)
    e_max = torch.where(e_max < 0, 132, e_max)
    shift = e_max.unsqueeze(-1) - e
    assert not bool((nonzero & (shift > 13)).any())
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float64)
    vals = lut[None, :] * torch.exp2(5 - torch.arange(14, dtype=torch.float64))[:, None]
    b = vals.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    byte = torch.arange(256)
    table = (b[:, byte & 15] | (b[:, byte >> 4] << 8)).to(torch.int16).reshape(-1)
    idx = ((shift.clamp(0, 13).to(torch.int32) << 8).unsqueeze(-1) + p.view(rows, nb, 16)).view(-1)
    w = table[idx.long()].view(torch.uint8).view(rows, nb * 32)
    return w, torch.exp2(e_max.to(torch.float64) - 132).to(torch.float32)


def plain_expand(p: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Element by element in float64: w = E2M1(code) x 2^(scale - 127), s_row = 2^(e_max - 132) with e_max over
    the blocks holding a nonzero magnitude (1 for an all-zero row), FP8 = (w / s_row) cast to float8_e4m3fn."""
    codes = np.stack((p.numpy() & 15, p.numpy() >> 4), -1).reshape(p.shape[0], -1).astype(np.int64)
    sign = np.where(codes & 8, -1.0, 1.0)
    value = sign * np.array(E2M1)[codes & 7] * np.exp2(np.repeat(s.numpy().astype(np.float64) - 127, 32, axis=1))
    block_nonzero = (codes & 7).reshape(codes.shape[0], -1, 32).any(-1)
    e_max = np.where(block_nonzero, s.numpy().astype(np.int64), -1).max(-1)
    scale = np.where(e_max < 0, 1.0, np.exp2(e_max.astype(np.float64) - 132))
    fp8 = torch.from_numpy(value / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return fp8, torch.from_numpy(scale).to(torch.float32)


def random_matrix(seed: int, rows: int, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of every kind (both signs, -0, zero blocks with wild scales, all-zero rows) and block exponents at every
    shift 0..13 below each row's top block."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, size=(rows, nb * 32))
    top = rng.integers(20, 235, size=rows)
    shift = rng.integers(0, 14, size=(rows, nb))
    shift[:, 0] = 0
    shift[: min(rows, 14), 1 % nb] = np.arange(min(rows, 14))  # every shift, in the first rows
    scales = top[:, None] - shift
    zero = rng.random((rows, nb)) < 0.15
    zero[:, 0] = False
    codes.reshape(rows, nb, 32)[zero] = rng.choice([0, 8], size=(int(zero.sum()), 32))  # +0 / -0 blocks
    scales[zero] = rng.integers(0, 255, size=int(zero.sum()))  # any scale: it must not count
    codes[rows // 3] = 0  # an all-zero row
    scales[rows // 3] = rng.integers(0, 255, size=nb)
    p = torch.from_numpy((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8))
    return p, torch.from_numpy(scales.astype(np.uint8))


def bytes_of(m: ExpandedMatrix) -> torch.Tensor:
    return m.weight.view(torch.uint8)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A few rows per chunk: many chunks, so three threads split the work (whatever this machine's cores; results
    must come back in order) and chunk edges fall inside parts."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(mxfp4, "_EXPAND_CHUNK_ELEMS", 3 * 128)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(3)), raising=False)
    yield
    torch.set_num_threads(threads)  # expand_rows puts back the count it saw, the patched 3


@pytest.fixture(params=["compiled", "torch ops"])
def expansion_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each expansion test both ways: the compiled C loop (set-up installs a C compiler: its absence is a failure
    here) and the torch ops it replaces where there is none."""
    monkeypatch.setenv(envs.NATIVE_EXPAND, "1" if request.param == "compiled" else "0")
    assert (expand_native.loop() is not None) == (request.param == "compiled"), "no C compiler for the loop"
    return request.param


# ---------------------------------------------------------------- the fast path


@pytest.mark.usefixtures("expansion_loop")
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("seed,rows,nb", [(0, 40, 4), (1, 7, 1), (2, 33, 9)])
def test_expansion_equals_old_and_plain_references(
    request: pytest.FixtureRequest, chunked: bool, seed: int, rows: int, nb: int
) -> None:
    """Catches any wrong table entry, byte order, shift, sign, zero-block or chunk/thread bookkeeping error."""
    if chunked:
        request.getfixturevalue("small_chunks")
    p, s = random_matrix(seed, rows, nb)
    m = expand_rows(p, s, file="f", tensor="t")
    old_w, old_scale = old_expand(p, s)
    plain_w, plain_scale = plain_expand(p, s)
    assert m.is_fp8 and m.weight.shape == (rows, nb * 32)
    assert torch.equal(bytes_of(m), old_w) and torch.equal(bytes_of(m), plain_w)
    assert torch.equal(m.row_scale, old_scale) and torch.equal(m.row_scale, plain_scale)
    assert (bytes_of(m) == 0x80).any()  # -0 kept


@pytest.mark.usefixtures("expansion_loop")
def test_pinned_caller_runs_chunks_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller pinned to one core (as in vLLM's CPU workers) starts no threads, and gets the same bytes."""
    monkeypatch.setattr(mxfp4, "_EXPAND_CHUNK_ELEMS", 3 * 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(mxfp4, "ThreadPoolExecutor", None)  # any use fails
    p, s = random_matrix(7, 20, 4)
    assert torch.equal(bytes_of(expand_rows(p, s, file="f", tensor="t")), old_expand(p, s)[0])


@pytest.mark.usefixtures("expansion_loop")
def test_every_shift_reaches_the_plain_reference() -> None:
    """Each shift 0..13 with every code, alone in its row beside a top block: the whole table, against float64."""
    rows = []
    for d in range(14):
        for code in range(16):
            c = np.zeros((1, 64), dtype=np.int64)
            c[0, :32] = 7  # top block: 6.0
            c[0, 32:] = code
            rows.append((c, [140, 140 - d]))
    codes = np.concatenate([r[0] for r in rows])
    p = torch.from_numpy((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8))
    s = torch.tensor([r[1] for r in rows], dtype=torch.uint8)
    m = expand_rows(p, s, file="f", tensor="t")
    assert torch.equal(bytes_of(m), plain_expand(p, s)[0])


@pytest.mark.usefixtures("expansion_loop")
def test_odd_offset_and_strided_inputs_still_exact() -> None:
    """Codes that cannot be viewed as words in place (odd storage offset) take a copy, not a wrong reading."""
    p, s = random_matrix(5, 12, 3)
    buf = torch.zeros(p.numel() + 1, dtype=torch.uint8)
    buf[1:] = p.reshape(-1)
    shifted = buf[1:].view(p.shape)
    assert torch.equal(bytes_of(expand_rows(shifted, s, file="f", tensor="t")), old_expand(p, s)[0])


# ---------------------------------------------------------------- parts


def _slices(n_out: int, n_in: int) -> list[tuple[tuple[int, int] | None, tuple[int, int] | None]]:
    return [
        ((0, n_out // 2), None),
        ((n_out // 2, n_out), None),
        (None, (0, n_in // 2)),
        (None, (n_in // 2, n_in)),
        ((3, n_out - 2), (32, n_in - 32)),
        (None, (5, n_in - 7)),  # not block-aligned: whole rows, then the slice
        ((4, 4), None),  # empty
    ]


@pytest.mark.usefixtures("expansion_loop")
@pytest.mark.parametrize("chunked", [False, True])
def test_parts_are_slices_of_the_whole(request: pytest.FixtureRequest, chunked: bool) -> None:
    """Catches a part whose row scale ignores the blocks outside its columns, an off-by-one in the row or column
    offsets, or chunk edges misplaced inside a part."""
    if chunked:
        request.getfixturevalue("small_chunks")
    p, s = random_matrix(3, 30, 6)
    whole = expand_rows(p, s, file="f", tensor="t")
    for rows, cols in _slices(30, 192):
        part = expand_rows(p, s, file="f", tensor="t", rows=rows, cols=cols)
        r0, r1 = rows or (0, 30)
        c0, c1 = cols or (0, 192)
        assert torch.equal(bytes_of(part), bytes_of(whole)[r0:r1, c0:c1]), (rows, cols)
        assert torch.equal(part.row_scale, whole.row_scale[r0:r1]), (rows, cols)


@pytest.mark.usefixtures("expansion_loop")
def test_stacked_parts_and_out_view() -> None:
    """Stacked experts: the row range applies to each matrix; `out` may be a view into a whole-size tensor."""
    p, s = random_matrix(4, 3 * 16, 4)
    p3, s3 = p.view(3, 16, 64), s.view(3, 16, 4)
    whole = expand_rows(p3, s3, file="f", tensor="t")
    part = expand_rows(p3, s3, file="f", tensor="t", rows=(8, 16))
    assert part.weight.shape == (3, 8, 128) and part.row_scale.shape == (3, 8)
    assert torch.equal(bytes_of(part), bytes_of(whole)[:, 8:16]) and torch.equal(part.row_scale, whole.row_scale[:, 8:])
    big = torch.zeros(16, 128, dtype=torch.float8_e4m3fn)
    m = expand_rows(p3[1], s3[1], file="f", tensor="t", cols=(64, 128), out=big[:, 64:])
    assert m.weight.data_ptr() == big[:, 64:].data_ptr()
    assert torch.equal(big.view(torch.uint8)[:, 64:], bytes_of(whole)[1, :, 64:])
    assert not big.view(torch.uint8)[:, :64].any()  # nothing written outside the part
    with pytest.raises(ValueError, match="out must be"):
        expand_rows(p3[1], s3[1], file="f", tensor="t", cols=(64, 128), out=big)
    with pytest.raises(ValueError, match="column range"):
        expand_rows(p3[1], s3[1], file="f", tensor="t", cols=(64, 129))


def _spread_matrix() -> tuple[torch.Tensor, torch.Tensor]:
    """Row 5 spans 14 octaves: its block 3 (in columns 96..127) is 14 below its top block 0."""
    codes = np.full((8, 128), 3)
    scales = np.full((8, 4), 130)
    scales[5, 3] = 116
    p = torch.from_numpy((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8))
    return p, torch.from_numpy(scales.astype(np.uint8))


@pytest.mark.parametrize(
    "rows,cols", [(None, None), ((4, 8), None), (None, (0, 64)), (None, (96, 128)), ((5, 6), (32, 64))]
)
def test_part_refusal_names_file_tensor_row_block(rows: tuple | None, cols: tuple | None) -> None:
    """A part holding row 5 refuses it with the whole matrix's row and block numbers, even when the far block lies
    outside the part's columns (its exponent still sets the row's spread)."""
    p, s = _spread_matrix()
    with pytest.raises(
        CheckpointFormatError,
        match=r"^f\.safetensors: tensor mlp\.w\.weight_packed: row 5: block exponents span 14 octaves \(block 3 is 14",
    ):
        expand_rows(p, s, file="f.safetensors", tensor="mlp.w.weight_packed", rows=rows, cols=cols)


def test_part_without_the_bad_row_loads_and_bf16_part_is_the_slice() -> None:
    p, s = _spread_matrix()
    ok = expand_rows(p, s, file="f", tensor="t", rows=(0, 4))  # another rank's row 5 is that rank's concern
    assert ok.is_fp8 and ok.weight.shape == (4, 128)
    m = expand_rows(p, s, file="f", tensor="t", allow_bf16=True, rows=(4, 8), cols=(32, 96))
    assert not m.is_fp8 and "row 5" in m.note and "block 3" in m.note
    assert torch.equal(m.weight, decode_mxfp4(p, s)[4:8, 32:96])
    s[2, 1] = 0xFF
    with pytest.raises(CheckpointFormatError, match="row 2, block 1: scale byte 0xFF"):
        expand_rows(p, s, file="f", tensor="t", rows=(4, 8))  # a NaN scale anywhere refuses the matrix


# ---------------------------------------------------------------- tensor-parallel loading


H, I = 64, 128  # hidden, intermediate: both halves block-aligned at TP=2


def write_packed(root: Path) -> Path:
    """A small packed AFMoE-like checkpoint: a dense MLP, shared experts and two routed experts."""
    g = torch.Generator().manual_seed(3)
    t = {"model.embed_tokens.weight": torch.randn(32, H, generator=g).to(torch.bfloat16)}
    for m in ("model.layers.0.mlp.", "model.layers.1.mlp.shared_experts.", "model.layers.1.mlp.experts.0.",
              "model.layers.1.mlp.experts.1."):  # fmt: skip
        t[m + "gate_proj.weight"] = (torch.randn(I, H, generator=g) * 0.05).to(torch.bfloat16)
        t[m + "up_proj.weight"] = (torch.randn(I, H, generator=g) * 0.05).to(torch.bfloat16)
        t[m + "down_proj.weight"] = (torch.randn(H, I, generator=g) * 0.05).to(torch.bfloat16)
    src = root / "src"
    src.mkdir(parents=True)
    save_file(t, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "afmoe", "hidden_size": H}))
    pack(src, root / "dst", lm_head=False)
    return root / "dst"


def _count_expanded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Elements the lookup writes, chunk by chunk (the expansion's work)."""
    counts: list[int] = []
    real = mxfp4._chunk

    def spy(codes: torch.Tensor, sc: torch.Tensor, kb0: int, kb1: int, *rest: object) -> object:
        counts.append(sc.shape[0] * (kb1 - kb0) * 32)
        return real(codes, sc, kb0, kb1, *rest)

    monkeypatch.setattr(mxfp4, "_chunk", spy)
    return counts


@pytest.mark.parametrize("experts", [True, False])
def test_tp_loading_expands_only_the_ranks_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, experts: bool) -> None:
    """`packed_weights` at TP=2: every MLP matrix arrives whole-size, and the part vLLM's loaders narrow to (rows of
    gate/up, input columns of down) equals the TP=1 matrix's; the row scales of those rows too. Catches a rank
    expanding everything (work not halved), a wrong rank offset, or the wrong dimension for down_proj; with
    `experts=False` (expert/data parallelism) routed experts stay whole."""
    from vllm_trn_plugin.model_executors.mxfp4_fp8 import RankPart, packed_weights

    ckpt = write_packed(tmp_path)
    counts = _count_expanded(monkeypatch)
    whole = dict(packed_weights(ckpt, lambda m: True, keep_bf16=False, tp=RankPart(0, 1, True)))
    full_work = sum(counts)
    for rank in (0, 1):
        counts.clear()
        got = dict(packed_weights(ckpt, lambda m: True, keep_bf16=False, tp=RankPart(rank, 2, experts)))
        assert set(got) == set(whole)
        routed = 6 * I * H  # two experts x three matrices, expanded whole without expert tensor parallelism
        assert sum(counts) == (full_work // 2 if experts else (full_work - routed) // 2 + routed), rank
        for name, w in got.items():
            assert w.shape == whole[name].shape, name
            if name.endswith("_proj.weight_scale"):
                continue  # with its matrix
            if not name.endswith("_proj.weight"):
                assert torch.equal(w, whole[name]), name  # bias corrections, embeddings: as at TP=1
                continue
            split = experts or ".experts." not in name
            dim = 1 if "down_proj" in name else 0
            n = w.shape[dim] // 2 if split else w.shape[dim]
            start = rank * n if split else 0
            mine = w.view(torch.uint8).narrow(dim, start, n)
            assert torch.equal(mine, whole[name].view(torch.uint8).narrow(dim, start, n)), name
            scale = name.removesuffix(".weight") + ".weight_scale"
            rows = slice(start, start + n) if dim == 0 else slice(None)
            assert torch.equal(got[scale][rows], whole[scale][rows]), scale


def test_iter_checkpoint_part_holds_the_slice(tmp_path: Path) -> None:
    """`iter_checkpoint`'s `part`: whole-size matrices whose part is the whole expansion's; others untouched."""
    ckpt = write_packed(tmp_path)
    whole = dict(iter_checkpoint(ckpt))

    def part(name: str, shape: tuple[int, ...]) -> packed.Part | None:
        return ((I // 2, I), None) if name.endswith("gate_proj.weight") else None

    for name, t in iter_checkpoint(ckpt, part=part):
        w = whole[name]
        if isinstance(t, ExpandedMatrix) and name.endswith("gate_proj.weight"):
            assert t.weight.shape == w.weight.shape
            assert torch.equal(t.weight.view(torch.uint8)[I // 2 :], w.weight.view(torch.uint8)[I // 2 :])
            assert torch.equal(t.row_scale[I // 2 :], w.row_scale[I // 2 :])
        elif isinstance(t, ExpandedMatrix):
            assert torch.equal(t.weight.view(torch.uint8), w.weight.view(torch.uint8))
        else:
            assert torch.equal(t, w)


def test_compiled_loop_never_loaded_from_a_directory_others_can_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache directory another user could write to is passed over (a planted library there would run in every
    worker); with no safe directory and no compiler the loader falls back to torch ops, the same bytes."""
    shared = tmp_path / "xdg" / "vllm-trn"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(native.tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    expand_native.compiled_loop.cache_clear()
    try:
        assert expand_native.loop() is not None
        assert list(shared.iterdir()) == []  # nothing written or read there
        assert [p.suffix for p in (tmp_path / "tmp").glob("vllm-trn-*/*")] == [".so"]

        expand_native.compiled_loop.cache_clear()
        monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
        monkeypatch.setenv("CC", "no-such-cc")
        assert expand_native.loop() is None
        p, s = random_matrix(6, 9, 3)
        assert torch.equal(bytes_of(expand_rows(p, s, file="f", tensor="t")), old_expand(p, s)[0])
    finally:
        expand_native.compiled_loop.cache_clear()
