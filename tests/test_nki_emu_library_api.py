"""The NKI API added to the emulator for AWS's nki-library kernels (issue 28), each against a NumPy statement of its
documented semantics (aws-neuron/aws-neuron-sdk @ 81ce03ae, nki/api/nki/isa/__init__.py and language/__init__.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.emulator_helpers import BF16, load, run, store
from vllm_trn_plugin.kernels.nki_emu import errors
from vllm_trn_plugin.kernels.nki_shim import nisa, nl

RNG = np.random.default_rng(28)


def test_tensor_tensor_scan_is_the_documented_recurrence() -> None:
    """result[:, 0] = op1(op0(data0[:, 0], initial), data1[:, 0]); result[:, i] = op1(op0(data0[:, i], result[:, i-1]),
    data1[:, i]) in fp32, per partition; a (P, 1) initial."""
    d0 = RNG.uniform(0.5, 1.0, (8, 40)).astype(np.float32)
    d1 = RNG.standard_normal((8, 40)).astype(np.float32)
    init = RNG.standard_normal((8, 1)).astype(np.float32)

    def k(a, b, c):
        out = nl.ndarray((8, 40), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(dst=out, data0=load(a), data1=load(b), initial=load(c), op0=nl.multiply, op1=nl.add)
        return store(out)

    want = np.empty_like(d0)
    prev = init[:, 0]
    for i in range(40):
        prev = (d0[:, i] * prev).astype(np.float32) + d1[:, i]
        want[:, i] = prev
    np.testing.assert_array_equal(run(k, d0, d1, init), want)


def test_tensor_tensor_scan_reverse_and_scalar_initial() -> None:
    """reverse0 makes data0 the rhs of op0, reverse1 makes data1 the lhs of op1; a scalar initial broadcasts."""
    d0 = RNG.standard_normal((4, 6)).astype(np.float32)
    d1 = RNG.standard_normal((4, 6)).astype(np.float32)

    def k(a, b):
        out = nl.ndarray((4, 6), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(
            dst=out,
            data0=load(a),
            data1=load(b),
            initial=2.0,
            op0=nl.subtract,
            op1=nl.subtract,
            reverse0=True,
            reverse1=True,
        )
        return store(out)

    prev = np.full(4, 2.0, np.float32)
    want = np.empty_like(d0)
    for i in range(6):
        prev = d1[:, i] - (prev - d0[:, i])
        want[:, i] = prev
    np.testing.assert_allclose(run(k, d0, d1), want, rtol=1e-6)


def test_tensor_scalar_reduce_absmax_and_register_commands() -> None:
    """dst = |data|; reduce_res = max over the free dims; reduce accumulates onto the registers, load_reduce starts
    from reduce_init, reduce_res_negate negates only the readout."""
    x = RNG.standard_normal((16, 3, 10)).astype(np.float32)
    y = RNG.standard_normal((16, 30)).astype(np.float32)
    init = RNG.uniform(2, 3, (16, 1)).astype(np.float32)

    def k(a, b, c):
        xa, yb, ic = load(a), load(b), load(c)
        d1 = nl.ndarray((16, 3, 10), nl.float32, buffer=nl.sbuf)
        d2 = nl.ndarray((16, 30), nl.float32, buffer=nl.sbuf)
        r1 = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        r2 = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        r3 = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=d1, data=xa, op0=nl.abs, operand0=0.0, reduce_op=nl.maximum, reduce_res=r1)
        nisa.tensor_scalar_reduce(
            dst=d2,
            data=yb,
            op0=nl.multiply,
            operand0=2.0,
            reduce_op=nl.maximum,
            reduce_res=r2,
            reduce_cmd=nisa.reduce_cmd.reduce,
            reduce_res_negate=True,
        )
        nisa.tensor_scalar_reduce(
            dst=d2,
            data=yb,
            op0=nl.add,
            operand0=1.0,
            reduce_op=nl.add,
            reduce_res=r3,
            reduce_cmd=nisa.reduce_cmd.load_reduce,
            reduce_init=ic,
        )
        return store(d1), store(r1), store(r2), store(r3)

    d1, r1, r2, r3 = run(k, x, y, init)
    np.testing.assert_array_equal(d1, np.abs(x))
    np.testing.assert_array_equal(r1[:, 0], np.abs(x).reshape(16, -1).max(axis=1))
    np.testing.assert_array_equal(r2[:, 0], -np.maximum(r1[:, 0], (2 * y).max(axis=1)))
    np.testing.assert_allclose(r3[:, 0], init[:, 0] + (y + 1).sum(axis=1), rtol=1e-6)


def test_tensor_scalar_reduce_refuses_reverse0_and_bitvec() -> None:
    def k(a):
        t = load(a)
        d = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=d, data=t, op0=nl.subtract, operand0=1.0, reduce_op=nl.add, reverse0=True)

    with pytest.raises(errors.NkiValidationError, match="reverse0"):
        run(k, np.zeros((4, 8), np.float32))


def test_activation_reduce_is_activation_with_reset_reduce() -> None:
    """activation_reduce = activation(reduce_cmd=reset_reduce, reduce_res=...): the row sum of op(data*scale+bias)."""
    x = RNG.standard_normal((8, 2, 16)).astype(np.float32)

    def k(a):
        t = load(a)
        d = nl.ndarray((8, 2, 16), nl.float32, buffer=nl.sbuf)
        r = nl.ndarray((8, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=d, op=nl.copy, data=t, reduce_op=nl.add, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation_reduce(dst=d, op=nl.square, data=t, reduce_op=nl.add, reduce_res=r, scale=0.5)
        return store(d), store(r)

    d, r = run(k, x)
    sq = np.square(x.astype(np.float64) * 0.5).astype(np.float32)
    np.testing.assert_array_equal(d, sq)
    np.testing.assert_allclose(r[:, 0], sq.reshape(8, -1).astype(np.float64).sum(axis=1), rtol=1e-6)


def test_max8_and_nc_find_index8() -> None:
    """max8: the 8 largest per partition, descending; nc_find_index8: first occurrence of each, uint32, repeated
    values paired with successive occurrences, absent values -> 0xFFFFFFFF."""
    x = RNG.standard_normal((6, 2, 20)).astype(np.float32)
    x[0, 1, 5] = x[0, 0, 3]  # a repeated maximum in partition 0
    x[0, 0, 3] = x[0, 1, 5] = 10.0
    vals = np.sort(x.reshape(6, -1), axis=1)[:, ::-1][:, :8].copy()
    vals[5, 7] = 123.0  # not present

    def k(a, v):
        t = load(a)
        top = nl.ndarray((6, 8), nl.float32, buffer=nl.sbuf)
        idx = nl.ndarray((6, 8), nl.uint32, buffer=nl.sbuf)
        nisa.max8(dst=top, src=t)
        nisa.nc_find_index8(dst=idx, data=t, vals=load(v))
        return store(top), store(idx)

    top, idx = run(k, x, vals)
    flat = x.reshape(6, -1)
    np.testing.assert_array_equal(top, np.sort(flat, axis=1)[:, ::-1][:, :8])
    assert idx[0, 0] == 3 and idx[0, 1] == 25  # the repeated 10.0: first, then second occurrence
    for p in range(1, 5):
        np.testing.assert_array_equal(flat[p, idx[p]], vals[p])
    assert idx[5, 7] == 0xFFFFFFFF


def test_max8_limits() -> None:
    def k(a):
        d = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=d, src=load(a))

    with pytest.raises(errors.ShapeError, match="8..16384"):
        run(k, np.zeros((4, 7), np.float32))


def test_nc_stream_shuffle_within_quadrants() -> None:
    """dst partition q*32+i = src partition q*32+mask[i]; 255 leaves it; the one-partition broadcast of
    nki-library."""
    x = RNG.standard_normal((64, 5)).astype(np.float32)
    mask = [(i + 1) % 32 for i in range(32)]
    mask[7] = 255

    def k(a):
        t = load(a)
        d = nl.ndarray((64, 5), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=d, value=-1.0)
        nisa.nc_stream_shuffle(dst=d, src=t, shuffle_mask=mask)
        b = nl.ndarray((64, 5), nl.float32, buffer=nl.sbuf)
        nisa.nc_stream_shuffle(dst=b[32:64, :], src=t[0:1, :], shuffle_mask=[0] * 32)
        return store(d), store(b[32:64, :])

    d, b = run(k, x)
    for q in range(2):
        for i in range(32):
            want = -1.0 if mask[i] == 255 else x[q * 32 + mask[i]]
            np.testing.assert_array_equal(d[q * 32 + i], want)
    np.testing.assert_array_equal(b, np.broadcast_to(x[0], (32, 5)))


def test_nc_stream_shuffle_start_partition_rule() -> None:
    """With 64 active partitions the access must start at partition 0 or 64 [ISA]."""

    def k(a):
        t = load(a)
        d = nl.ndarray((128, 5), nl.float32, buffer=nl.sbuf)
        nisa.nc_stream_shuffle(dst=d[32:96, :], src=t[0:64, :], shuffle_mask=list(range(32)))

    with pytest.raises(errors.NkiValidationError, match="starts at partition 32"):
        run(k, np.zeros((128, 5), np.float32))


def test_local_gather_matches_the_docs_numpy_semantics() -> None:
    """Per 16-partition core: indices flattened column-major over the core's partitions; every partition gathers
    ``num_elem_per_idx`` contiguous elements of its own row at each index (aws-neuron-sdk nki/test/
    test_nki_isa_local_gather.py's NumPy statement)."""
    src = RNG.standard_normal((32, 64)).astype(np.float32)
    idx = (RNG.integers(0, 31, (32, 3)) * 2).astype(np.uint16)

    def k(s, i):
        d = nl.ndarray((32, 40 * 2), nl.float32, buffer=nl.sbuf)
        nisa.local_gather(dst=d, src_buffer=load(s), index=load(i), num_elem_per_idx=2, num_valid_indices=40)
        return store(d)

    out = run(k, src, idx)
    want = np.empty((32, 40, 2), np.float32)
    for c in range(2):
        rows = slice(16 * c, 16 * c + 16)
        flat = idx[rows].flatten(order="F")[:40].astype(np.int64)
        for e in range(2):
            want[rows, :, e] = src[rows][:, flat + e]
    np.testing.assert_array_equal(out, want.reshape(32, -1))


@pytest.mark.parametrize("shape", [(16, 24), (2, 8, 24), (4, 1, 1, 16)])
def test_dma_transpose_permutations(shape: tuple[int, ...]) -> None:
    """2-D (1, 0), 3-D (2, 1, 0), 4-D (3, 1, 2, 0); HBM -> SBUF; 2-byte dtypes only."""
    perm = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}[len(shape)]
    x = RNG.standard_normal(shape).astype(BF16)

    def k(a):
        d = nl.ndarray(tuple(shape[p] for p in perm), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d, src=a)
        return store(d)

    np.testing.assert_array_equal(run(k, x), x.transpose(perm))

    def k32(a):
        d = nl.ndarray(tuple(shape[p] for p in perm), nl.float32, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d, src=a)

    with pytest.raises(errors.DtypeError, match="2-byte"):
        run(k32, x.astype(np.float32))


def test_dma_transpose_indirect_gather() -> None:
    """An indirect src (HBM .ap(vector_offset=...)): rows gathered by index, then transposed."""
    table = RNG.standard_normal((40, 16)).astype(BF16)
    rows = RNG.integers(0, 40, (16, 1)).astype(np.int32)

    def k(t, r):
        d = nl.ndarray((16, 16), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d, src=t.ap([[16, 16], [1, 16]], vector_offset=load(r), indirect_dim=0))
        return store(d)

    np.testing.assert_array_equal(run(k, table, rows), table[rows[:, 0]].T)


def test_vector_offset_one_index_per_partition_of_any_rank() -> None:
    """``.ap(vector_offset=...)`` takes an SBUF tensor of one index per partition [APS]; nki-library passes
    (P, 1, 1) views (router_topk's scatter). The emulator used to insist on (P, 1) and refused the kernel."""
    table = RNG.standard_normal((10, 4)).astype(np.float32)
    rows = np.array([3, 7, 1], np.int32).reshape(3, 1, 1)

    def k(t, r):
        ri = nl.ndarray((3, 1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ri, src=r)
        d = nl.ndarray((3, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=d, src=t.ap([[4, 3], [1, 4]], vector_offset=ri, indirect_dim=0))
        return store(d)

    np.testing.assert_array_equal(run(k, table, rows), table[[3, 7, 1]])


def test_load_store_tile_size_nkiobject_nc_version() -> None:
    """nl.load / nl.store as one dma_copy each (store refuses PSUM), tile-size constants, NKIObject, nc_version
    order."""
    x = RNG.standard_normal((4, 6)).astype(np.float32)

    def k(a):
        t = nl.load(a, dtype=nl.bfloat16)
        out = nl.ndarray((4, 6), nl.bfloat16, buffer=nl.shared_hbm)
        nl.store(out, t)
        return out

    np.testing.assert_array_equal(run(k, x), x.astype(BF16))

    def k_psum(a):
        p = nl.ndarray((4, 6), nl.float32, buffer=nl.psum)
        nl.store(a, p)

    with pytest.raises(errors.MemorySpaceError, match="PSUM"):
        run(k_psum, x)
    ts = nl.tile_size
    assert (ts.pmax, ts.psum_fmax, ts.psum_bank_fmax, ts.gemm_stationary_fmax, ts.gemm_moving_fmax) == (
        128,
        512,
        512,
        128,
        512,
    )
    assert ts.psum_num_banks == 8 and ts.total_available_sbuf_size == ts.sbuf_fmax_bytes == 192 * 1024
    assert nl.NKIObject(a=1).a == 1
    assert nisa.get_nc_version() == nisa.nc_version.gen3
    assert nisa.nc_version.gen2 < nisa.get_nc_version() < nisa.nc_version.gen4
    with pytest.raises(TypeError, match="not emulated"):
        nl.ndarray((4, 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
