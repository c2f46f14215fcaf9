"""The NKI emulator's loops and registers, and `simulate`: in-place write-back, returned tensors, instruction and
byte counters, fp32 rounding over long programs, BLAS thread pinning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.emulator_helpers import BF16, f32, load, run, store
from vllm_trn_plugin.kernels.nki_emu import errors
from vllm_trn_plugin.kernels.nki_shim import nisa, nki, nl, simulate


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


def test_registers_are_not_python_values() -> None:
    def k(x):
        r = nisa.register_alloc(1)
        if r:
            pass

    with pytest.raises(errors.RegisterError, match="truth value"):
        run(k, f32((1, 1)))

    def unset(x):
        nl.fori_loop(0, nisa.register_alloc(), lambda i: None)

    with pytest.raises(errors.RegisterError, match="before it was written"):
        run(unset, f32((1, 1)))


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

    with pytest.raises(errors.NkiValidationError, match="shared_hbm"):
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

    if runtime.BLAS_THREADS is None:
        pytest.skip("no bundled OpenBLAS found")
    get, set_ = runtime.BLAS_THREADS
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

    with pytest.raises(errors.OutOfBoundsError, match="outside its buffer"):
        run(k, f32((3, 4)))
