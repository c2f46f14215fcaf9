"""The NKI 0.6 emulator (kernels/nki_emu) against direct float64 / NumPy statements of each instruction's
documented semantics, its hardware limits, NaN poisoning, FP8 rounding, indexed DMA, counters and the
torch write-back of `simulate`. Kernels themselves are tested elsewhere."""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from vllm_trn_plugin.kernels import nki_emu
from vllm_trn_plugin.kernels.nki_emu import (
    CapacityError,
    DtypeError,
    MatmulLimitError,
    MemorySpaceError,
    NkiValidationError,
    OutOfBoundsError,
    PartitionLimitError,
    RegisterError,
    ShapeError,
)
from vllm_trn_plugin.kernels.nki_shim import USING_EMULATOR, nisa, nki, nl, simulate

E4M3 = ml_dtypes.float8_e4m3
BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(0)


def run(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    return simulate(nki.jit(fn))(*args, **kwargs)


def load(src: Any, dtype: Any = None) -> Any:
    """Kernel-side helper: HBM -> a new SBUF tile (one dma_copy)."""
    t = nl.ndarray(src.shape if src.ndim > 1 else (src.shape[0], 1), dtype or src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src)
    return t


def store(t: Any) -> Any:
    """Kernel-side helper: SBUF/PSUM tile -> a new shared_hbm output."""
    if t.buffer == nl.psum:
        sb = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb, src=t)
        t = sb
    out = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def f32(shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def fp8_values(shape: tuple[int, ...], scale: float = 30.0) -> np.ndarray:
    """Random finite E4M3 values (|x| <= 240)."""
    return np.clip(RNG.standard_normal(shape) * scale, -240, 240).astype(E4M3)


# ---- shim -----------------------------------------------------------------------------------------
def test_shim_uses_emulator_here_and_rejects_placeholder_nki(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_trn_plugin.kernels import nki_shim

    assert USING_EMULATOR and nki is nki_emu and nisa is nki_emu.isa and nl is nki_emu.language
    assert simulate is nki_emu.simulate
    # the PyPI placeholder: an importable `nki` without the API
    monkeypatch.setitem(sys.modules, "nki", types.ModuleType("nki"))
    assert nki_shim._genuine_nki() is None
    # something that looks genuine is taken
    fake = types.ModuleType("nki")
    fake.jit = fake.simulate = lambda *a, **k: None
    fake.language = types.ModuleType("nki.language")
    fake.language.ndarray = lambda *a, **k: None
    fake.isa = types.ModuleType("nki.isa")
    fake.isa.nc_matmul = fake.isa.dma_copy = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "nki", fake)
    monkeypatch.setitem(sys.modules, "nki.language", fake.language)
    monkeypatch.setitem(sys.modules, "nki.isa", fake.isa)
    assert nki_shim._genuine_nki() == (fake, fake.language, fake.isa)


# ---- poisoning, views, dtypes ---------------------------------------------------------------------------
def test_fresh_buffers_are_poisoned_nan_and_4_including_outputs() -> None:
    def k(x):
        out_f = nl.ndarray((4, 3), nl.float32, buffer=nl.shared_hbm)
        out_i = nl.ndarray((4, 3), nl.int32, buffer=nl.shared_hbm)
        sb = nl.ndarray((4, 3), nl.float32, buffer=nl.sbuf)
        ps = nl.ndarray((4, 3), nl.float32, buffer=nl.psum)
        nisa.dma_copy(dst=sb[0:2, :], src=x[0:2, :])  # rows 2..3 never written
        nisa.dma_copy(dst=out_f, src=sb)
        ps_sb = nl.ndarray((4, 3), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=ps_sb, src=ps)
        return out_f, out_i, store(ps_sb)

    x = torch.ones(4, 3)
    out_f, out_i, ps = run(k, x)
    assert (out_f[:2] == 1).all() and out_f[2:].isnan().all()
    assert out_i.dtype == torch.int32 and (out_i == 4).all()
    assert ps.isnan().all()


def test_views_slicing_and_reinterpretation() -> None:
    def k(x):
        sb = load(x)  # (8, 6) fp32
        a = sb[2]  # on-chip int on dim 0 keeps a size-1 partition dim
        b = sb[:, 3]  # int on the only free dim: stays 2-D
        c = sb[1:5, nl.ds(2, 3)]
        assert a.shape == (1, 6) and b.shape == (8, 1) and c.shape == (4, 3)
        assert x[3].shape == (6,) and x[3, 4].shape == (1,)  # HBM ints drop dims
        r = sb.reshape((8, 2, 3))
        assert r.shape == (8, 2, 3) and r[:, 1, :].shape == (8, 3)
        bc = sb[:, 0:1].broadcast(1, 5)
        assert bc.shape == (8, 5) and bc.strides[1] == 0
        u = sb.view(nl.int32)
        out_c = nl.ndarray((4, 3), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_c, src=c)
        out_bc = nl.ndarray((8, 5), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_bc, src=bc)
        out_u = nl.ndarray((8, 6), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_u, src=u)
        out_t = nl.ndarray((2, 3, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_t, src=x.ap([[3, 2], [1, 3], [6, 8]]))  # HBM access pattern = transpose
        return out_c, out_bc, out_u, out_t

    x = f32((8, 6))
    c, bc, u, t = run(k, x)
    assert np.array_equal(c, x[1:5, 2:5])
    assert np.array_equal(bc, np.repeat(x[:, :1], 5, axis=1))
    assert np.array_equal(u, x.view(np.int32))
    assert np.array_equal(t, x.reshape(8, 2, 3).transpose(1, 2, 0))


def test_view_methods_select_permute_split_merge() -> None:
    def k(x, i):
        sb = load(x.reshape((8, 12)))  # HBM reshape: (8, 3, 4) -> (8, 12)
        t = sb.reshape_dim(1, (3, 4))
        assert t.shape == (8, 3, 4)
        p = t.permute((0, 2, 1))  # (8, 4, 3)
        f = t.flatten_dims(1, 2)
        e = sb[:, 0:1].expand_dim(1).squeeze_dim(1)
        idx = load(i)
        sel = x.select(1, idx)  # dynamic select of HBM dim 1 -> (8, 4)
        out_p = nl.ndarray((8, 4, 3), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_p, src=p)
        out_f = nl.ndarray((8, 12), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_f, src=f)
        out_s = nl.ndarray((8, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_s, src=sel)
        nisa.dma_copy(dst=out_s[:, 0:1], src=e)
        return out_p, out_f, out_s

    x = f32((8, 3, 4))
    p, f, sel = run(k, x, np.array([[2]], np.int32))
    assert np.array_equal(p, x.transpose(0, 2, 1)) and np.array_equal(f, x.reshape(8, 12))
    assert np.array_equal(sel[:, 1:], x[:, 2, 1:]) and np.array_equal(sel[:, 0], x[:, 0, 0])


def test_vector_select_gathers_rows_and_nl_load_store() -> None:
    def k(data, idx):
        ix = nl.load(idx)
        rows = nl.load(data.vector_select(0, ix))
        out = nl.ndarray(rows.shape, rows.dtype, buffer=nl.shared_hbm)
        nl.store(out, rows)
        return out

    data = f32((6, 5))
    out = run(k, data, np.array([[4], [0], [4]], np.uint32))
    assert np.array_equal(out, data[[4, 0, 4]])
    assert nki.last_counters().dma_instructions == 3


def test_hwdge_needs_equal_dtypes() -> None:
    def k(x):
        t = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x, dge_mode=nisa.dge_mode.hwdge)

    with pytest.raises(DtypeError, match="hwdge"):
        run(k, f32((2, 2)))


def test_onchip_access_pattern_must_step_whole_partitions() -> None:
    def k(x):
        sb = load(x)
        sb.ap([[3, 4], [1, 3]])  # partition stride != 6 elements per partition

    with pytest.raises(NkiValidationError, match="partition access"):
        run(k, f32((4, 6)))


def test_fp8_cast_rounds_to_nearest_even_and_overflow_is_nan() -> None:
    vals = np.array([0.0, 1.0, 1.0625, 1.1875, -3.3, 239.0, 240.0, 247.9, 248.0, -300.0, np.inf, 1e-9], np.float32)

    def k(x):
        t = load(x, nl.float8_e4m3)  # DMA casts through fp32
        u = nl.ndarray(t.shape, nl.float8_e4m3, buffer=nl.sbuf)
        src = load(x)
        nisa.tensor_copy(dst=u, src=src)  # engine cast on write
        return store(t), store(u)

    a, b = run(k, vals.reshape(1, -1))
    expect = vals.astype(E4M3).astype(np.float64)  # ml_dtypes: RNE
    expect[np.abs(vals) >= 248] = np.nan  # our spec: beyond +-240 after rounding -> NaN
    for got in (a, b):
        got = got.astype(np.float64).reshape(-1)
        assert np.array_equal(got, expect, equal_nan=True), got
    assert expect[3] == 1.25 and expect[2] == 1.0  # ties to even at 1 + 1/16 and 1 + 3/16


def test_bf16_cast_is_rne_and_int_cast_rounds_even_and_saturates() -> None:
    x = f32((4, 64), 100.0)
    x[0, :4] = [2.5, 3.5, -2.5, 3e10]

    def k(x):
        s = load(x)
        b = nl.ndarray(s.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.activation(dst=b, op=nl.copy, data=s)
        i = nl.ndarray(s.shape, nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=i, src=s)
        return store(b), store(i)

    b, i = run(k, x)
    assert b.dtype == BF16 and np.array_equal(b.view(np.uint16), x.astype(BF16).view(np.uint16))
    assert list(i[0, :4]) == [2, 4, -2, 2**31 - 1]
    assert np.array_equal(i[1:], np.rint(x[1:]).astype(np.int32))


def test_torch_dtypes_round_trip_fp8_and_bf16() -> None:
    w = torch.tensor([[0.5, -240.0, 13.0, 0.0]]).to(torch.float8_e4m3fn)
    h = torch.randn(2, 8).to(torch.bfloat16)

    def k(w, h):
        assert w.dtype == nl.float8_e4m3 and h.dtype == nl.bfloat16
        return store(load(w)), store(load(h))

    w2, h2 = run(k, w, h)
    assert w2.dtype == torch.float8_e4m3fn and torch.equal(w2.view(torch.uint8), w.view(torch.uint8))
    assert h2.dtype == torch.bfloat16 and torch.equal(h2, h)
    big = torch.tensor([[448.0, -256.0, 240.0]]).to(torch.float8_e4m3fn)  # beyond Trainium2's range
    b2, _ = run(k, big, h)
    assert b2[0, :2].float().isnan().all() and b2[0, 2] == 240
    with pytest.raises(NkiValidationError, match="int64"):
        run(k, w, torch.zeros(2, 2, dtype=torch.int64))


# ---- DMA --------------------------------------------------------------------------------------------
def test_dma_from_or_to_psum_is_rejected() -> None:
    def from_psum(x):
        ps = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=ps)

    def to_psum(x):
        ps = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.dma_copy(dst=ps, src=x)

    for k in (from_psum, to_psum):
        with pytest.raises(MemorySpaceError, match="PSUM"):
            run(k, f32((4, 4)))


def test_dma_element_count_must_match() -> None:
    def k(x):
        sb = nl.ndarray((4, 5), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=sb, src=x)

    with pytest.raises(ShapeError, match="element counts"):
        run(k, f32((4, 4)))


def _gather_kernel(mode):
    def k(data, idx):
        p, f = idx.shape[0], data.shape[1]
        ix = nl.ndarray((p, 1), idx.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=ix, src=idx)
        g = nl.ndarray((p, f), data.dtype, buffer=nl.sbuf)
        nisa.memset(dst=g[0:1, :], value=-7.0)  # a skipped row keeps what it held
        nisa.dma_copy(dst=g, src=data.ap([[f, p], [1, f]], vector_offset=ix, indirect_dim=0), oob_mode=mode)
        return store(g)

    return k


def test_indexed_gather_skip_leaves_rows_untouched_and_counts_only_moved_bytes() -> None:
    data = f32((10, 6))
    idx = np.array([[-1], [3], [9], [10], [0], [2**31 - 1]], np.int32)
    out = run(_gather_kernel(nisa.oob_mode.skip), data, idx)
    assert np.array_equal(out[1], data[3]) and np.array_equal(out[2], data[9]) and np.array_equal(out[4], data[0])
    assert (out[0] == -7).all()  # skipped row 0 kept its memset
    assert np.isnan(out[3]).all() and np.isnan(out[5]).all()  # skipped rows keep the poison
    c = nki.last_counters()
    assert c.dma_hbm_to_sbuf_bytes == idx.size * 4 + 3 * 6 * 4
    # uint32 indices: 0xFFFFFFFF is out of bounds (the nki-library "skip this row" sentinel)
    uidx = np.array([[1], [0xFFFFFFFF]], np.uint32)
    out = run(_gather_kernel(nisa.oob_mode.skip), data, uidx)
    assert np.array_equal(out[1 - 1], data[1]) and np.isnan(out[1]).all()


def test_indexed_gather_error_names_the_index() -> None:
    data = f32((10, 6))
    with pytest.raises(OutOfBoundsError, match=r"index -1 at partition 2"):
        run(_gather_kernel(nisa.oob_mode.error), data, np.array([[0], [1], [-1]], np.int32))
    with pytest.raises(OutOfBoundsError, match=r"index 10 at partition 0"):
        run(_gather_kernel(nisa.oob_mode.error), data, np.array([[10]], np.int32))


def test_indexed_scatter_into_input_skips_oob_and_writes_back_in_place() -> None:
    def k(table, rows, idx):
        p, f = rows.shape
        ix = load(idx)
        src = load(rows)
        nisa.dma_copy(
            dst=table.ap([[f, p], [1, f]], vector_offset=ix, indirect_dim=0), src=src, oob_mode=nisa.oob_mode.skip
        )
        return table

    table = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    before = table.clone()
    ptr = table.data_ptr()
    rows = torch.randn(3, 5)
    out = run(k, table, rows, torch.tensor([[6], [-1], [1]], dtype=torch.int32))
    assert out is table and table.data_ptr() == ptr  # same object, same storage
    expect = before.clone()
    expect[6], expect[1] = rows[0], rows[2]
    assert torch.equal(table, expect)


def test_scalar_offset_from_register_and_from_sbuf_tile() -> None:
    def k(pool, slot):  # pool [S, 4, 6]; copy pool[slot, 2] out, and write pool[slot, 3] = pool[slot, 2] * 2
        s = pool.shape
        slot_sb = load(slot)
        r = nisa.register_alloc()
        nisa.register_load(r, slot_sb)
        pat = [[s[2], 1], [1, s[2]]]
        row = nl.ndarray((1, s[2]), pool.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=pool.ap(pat, offset=2 * s[2], scalar_offset=r, indirect_dim=0))
        nisa.tensor_scalar(dst=row, data=row, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(
            dst=pool.ap(pat, offset=3 * s[2], scalar_offset=slot_sb, indirect_dim=0),
            src=row,
            oob_mode=nisa.oob_mode.skip,
        )
        return store(row), pool

    pool = torch.randn(5, 4, 6)
    before = pool.clone()
    row, same = run(k, pool, torch.tensor([3], dtype=torch.int32))
    assert same is pool and torch.equal(row[0], before[3, 2] * 2)
    expect = before.clone()
    expect[3, 3] = before[3, 2] * 2
    assert torch.equal(pool, expect)
    # slot -1: the read raises under oob_mode.error, the skip-write leaves the pool untouched
    with pytest.raises(OutOfBoundsError, match="scalar_offset value -1"):
        run(k, pool, torch.tensor([-1], dtype=torch.int32))
    assert torch.equal(pool, expect)


# ---- TensorE ----------------------------------------------------------------------------------------
def _matmul_kernel(st, mv, perf=None, accumulate=None):
    m = min(st.shape[-1], 128)  # an oversized stationary must fail in nc_matmul, not in nl.ndarray
    n = mv.shape[-1]
    ps = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
    kw = {} if perf is None else {"perf_mode": perf}
    nisa.nc_matmul(dst=ps, stationary=load(st), moving=load(mv), accumulate=accumulate, **kw)
    return store(ps)


@pytest.mark.parametrize("dtype", [np.float32, BF16, E4M3])
def test_nc_matmul_is_stationary_transposed_times_moving(dtype: type) -> None:
    st = f32((96, 40), 4).astype(dtype)
    mv = f32((96, 300), 4).astype(dtype)
    out = run(_matmul_kernel, st, mv)
    ref = st.astype(np.float64).T @ mv.astype(np.float64)
    assert np.array_equal(out, ref.astype(np.float32))  # exact products, one rounding of the sum


def test_nc_matmul_double_row_equals_float64_product_of_fp8_values() -> None:
    st = fp8_values((128, 2, 128))
    mv = fp8_values((128, 2, 512))
    out = run(_matmul_kernel, st, mv, nisa.matmul_perf_mode.double_row)
    ref = np.einsum("phm,phn->mn", st.astype(np.float64), mv.astype(np.float64))
    assert np.array_equal(out, ref.astype(np.float32))
    c = nki.last_counters()
    assert c.matmul_instructions == 1 and c.matmul_macs == 256 * 128 * 512
    # a contraction of 256 in double_row = the plain product of [256, M] by [256, N] with K = (p, h)
    ref2 = st.astype(np.float64).reshape(256, 128).T @ mv.astype(np.float64).reshape(256, 512)
    assert np.allclose(out, ref2, rtol=1e-6, atol=1e-3)


@pytest.mark.parametrize(
    ("st_shape", "mv_shape", "st_dtype", "match"),
    [
        ((128, 3, 8), (128, 3, 8), E4M3, "laid out"),
        ((128, 8), (128, 8), E4M3, "laid out"),
        ((64, 2, 8), (64, 2, 8), BF16, "fp8"),
        ((64, 2, 129), (64, 2, 8), E4M3, "stationary free size 129"),
        ((64, 2, 8), (64, 2, 513), E4M3, "moving free size 513"),
    ],
)
def test_nc_matmul_double_row_rejects_wrong_layouts(st_shape, mv_shape, st_dtype, match) -> None:
    st = f32(st_shape).astype(st_dtype)
    mv = f32(mv_shape).astype(E4M3 if st_dtype is E4M3 else BF16)
    with pytest.raises(NkiValidationError, match=match):
        run(_matmul_kernel, st, mv, nisa.matmul_perf_mode.double_row)


def test_nc_matmul_double_row_not_with_transpose() -> None:
    def k(st, mv):
        ps = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, load(st), load(mv), is_transpose=True, perf_mode=nisa.matmul_perf_mode.double_row)

    with pytest.raises(MatmulLimitError, match="is_transpose"):
        run(k, fp8_values((8, 2, 8)), fp8_values((8, 2, 8)))


def test_nc_matmul_accumulate_false_true_none() -> None:
    a = f32((3, 64, 16))
    b = f32((3, 64, 32))

    def k(a, b):
        ps_explicit = nl.ndarray((16, 32), nl.float32, buffer=nl.psum)
        ps_auto = nl.ndarray((16, 32), nl.float32, buffer=nl.psum)
        for i in range(3):
            sa, sb = load(a[i]), load(b[i])
            nisa.nc_matmul(ps_explicit, sa, sb, accumulate=i > 0)
            nisa.nc_matmul(ps_auto, sa, sb)  # None: first write overwrites the poison, then accumulates
        # overwrite resets an accumulation group
        nisa.nc_matmul(ps_explicit[0:16, 0:16], load(a[0]), load(b[0])[:, 0:16], accumulate=False)
        return store(ps_explicit), store(ps_auto)

    explicit, auto = run(k, a, b)
    parts = [(a[i].astype(np.float64).T @ b[i].astype(np.float64)).astype(np.float32) for i in range(3)]
    acc = (parts[0] + parts[1]) + parts[2]  # fp32 PSUM accumulation in program order
    assert np.array_equal(auto, acc)
    assert np.array_equal(explicit[:, 16:], acc[:, 16:]) and np.array_equal(explicit[:, :16], parts[0][:, :16])


def test_nc_matmul_accumulate_true_on_unwritten_psum_warns_and_gives_nan() -> None:
    def k(a, b):
        ps = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, load(a), load(b), accumulate=True)
        return store(ps)

    with pytest.warns(UserWarning, match="no matmul has written"):
        out = run(k, f32((8, 4)), f32((8, 4)))
    assert np.isnan(out).all()


def test_nc_matmul_limits_and_memory_spaces() -> None:
    def k(st_shape, mv_shape, dst_shape, dst_buf, st_buf, dst_dtype):
        st = nl.ndarray(st_shape, nl.bfloat16, buffer=st_buf)
        mv = nl.ndarray(mv_shape, nl.bfloat16, buffer=nl.sbuf)
        dst = nl.ndarray(dst_shape, dst_dtype, buffer=dst_buf)
        nisa.nc_matmul(dst, st, mv)

    ok = ((128, 128), (128, 512), (128, 512), nl.psum, nl.sbuf, nl.float32)
    run(k, *ok)
    bad = [
        (((128, 129), (128, 8), (129, 8)), PartitionLimitError),  # dst partition = stationary free 129
        (((64, 128), (64, 513), (128, 513)), MatmulLimitError),
        (((64, 8), (32, 8), (8, 8)), MatmulLimitError),
    ]
    for shapes, err in bad:
        with pytest.raises(err):
            run(k, *shapes, nl.psum, nl.sbuf, nl.float32)
    with pytest.raises(MatmulLimitError, match="stationary free size 200"):
        run(k, (64, 200), (64, 8), (128, 8), nl.psum, nl.sbuf, nl.float32)
    with pytest.raises(MemorySpaceError, match="dst"):
        run(k, (64, 8), (64, 8), (8, 8), nl.sbuf, nl.sbuf, nl.float32)
    with pytest.raises(MemorySpaceError, match="stationary"):
        run(k, (64, 8), (64, 8), (8, 8), nl.psum, nl.psum, nl.float32)
    with pytest.raises(DtypeError, match="float32"):
        run(k, (64, 8), (64, 8), (8, 8), nl.psum, nl.sbuf, nl.bfloat16)


def test_nc_matmul_output_must_fit_one_psum_bank() -> None:
    def k(off):
        ps = nl.ndarray((8, 1024), nl.float32, buffer=nl.psum)  # two banks per partition
        st = nl.zeros((16, 8), nl.bfloat16, buffer=nl.sbuf)
        mv = nl.zeros((16, 512), nl.bfloat16, buffer=nl.sbuf)
        nisa.nc_matmul(ps[:, off : off + 512], st, mv)

    run(k, 0)
    run(k, 512)
    with pytest.raises(MatmulLimitError, match="bank"):
        run(k, 256)


def test_pe_transpose_is_bit_exact_including_nan() -> None:
    x = f32((100, 70)).astype(BF16)
    x[3, 5] = np.nan
    x[7, 1] = np.inf

    def k(x):
        ps = nl.ndarray((70, 100), nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=ps, data=load(x))
        ps2 = nl.ndarray((70, 100), nl.bfloat16, buffer=nl.psum)
        ident = nl.shared_identity_matrix(100, nl.bfloat16)
        nisa.nc_matmul(ps2, load(x), ident, is_transpose=True)
        return store(ps), store(ps2)

    a, b = run(k, x)
    for got in (a, b):
        assert np.array_equal(got.view(np.uint16), x.T.view(np.uint16))
    c = nki.last_counters()
    assert c.transpose_instructions == 1 and c.matmul_instructions == 1


def test_nc_transpose_rejects_fp8_and_oversize() -> None:
    def k(x, dst_dtype, engine):
        ps = nl.ndarray((x.shape[1], x.shape[0]), dst_dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=ps, data=load(x), engine=engine)
        return store(ps)

    with pytest.raises(DtypeError, match="fp8"):
        run(k, fp8_values((8, 8)), nl.float8_e4m3, nisa.engine.unknown)
    x = f32((32, 32))
    assert np.array_equal(run(k, x, nl.float32, nisa.engine.vector), x.T)
    with pytest.raises(MatmulLimitError, match=r"\[32, 32\]"):
        run(k, f32((8, 33)), nl.float32, nisa.engine.vector)


# ---- Scalar / Vector engines ---------------------------------------------------------------------------
def _act_ref(name: str, x: np.ndarray) -> np.ndarray:
    erf = np.vectorize(math.erf)
    sig = 1 / (1 + np.exp(-x))
    return {
        "exp": np.exp(x),
        "silu": x * sig,
        "sigmoid": sig,
        "tanh": np.tanh(x),
        "gelu": 0.5 * x * (1 + erf(x / np.sqrt(2))),
        "relu": np.maximum(x, 0),
        "square": x * x,
        "copy": x,
        "rsqrt": 1 / np.sqrt(np.abs(x) + 1),
    }[name]


@pytest.mark.parametrize("name", ["exp", "silu", "sigmoid", "tanh", "gelu", "relu", "square", "copy"])
def test_activation_applies_scale_then_bias_then_function(name: str) -> None:
    x = f32((32, 48))
    scale = f32((32, 1))
    bias = f32((32, 1))

    def k(x, scale, bias):
        y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=getattr(nl, name), data=load(x), bias=load(bias), scale=load(scale))
        y2 = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y2, op=getattr(nl, name), data=load(x), bias=0.25, scale=0.5)
        return store(y), store(y2)

    y, y2 = run(k, x, scale, bias)
    t = (x * scale + bias).astype(np.float64)  # fp32 multiply, fp32 add, as the engine
    assert np.allclose(y, _act_ref(name, t), rtol=2e-7, atol=1e-30)
    t2 = (x * np.float32(0.5) + np.float32(0.25)).astype(np.float64)
    assert np.allclose(y2, _act_ref(name, t2), rtol=2e-7, atol=1e-30)


def test_activation_reduce_registers_reset_reduce_idle() -> None:
    x = f32((16, 40))

    def k(x):
        sx = load(x)
        y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        stale = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=nl.exp, data=sx, reduce_res=stale)  # idle before any reset: NaN registers
        s1 = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(
            dst=y, op=nl.exp, data=sx, reduce_op=nl.add, reduce_res=s1, reduce_cmd=nisa.reduce_cmd.reset_reduce
        )
        s2 = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=nl.copy, data=sx, reduce_op=nl.add, reduce_res=s2, reduce_cmd=nisa.reduce_cmd.reduce)
        s3 = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=y, op=nl.copy, data=sx, reduce_op=nl.add, reduce_res=s3)
        return store(stale), store(s1), store(s2), store(s3)

    stale, s1, s2, s3 = run(k, x)
    e = np.exp(x.astype(np.float64)).astype(np.float32).astype(np.float64).sum(1, keepdims=True)
    assert np.isnan(stale).all()
    assert np.allclose(s1, e, rtol=1e-6)
    assert np.allclose(s2, e + x.astype(np.float64).sum(1, keepdims=True), rtol=1e-5)
    assert np.allclose(s3, x.astype(np.float64).sum(1, keepdims=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("op", "ref"),
    [
        ("add", np.add),
        ("subtract", np.subtract),
        ("multiply", np.multiply),
        ("maximum", np.maximum),
        ("minimum", np.minimum),
        ("greater_equal", lambda a, b: (a >= b).astype(np.float32)),
        ("less", lambda a, b: (a < b).astype(np.float32)),
        ("equal", lambda a, b: (a == b).astype(np.float32)),
    ],
)
def test_tensor_tensor_fp32_ops_cast_on_write(op: str, ref) -> None:
    a = f32((64, 33))
    b = f32((64, 33))
    b[0, :3] = a[0, :3]

    def k(a, b):
        x, y = load(a), load(b)
        o32 = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        o16 = nl.ndarray(a.shape, nl.bfloat16, buffer=nl.psum)  # dst may be PSUM
        nisa.tensor_tensor(dst=o32, data1=x, data2=y, op=getattr(nl, op))
        nisa.tensor_tensor(dst=o16, data1=x, data2=y, op=getattr(nl, op))
        return store(o32), store(o16)

    o32, o16 = run(k, a, b)
    expect = ref(a, b).astype(np.float32)  # numpy float32 ops round once, like the fp32 ALU
    assert np.array_equal(o32, expect)
    assert np.array_equal(o16.view(np.uint16), expect.astype(BF16).view(np.uint16))


def test_divide_is_not_an_isa_operator() -> None:
    def k(a):
        x = load(a)
        nisa.tensor_tensor(dst=x, data1=x, data2=x, op=nl.divide)

    with pytest.raises(NkiValidationError, match="reciprocal"):
        run(k, f32((2, 2)))


def test_tensor_tensor_integer_and_bitvec_ops_are_exact() -> None:
    a = RNG.integers(-(2**30), 2**30, (8, 16), dtype=np.int32)
    b = RNG.integers(0, 31, (8, 16), dtype=np.int32)

    def k(a, b):
        x, y = load(a), load(b)
        outs = []
        for op in (nl.add, nl.multiply, nl.bitwise_and, nl.left_shift, nl.right_shift):
            o = nl.ndarray(a.shape, nl.int32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=o, data1=x, data2=y, op=op)
            outs.append(store(o))
        return tuple(outs)

    add, mul, band, shl, shr = run(k, a, b)
    a64, b64 = a.astype(np.int64), b.astype(np.int64)
    assert np.array_equal(add, (a64 + b64).astype(np.int32))
    assert np.array_equal(mul, (a64 * b64).astype(np.int32))  # wraps like 32-bit integer hardware
    assert np.array_equal(band, a & b)
    assert np.array_equal(shl, (a64 << b64).astype(np.int32))
    assert np.array_equal(shr, ((a64 & 0xFFFFFFFF) >> b64).astype(np.int32))  # logical shift


def test_elementwise_shape_rules() -> None:
    def k(a_shape, b_shape, a_buf, b_buf):
        a = nl.zeros(a_shape, nl.float32, buffer=a_buf)
        b = nl.zeros(b_shape, nl.float32, buffer=b_buf)
        o = nl.ndarray(a_shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=o, data1=a, data2=b, op=nl.add)
        return store(o)

    assert (run(k, (8, 6), (8, 2, 3), nl.sbuf, nl.psum) == 0).all()  # same elements per partition suffice
    with pytest.raises(ShapeError, match="same partition count"):
        run(k, (8, 6), (4, 12), nl.sbuf, nl.sbuf)
    with pytest.raises(MemorySpaceError, match="both be in PSUM"):
        run(k, (8, 6), (8, 6), nl.psum, nl.psum)


def test_tensor_scalar_two_ops_reverse_and_column_operands() -> None:
    x = f32((16, 24))
    col = f32((16, 1))

    def k(x, col):
        sx, sc = load(x), load(col)
        o1 = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o1, data=sx, op0=nl.subtract, operand0=sc, op1=nl.multiply, operand1=3.0)
        o2 = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o2, data=sx, op0=nl.subtract, operand0=1.5, reverse0=True)
        o3 = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o3, data=sx, op0=nl.abs, operand0=None, op1=nl.maximum, operand1=0.5)
        o4 = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o4, data=sx, op0=nl.add, operand0=1.0, op1=nl.subtract, operand1=sc, reverse1=True)
        return store(o1), store(o2), store(o3), store(o4)

    o1, o2, o3, o4 = run(k, x, col)
    assert np.array_equal(o1, (x - col) * np.float32(3))
    assert np.array_equal(o2, np.float32(1.5) - x)
    assert np.array_equal(o3, np.maximum(np.abs(x), np.float32(0.5)))
    assert np.array_equal(o4, col - (x + np.float32(1)))


def test_scalar_tensor_tensor_matches_unfused_fp32_torch() -> None:
    s = torch.randn(96, 192)
    kv = torch.randn(96, 192)
    lam = 0.9371

    def k(s, kv):
        ss, skv = load(s), load(kv)
        o = nl.ndarray(s.shape, nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=o, data=ss, op0=nl.multiply, operand0=lam, op1=nl.add, operand1=skv)
        o2 = nl.ndarray(s.shape, nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(
            dst=o2, data=ss, op0=nl.subtract, operand0=1.0, op1=nl.subtract, operand1=skv, reverse0=True, reverse1=True
        )
        return store(o), store(o2)

    o, o2 = run(k, s, kv)
    assert torch.equal(o, lam * s + kv)  # torch: fp32 multiply, then fp32 add
    assert torch.equal(o2, kv - (1.0 - s))


def test_tensor_reduce_over_trailing_axes_with_negate() -> None:
    x = f32((8, 4, 5))

    def k(x):
        sx = load(x)
        s = nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=s, op=nl.add, data=sx, axis=2)
        m = nl.ndarray((8, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=m, op=nl.maximum, data=sx, axis=(1, 2), negate=True)
        return store(s), store(m)

    s, m = run(k, x)
    assert np.array_equal(s, x.astype(np.float64).sum(2).astype(np.float32))
    assert np.array_equal(m[:, 0], -x.max((1, 2)))

    def bad(x):
        d = nl.ndarray((8, 5), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=d, op=nl.add, data=load(x), axis=1)

    with pytest.raises(NkiValidationError, match="trailing free dims"):
        run(bad, x)


def test_tensor_copy_memset_iota_reciprocal() -> None:
    x = f32((8, 10))

    def k(x):
        sx = load(x)
        c = nl.ndarray((8, 2, 5), nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=c, src=sx)
        m = nl.ndarray((8, 3), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=m, value=-5)
        i = nl.ndarray((8, 2, 3), nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=i, pattern=[[10, 2], [1, 3]], offset=7, channel_multiplier=100)
        fi = nl.ndarray((8, 6), nl.float32, buffer=nl.sbuf)
        nisa.iota(fi, [[1, 6]], 0, 2)
        r = nl.ndarray((8, 10), nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=r, data=sx)
        return store(c), store(m), store(i), store(fi), store(r)

    c, m, i, fi, r = run(k, x)
    assert np.array_equal(c.reshape(8, 10), x)
    assert (m == -5).all()
    p = np.arange(8)[:, None, None]
    assert np.array_equal(i, 7 + 100 * p + 10 * np.arange(2)[None, :, None] + np.arange(3)[None, None, :])
    assert np.array_equal(fi, (2 * np.arange(8)[:, None] + np.arange(6)[None, :]).astype(np.float32))
    assert np.array_equal(r, np.float32(1) / x)

    def bad(x):
        nisa.memset(dst=nl.ndarray((8, 3), nl.int32, buffer=nl.sbuf), value=2.0)

    with pytest.raises(DtypeError, match="integer value"):
        run(bad, x)


def test_predicated_copy_and_selects() -> None:
    x = f32((8, 12))
    pred = (RNG.random((8, 12)) > 0.5).astype(np.uint8)
    bound = RNG.integers(0, 12, (8, 1)).astype(np.float32)

    def k(x, pred, bound):
        sx, sp = load(x), load(pred)
        d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=d, value=-1.0)
        nisa.tensor_copy_predicated(dst=d, src=sx, predicate=sp)
        a = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.affine_select(a, [[1, 12]], -1, sx, -9.0, cmp_op=nl.greater_equal)  # keep j >= p (causal)
        r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        rmax = nl.ndarray((8, 1), nl.float32, buffer=nl.sbuf)
        sb = load(bound)
        nisa.range_select(r, sx, nl.greater_equal, nl.less, bound0=sb, bound1=sb, reduce_res=rmax)  # empty range
        return store(d), store(a), store(r), store(rmax)

    d, a, r, rmax = run(k, x, pred, bound)
    assert np.array_equal(d, np.where(pred != 0, x, -1))
    jj, pp = np.meshgrid(np.arange(12), np.arange(8))
    assert np.array_equal(a, np.where(jj - pp >= 0, x, -9))
    fmin = np.finfo(np.float32).min
    assert (r == fmin).all() and (rmax == fmin).all()


def test_tensor_scalar_reduce_and_select_reduce() -> None:
    x = f32((16, 20))
    pred = (RNG.random((16, 20)) > 0.3).astype(np.uint8)

    def k(x, pred):
        sx = load(x)
        y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        amax = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=y, data=sx, op0=nl.abs, operand0=0.0, reduce_op=nl.maximum, reduce_res=amax)
        z = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        zmax = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.select_reduce(
            z, load(pred), sx, -1e30, reduce_res=zmax, reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_op=nl.maximum
        )
        return store(y), store(amax), store(z), store(zmax)

    y, amax, z, zmax = run(k, x, pred)
    assert np.array_equal(y, np.abs(x)) and np.array_equal(amax[:, 0], np.abs(x).max(1))
    zz = np.where(pred != 0, x, np.float32(-1e30))
    assert np.array_equal(z, zz) and np.array_equal(zmax[:, 0], zz.max(1))


# ---- loops and registers ---------------------------------------------------------------------------------
def test_fori_loop_zero_or_one_trip_from_register_and_counters() -> None:
    def k(w, flags):
        out = nl.ndarray((len(flags.shape) * 0 + flags.shape[0], w.shape[1]), nl.float32, buffer=nl.shared_hbm)
        fl = load(flags)
        for e in range(flags.shape[0]):
            r = nisa.register_alloc()
            nisa.register_load(r, fl[e : e + 1, :])
            row = nl.ndarray((1, w.shape[1]), nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=row, value=0.0)

            def body(i):
                nisa.dma_copy(dst=row, src=w[e : e + 1, :])  # noqa: B023 - runs before the next iteration

            nl.fori_loop(0, r, body)
            nisa.dma_copy(dst=out[e : e + 1, :], src=row)
        return out

    w = f32((4, 64))
    flags = np.array([1, 0, 0, 1], np.int32)
    out = run(k, w, flags)
    assert np.array_equal(out, w * flags[:, None])
    c = nki.last_counters()
    assert c.dma_hbm_to_sbuf_bytes == 4 * 4 + 2 * 64 * 4  # flags + the two non-empty rows only
    assert c.dma_sbuf_to_hbm_bytes == 4 * 64 * 4
    assert c.dma_instructions == 1 + 2 + 4
    assert c.instructions["fori_loop"] == 4


def test_fori_loop_induction_register_as_scalar_offset() -> None:
    def k(data, n):
        out = nl.ndarray(data.shape, nl.float32, buffer=nl.shared_hbm)

        def body(i):
            nisa.dma_copy(dst=out.ap([[1, 1]], scalar_offset=i), src=data.ap([[1, 1]], scalar_offset=i))

        nl.fori_loop(0, n, body)
        return out

    out = run(k, np.arange(6, dtype=np.float32), 4)
    assert np.array_equal(out[:4], np.arange(4)) and np.isnan(out[4:]).all()


def test_while_loop_runs_until_the_returned_register_is_zero() -> None:
    def k(n):
        acc = nl.zeros((1, 1), nl.float32, buffer=nl.sbuf)
        cnt = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=cnt, value=n)

        def body(r):
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
            nisa.tensor_scalar(dst=cnt, data=cnt, op0=nl.subtract, operand0=1.0)
            nxt = nisa.register_alloc()
            nisa.register_load(nxt, cnt)
            return nxt

        nl.while_loop(nisa.register_alloc(n), body)
        return store(acc)

    assert run(k, 5)[0, 0] == 5 and run(k, 0)[0, 0] == 0


def test_registers_are_not_python_values() -> None:
    def k(x):
        r = nisa.register_alloc(1)
        if r:
            pass

    with pytest.raises(RegisterError, match="truth value"):
        run(k, f32((1, 1)))

    def unset(x):
        nl.fori_loop(0, nisa.register_alloc(), lambda i: None)

    with pytest.raises(RegisterError, match="before it was written"):
        run(unset, f32((1, 1)))


# ---- capacity and partition limits ---------------------------------------------------------------------
def test_partition_dim_over_128_is_rejected() -> None:
    def k(buf):
        nl.ndarray((129, 4), nl.float32, buffer=buf)

    for buf in (nl.sbuf, nl.psum):
        with pytest.raises(PartitionLimitError, match="129"):
            run(k, buf)
    run(k, nl.shared_hbm)  # HBM has no partition dim


def test_psum_capacity_counts_allocation_sites_in_banks() -> None:
    def k(n_extra):
        for _ in range(20):
            nl.ndarray((128, 512), nl.float32, buffer=nl.psum)  # one site, allocated 20 times: one bank
        nl.ndarray((128, 600), nl.float32, buffer=nl.psum)  # 2400 bytes per partition: two banks
        nl.ndarray((4, 1), nl.float32, buffer=nl.psum)  # 4 bytes: still a whole bank
        extras = [
            lambda: nl.ndarray((1, 1), nl.float32, buffer=nl.psum),
            lambda: nl.ndarray((1, 1), nl.float32, buffer=nl.psum),
            lambda: nl.ndarray((1, 1), nl.float32, buffer=nl.psum),
            lambda: nl.ndarray((1, 1), nl.float32, buffer=nl.psum),
            lambda: nl.ndarray((1, 1), nl.float32, buffer=nl.psum),
        ]
        for f in extras[:n_extra]:
            f()

    run(k, 4)
    assert nki.last_counters().psum_bytes_per_partition == 8 * 2048
    with pytest.raises(CapacityError, match="PSUM allocations total 18432"):
        run(k, 5)


def _sbuf_tile():  # a helper: each calling line is its own allocation site
    return nl.ndarray((128, 25 * 1024), nl.float32, buffer=nl.sbuf)  # 100 KiB per partition


def test_sbuf_capacity_is_192_kib_per_partition_by_site() -> None:
    def one_site():
        for _ in range(10):
            _sbuf_tile()

    def two_sites():
        _sbuf_tile()
        _sbuf_tile()

    run(one_site)
    assert nki.last_counters().sbuf_bytes_per_partition == 100 * 1024
    with pytest.raises(CapacityError, match="SBUF"):
        run(two_sites)


# ---- simulate: write-back, counters, speed ---------------------------------------------------------------
def test_write_back_only_for_modified_inputs_in_place() -> None:
    def k(a, b, c, scale):
        t = load(a)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=scale)
        nisa.dma_copy(dst=b[1:3, :], src=t[0:2, :])  # partial in-place update of b
        return store(t)

    a = torch.randn(4, 8)
    b = torch.zeros(4, 8)
    c = torch.randn(2, 2)
    a0, c0 = a.clone(), c.clone()
    ptr = b.data_ptr()
    y = run(k, a, b, c, 2.0)
    assert torch.equal(y, a * 2) and torch.equal(a, a0) and torch.equal(c, c0)
    assert b.data_ptr() == ptr and torch.equal(b[1:3], a[:2] * 2) and (b[[0, 3]] == 0).all()
    # numpy in, numpy out, also in place
    bn = np.zeros((4, 8), np.float32)
    yn = run(k, a.numpy(), bn, c.numpy(), 2.0)
    assert isinstance(yn, np.ndarray) and np.array_equal(bn[1:3], a.numpy()[:2] * 2)


def test_returned_tensors_must_be_shared_hbm() -> None:
    def k(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.hbm)
        nisa.dma_copy(dst=out, src=x)
        return out

    with pytest.raises(NkiValidationError, match="shared_hbm"):
        run(k, f32((2, 2)))


def test_counters_exact_for_a_known_kernel() -> None:
    """Tiled bf16 matmul: C[M, N] = A[K, M].T @ B[K, N], K = 256 in two 128-row tiles, N in 512 tiles."""

    def k(a_t, b):
        kk, m = a_t.shape
        n = b.shape[1]
        out = nl.ndarray((m, n), nl.float32, buffer=nl.shared_hbm)
        for j in range(n // 512):
            ps = nl.ndarray((m, 512), nl.float32, buffer=nl.psum)
            for i in range(kk // 128):
                at = load(a_t[i * 128 : (i + 1) * 128, :])
                bt = load(b[i * 128 : (i + 1) * 128, j * 512 : (j + 1) * 512])
                nisa.nc_matmul(ps, at, bt, accumulate=i > 0)
            o = nl.ndarray((m, 512), nl.bfloat16, buffer=nl.sbuf)
            nisa.tensor_copy(dst=o, src=ps)
            nisa.dma_copy(dst=out[:, j * 512 : (j + 1) * 512], src=o)  # bf16 -> fp32 cast in the DMA
        return out

    a = f32((256, 96)).astype(BF16)
    b = f32((256, 1024)).astype(BF16)
    out = run(k, a, b)
    ref = a.astype(np.float64).T @ b.astype(np.float64)
    assert np.allclose(out, ref, rtol=1e-2, atol=1e-2)  # bf16 output rounding
    c = nki.last_counters()
    assert c.matmul_instructions == 4 and c.matmul_macs == 4 * 128 * 96 * 512
    assert c.dma_instructions == 2 * 2 * 2 + 2
    assert c.dma_hbm_to_sbuf_bytes == 2 * (256 * 96 * 2) + 256 * 1024 * 2  # A read per N tile, B once
    assert c.dma_sbuf_to_hbm_bytes == 96 * 1024 * 4
    assert c.dma_bytes == c.dma_hbm_to_sbuf_bytes + c.dma_sbuf_to_hbm_bytes
    assert c.instructions == {"dma_copy": 10, "nc_matmul": 4, "tensor_copy": 2}
    sim = simulate(nki.jit(k))
    sim(a, b)
    assert sim.counters == c


def test_thousands_of_instructions_keep_fp32_rounding() -> None:
    def k(x):
        t = load(x)
        for _ in range(1000):
            u = nl.ndarray((128, 192), nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=u, data=t, op0=nl.multiply, operand0=0.5, op1=nl.add, operand1=t)
            nisa.tensor_scalar(dst=t, data=u, op0=nl.multiply, operand0=2.0 / 3.0)
            ps = nl.ndarray((96, 192), nl.float32, buffer=nl.psum)
            nisa.nc_matmul(ps, t[:, 0:96], t)
        return store(t)

    x = f32((128, 192))
    out = run(k, x)
    ref = x.copy()
    for _ in range(1000):
        ref = ((ref * np.float32(0.5)) + ref) * np.float32(2.0 / 3.0)  # the same fp32 operations
    assert np.array_equal(out, ref)
    assert nki.last_counters().matmul_instructions == 1000


def test_kernel_runs_pin_blas_threads_only_while_running() -> None:
    from vllm_trn_plugin.kernels.nki_emu import runtime

    if runtime._BLAS is None:
        pytest.skip("no bundled OpenBLAS found")
    get, set_ = runtime._BLAS
    before = get()
    set_(2)
    seen = []

    def k(x):
        seen.append(get())
        return store(load(x))

    try:
        run(k, f32((2, 2)))
        assert seen == [1] and get() == 2
    finally:
        set_(before)


def test_static_access_pattern_outside_the_buffer_is_rejected() -> None:
    def k(x):
        x.ap([[4, 3], [1, 4]], offset=1)  # last element would be x.flat[12] of 12

    with pytest.raises(OutOfBoundsError, match="outside its buffer"):
        run(k, f32((3, 4)))
