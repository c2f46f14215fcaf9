"""The NKI emulator's TensorE: nc_matmul (stationary^T x moving, FP8 double row, accumulation flags, limits)
and PE transposes, against float64 products."""

from __future__ import annotations

import numpy as np
import pytest

from tests.emulator_helpers import BF16, E4M3, f32, fp8_values, load, run, store
from vllm_trn_plugin.kernels.nki_emu import errors
from vllm_trn_plugin.kernels.nki_shim import nisa, nki, nl


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
    with pytest.raises(errors.NkiValidationError, match=match):
        run(_matmul_kernel, st, mv, nisa.matmul_perf_mode.double_row)


def test_nc_matmul_double_row_not_with_transpose() -> None:
    def k(st, mv):
        ps = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, load(st), load(mv), is_transpose=True, perf_mode=nisa.matmul_perf_mode.double_row)

    with pytest.raises(errors.MatmulLimitError, match="is_transpose"):
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
        (((128, 129), (128, 8), (129, 8)), errors.PartitionLimitError),  # dst partition = stationary free 129
        (((64, 128), (64, 513), (128, 513)), errors.MatmulLimitError),
        (((64, 8), (32, 8), (8, 8)), errors.MatmulLimitError),
    ]
    for shapes, err in bad:
        with pytest.raises(err):
            run(k, *shapes, nl.psum, nl.sbuf, nl.float32)
    with pytest.raises(errors.MatmulLimitError, match="stationary free size 200"):
        run(k, (64, 200), (64, 8), (128, 8), nl.psum, nl.sbuf, nl.float32)
    with pytest.raises(errors.MemorySpaceError, match="dst"):
        run(k, (64, 8), (64, 8), (8, 8), nl.sbuf, nl.sbuf, nl.float32)
    with pytest.raises(errors.MemorySpaceError, match="stationary"):
        run(k, (64, 8), (64, 8), (8, 8), nl.psum, nl.psum, nl.float32)
    with pytest.raises(errors.DtypeError, match="float32"):
        run(k, (64, 8), (64, 8), (8, 8), nl.psum, nl.sbuf, nl.bfloat16)


def test_nc_matmul_output_must_fit_one_psum_bank() -> None:
    def k(off):
        ps = nl.ndarray((8, 1024), nl.float32, buffer=nl.psum)  # two banks per partition
        st = nl.zeros((16, 8), nl.bfloat16, buffer=nl.sbuf)
        mv = nl.zeros((16, 512), nl.bfloat16, buffer=nl.sbuf)
        nisa.nc_matmul(ps[:, off : off + 512], st, mv)

    run(k, 0)
    run(k, 512)
    with pytest.raises(errors.MatmulLimitError, match="bank"):
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

    with pytest.raises(errors.DtypeError, match="fp8"):
        run(k, fp8_values((8, 8)), nl.float8_e4m3, nisa.engine.unknown)
    x = f32((32, 32))
    assert np.array_equal(run(k, x, nl.float32, nisa.engine.vector), x.T)
    with pytest.raises(errors.MatmulLimitError, match=r"\[32, 32\]"):
        run(k, f32((8, 33)), nl.float32, nisa.engine.vector)
