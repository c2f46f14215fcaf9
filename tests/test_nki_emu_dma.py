"""The NKI emulator's DMA: memory spaces, element counts, indexed gathers and scatters with out-of-bounds skip, and
scalar offsets from registers and SBUF tiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.emulator_helpers import f32, load, run, store
from vllm_trn_plugin.kernels.nki_emu import errors
from vllm_trn_plugin.kernels.nki_shim import nisa, nki, nl


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
        with pytest.raises(errors.MemorySpaceError, match="PSUM"):
            run(k, f32((4, 4)))


def test_dma_element_count_must_match() -> None:
    def k(x):
        sb = nl.ndarray((4, 5), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=sb, src=x)

    with pytest.raises(errors.ShapeError, match="element counts"):
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
    with pytest.raises(errors.OutOfBoundsError, match=r"index -1 at partition 2"):
        run(_gather_kernel(nisa.oob_mode.error), data, np.array([[0], [1], [-1]], np.int32))
    with pytest.raises(errors.OutOfBoundsError, match=r"index 10 at partition 0"):
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
    with pytest.raises(errors.OutOfBoundsError, match="scalar_offset value -1"):
        run(k, pool, torch.tensor([-1], dtype=torch.int32))
    assert torch.equal(pool, expect)
