"""The NKI emulator's DMA cost: descriptors (runs contiguous on both sides), per-side runs, run-size histogram and the
estimated time, for contiguous, row-strided, element-strided, transposing and indirect patterns. Every expected value
is worked out by hand from the access pattern and the documented constants (docs/nki.md section 3.6)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.emulator_helpers import BF16, f32, run
from vllm_trn_plugin.kernels.nki_emu import cost
from vllm_trn_plugin.kernels.nki_shim import nisa, nki, nl, simulate

# Documented / chosen constants, restated here so a change in the model shows up as a failing test.
FIXED_NS = 1300.0  # per DMA [DMABW]
BYTES_PER_NS = 23.0  # per engine, Trn2 [DMABW]
DESC_NS = 512 / 23.0  # per descriptor: 512 B at 23 B/ns (fit, UNCONFIRMED)


def engine_ns(descriptors: int, each_bytes: int) -> float:
    return descriptors * (DESC_NS + each_bytes / BYTES_PER_NS)


def test_constants_and_efficiency_curve() -> None:
    assert (cost.DMA_FIXED_NS, cost.DMA_ENGINE_BYTES_PER_NS, cost.DMA_ENGINES) == (FIXED_NS, BYTES_PER_NS, 16)
    assert cost.DMA_DESCRIPTOR_NS == pytest.approx(DESC_NS)
    # b / (b + 512): the DMA bandwidth guide's saturation curve (<256 B poor, 2 KiB near peak, 4 KiB saturated)
    assert cost.efficiency(512) == pytest.approx(0.5)
    assert cost.efficiency(256) == pytest.approx(1 / 3)
    assert cost.efficiency(2048) == pytest.approx(0.8)
    assert cost.efficiency(4096) == pytest.approx(8 / 9)


def _one_dma(shape, dtype, src_of):
    def k(x):
        t = nl.ndarray(shape, dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=src_of(x))

    return k


def test_contiguous_hbm_to_sbuf_is_one_descriptor_per_partition() -> None:
    run(_one_dma((128, 512), nl.float32, lambda x: x), f32((128, 512)))
    c = nki.last_counters()
    # HBM side: one contiguous 256 KiB run; SBUF side: 128 partitions, not adjacent in the address map
    assert (c.dma_src_runs, c.dma_dst_runs, c.dma_descriptors) == (1, 128, 128)
    assert c.dma_run_hist == {2048: 128} and c.dma_run_bytes_min == 2048 and c.dma_mean_run_bytes == 2048
    # 16 engines x 8 partitions: each engine moves 8 descriptors of 2 KiB
    assert c.dma_transfer_ns == pytest.approx(engine_ns(8, 2048))
    assert c.dma_time_ns == pytest.approx(FIXED_NS + engine_ns(8, 2048))


def test_row_block_and_element_strided_reads() -> None:
    # a column block x[:, 0:256] of a [128, 512] fp32 tensor: each row a separate 1 KiB run on both sides
    run(_one_dma((128, 256), nl.float32, lambda x: x[:, 0:256]), f32((128, 512)))
    c = nki.last_counters()
    assert (c.dma_src_runs, c.dma_dst_runs, c.dma_descriptors) == (128, 128, 128)
    assert c.dma_run_hist == {1024: 128}
    # every other element: one 4-byte descriptor per element
    run(_one_dma((16, 64), nl.float32, lambda x: x[:, 0:128:2]), f32((16, 128)))
    c = nki.last_counters()
    assert (c.dma_src_runs, c.dma_dst_runs, c.dma_descriptors) == (16 * 64, 16, 16 * 64)
    assert c.dma_run_hist == {4: 1024} and c.dma_run_bytes_min == 4
    # 16 partitions -> engines 0 and 1, each 8 partitions x 64 descriptors
    assert c.dma_transfer_ns == pytest.approx(engine_ns(8 * 64, 4))


def test_transposing_read_costs_a_descriptor_per_element() -> None:
    # HBM [64, 32] bf16 read transposed into SBUF [32, 64]: partition p = column p, element j = row j
    run(_one_dma((32, 64), nl.bfloat16, lambda x: x.ap([[1, 32], [32, 64]])), f32((64, 32)).astype(BF16))
    c = nki.last_counters()
    assert (c.dma_src_runs, c.dma_dst_runs, c.dma_descriptors) == (2048, 32, 2048)
    assert c.dma_run_hist == {2: 2048} and c.dma_run_bytes == 2048 * 2
    # 32 partitions -> engines 0..3, each 8 partitions x 64 two-byte descriptors
    assert c.dma_time_ns == pytest.approx(FIXED_NS + engine_ns(8 * 64, 2))
    # against the same bytes read contiguously: 32 descriptors of 128 B (4 engines x 8)
    run(_one_dma((32, 64), nl.bfloat16, lambda x: x), f32((32, 64)).astype(BF16))
    contiguous = nki.last_counters()
    assert contiguous.dma_descriptors == 32
    assert contiguous.dma_transfer_ns == pytest.approx(engine_ns(8, 128))
    assert c.dma_transfer_ns / contiguous.dma_transfer_ns > 50


def test_indirect_gather_rows_are_descriptors_each() -> None:
    def k(data, idx):
        p = idx.shape[0]
        ix = nl.ndarray((p, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ix, src=idx)  # p descriptors of 4 B (one per partition)
        g = nl.ndarray((p, 6), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(
            dst=g, src=data.ap([[6, p], [1, 6]], vector_offset=ix, indirect_dim=0), oob_mode=nisa.oob_mode.skip
        )

    # rows 3, 4, 5 are adjacent in HBM, but each indexed row is its own descriptor (24 B)
    run(k, f32((10, 6)), np.array([[3], [4], [5], [0]], np.int32))
    c = nki.last_counters()
    assert c.dma_descriptors == 4 + 4 and c.dma_run_hist == {4: 4, 16: 4}  # 24 B falls in the 16 B bucket
    assert c.dma_run_bytes == 4 * 4 + 4 * 24 and c.dma_run_bytes_min == 4
    assert c.dma_transfer_ns == pytest.approx(engine_ns(4, 4) + engine_ns(4, 24))  # all on engine 0
    # a skipped (out-of-bounds) row moves nothing and has no descriptor
    run(k, f32((10, 6)), np.array([[3], [-1], [4]], np.int32))
    c = nki.last_counters()
    assert c.dma_descriptors == 3 + 2 and c.dma_run_bytes == 3 * 4 + 2 * 24


def test_hbm_to_hbm_and_casting_copies() -> None:
    def k(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x)  # one 4000-byte run, one engine
        return out

    run(k, f32((1000,)))
    c = nki.last_counters()
    assert c.dma_descriptors == 1 and c.dma_time_ns == pytest.approx(FIXED_NS + engine_ns(1, 4000))

    # bf16 HBM -> fp32 SBUF: runs counted in HBM-side bytes (2 per element)
    run(_one_dma((8, 100), nl.float32, lambda x: x), f32((8, 100)).astype(BF16))
    c = nki.last_counters()
    assert c.dma_descriptors == 8 and c.dma_run_hist == {128: 8} and c.dma_run_bytes == 8 * 200


def test_totals_add_up_over_dmas_and_programs() -> None:
    def k(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        p = nl.program_id(0)
        t = nl.ndarray((64, 256), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[p * 64 : (p + 1) * 64, :])  # 64 descriptors of 1 KiB
        nisa.dma_copy(dst=out[p * 64 : (p + 1) * 64, :], src=t)  # 64 more
        return out

    sim = simulate(nki.jit(k)[2], compiler_lnc=2)
    x = f32((128, 256))
    assert np.array_equal(sim(x), x)
    c = sim.counters
    per = 2 * (FIXED_NS + engine_ns(8, 1024))  # 64 partitions -> 8 engines x 8 descriptors, twice
    for p in c.programs:
        assert p.dma_descriptors == 128 and p.dma_time_ns == pytest.approx(per)
    assert c.dma_descriptors == 256 and c.dma_time_ns == pytest.approx(2 * per)
    assert c.dma_run_hist == {1024: 256} and math.isclose(c.dma_mean_run_bytes, 1024)
