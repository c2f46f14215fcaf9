"""The NKI emulator's shim, memory model and dtypes: NaN poisoning of fresh buffers, views and reinterpretation,
FP8/bf16 rounding, SBUF/PSUM capacity and partition limits."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from tests.emulator_helpers import BF16, E4M3, f32, load, run, store
from vllm_trn_plugin.kernels import nki_emu
from vllm_trn_plugin.kernels.nki_emu import errors
from vllm_trn_plugin.kernels.nki_shim import USING_EMULATOR, nisa, nki, nl, simulate


# ---- shim -----------------------------------------------------------------------------------------
def test_shim_uses_emulator_here_and_rejects_placeholder_nki(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_trn_plugin.kernels import nki_shim

    assert USING_EMULATOR and nki is nki_emu and nisa is nki_emu.isa and nl is nki_emu.language
    assert simulate is nki_emu.simulate
    # the PyPI placeholder: an importable `nki` without the API
    monkeypatch.setitem(sys.modules, "nki", types.ModuleType("nki"))
    assert nki_shim.genuine_nki() is None
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
    assert nki_shim.genuine_nki() == (fake, fake.language, fake.isa)


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


def test_vector_select_gathers_rows() -> None:
    def k(data, idx):
        return store(load(data.vector_select(0, load(idx))))

    data = f32((6, 5))
    out = run(k, data, np.array([[4], [0], [4]], np.uint32))
    assert np.array_equal(out, data[[4, 0, 4]])
    assert nki.last_counters().dma_instructions == 3


def test_hwdge_needs_equal_dtypes() -> None:
    def k(x):
        t = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x, dge_mode=nisa.dge_mode.hwdge)

    with pytest.raises(errors.DtypeError, match="hwdge"):
        run(k, f32((2, 2)))


def test_onchip_access_pattern_must_step_whole_partitions() -> None:
    def k(x):
        sb = load(x)
        sb.ap([[3, 4], [1, 3]])  # partition stride != 6 elements per partition

    with pytest.raises(errors.NkiValidationError, match="partition access"):
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
    with pytest.raises(errors.NkiValidationError, match="int64"):
        run(k, w, torch.zeros(2, 2, dtype=torch.int64))


# ---- capacity and partition limits ---------------------------------------------------------------------
def test_partition_dim_over_128_is_rejected() -> None:
    def k(buf):
        nl.ndarray((129, 4), nl.float32, buffer=buf)

    for buf in (nl.sbuf, nl.psum):
        with pytest.raises(errors.PartitionLimitError, match="129"):
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
    with pytest.raises(errors.CapacityError, match="PSUM allocations total 18432"):
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
    with pytest.raises(errors.CapacityError, match="SBUF"):
        run(two_sites)
