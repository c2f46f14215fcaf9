"""The NKI emulator at LNC=2: two programs (program_id 0 and 1) sharing HBM with private SBUF, the launch refused when
the kernel's LNC degree differs from the compiler's (NCC_EVRF066), the cross-core barrier and sendrecv, and counters
per program and in total (docs/nki.md section 1.4)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.emulator_helpers import f32, load
from vllm_trn_plugin.kernels.nki_emu import errors
from vllm_trn_plugin.kernels.nki_shim import nisa, nki, nl, simulate


def run2(fn, *args):
    """Run `fn` as an LNC=2 kernel in an LNC=2 deployment; returns (result, counters)."""
    sim = simulate(nki.jit(fn)[2], compiler_lnc=2)
    out = sim(*args)
    return out, sim.counters


def _ids_kernel(x):
    out = nl.ndarray((2, 3), nl.int32, buffer=nl.shared_hbm)
    row = nl.ndarray((1, 3), nl.int32, buffer=nl.sbuf)
    pid = nl.program_id(0)
    nisa.iota(dst=row[:, 0:1], pattern=[[0, 1]], offset=pid, channel_multiplier=0)
    nisa.iota(dst=row[:, 1:2], pattern=[[0, 1]], offset=nl.num_programs(0), channel_multiplier=0)
    nisa.iota(dst=row[:, 2:3], pattern=[[0, 1]], offset=nl.program_ndim(), channel_multiplier=0)
    nisa.dma_copy(dst=out[pid : pid + 1, :], src=row)
    return out


def test_programs_see_their_id_and_two_programs_and_share_the_output() -> None:
    out, c = run2(_ids_kernel, f32((1, 1)))
    # row p was written by program p only; the output allocated in the kernel is one tensor for both
    assert out.tolist() == [[0, 2, 1], [1, 2, 1]]
    assert c.num_programs == 2 and len(c.programs) == 2
    # LNC=1, bare call: program 0 of 1, no launch grid
    one = simulate(nki.jit(lambda x: _ids_kernel(x)))(f32((1, 1)))
    assert one[0].tolist() == [0, 1, 0] and one[1].tolist() == [4, 4, 4]  # row 1: never written (int poison 4)
    assert nki.last_counters().num_programs == 1


def test_programs_share_input_hbm_and_in_place_writes_land_once() -> None:
    def k(x, acc):
        p = nl.program_id(0)
        half = x.shape[0] // 2
        t = load(x[p * half : (p + 1) * half, :])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=float(p + 2))
        nisa.dma_copy(dst=acc[p * half : (p + 1) * half, :], src=t)  # each program writes its half of an input
        return acc

    x = f32((8, 16))
    acc = np.zeros((8, 16), np.float32)
    out, c = run2(k, x, acc)
    assert out is acc  # the returned input is the caller's array, written in place
    assert np.array_equal(acc[:4], x[:4] * 2) and np.array_equal(acc[4:], x[4:] * 3)
    # per program: one load and one store of a half; the totals are the sums
    half_bytes = 4 * 16 * 4
    for p in (0, 1):
        assert c.programs[p].dma_hbm_to_sbuf_bytes == half_bytes and c.programs[p].dma_sbuf_to_hbm_bytes == half_bytes
        assert c.programs[p].instructions == {"dma_copy": 2, "tensor_scalar": 1}
    assert c.dma_hbm_to_sbuf_bytes == 2 * half_bytes and c.instructions == {"dma_copy": 4, "tensor_scalar": 2}


def test_sbuf_and_accumulator_registers_are_private_per_program() -> None:
    def k(x):
        p = nl.program_id(0)
        out = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        sums = nl.ndarray((2, 1), nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)  # one allocation site, a tile per program
        if p == 0:
            nisa.memset(dst=t, value=7.0)  # program 1 never writes its tile: it must still hold the poison
        nisa.dma_copy(dst=out[p : p + 1, :], src=t)
        # ScalarE's accumulator registers: program 0 sums into them, program 1 only reads its own (never reset: NaN)
        y = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        acc = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        cmd = nisa.reduce_cmd.reset_reduce if p == 0 else nisa.reduce_cmd.idle
        nisa.activation(dst=y, op=nl.copy, data=load(x), reduce_op=nl.add, reduce_res=acc, reduce_cmd=cmd)
        nisa.dma_copy(dst=sums[p : p + 1, :], src=acc)
        return out, sums

    out, c = run2(k, np.ones((1, 4), np.float32))
    out, sums = out
    assert (out[0] == 7).all() and np.isnan(out[1]).all()
    assert sums[0, 0] == 4 and np.isnan(sums[1, 0])
    # each physical core has its own SBUF: the launch reports the larger program, not the sum
    assert c.programs[0].sbuf_bytes_per_partition == c.programs[1].sbuf_bytes_per_partition == 16 * 3 + 4
    assert c.sbuf_bytes_per_partition == 16 * 3 + 4


def test_a_shared_output_is_one_tensor_only_at_one_allocation_site() -> None:
    def k(x):
        p = nl.program_id(0)
        if p == 0:
            out = nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm)
        else:
            out = nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm)  # another site: another tensor
        nisa.dma_copy(dst=out[p : p + 1, :], src=load(x[p : p + 1, :]))
        return out

    with pytest.raises(errors.LncError, match="program 0 returned .* but program 1 returned"):
        run2(k, f32((2, 2)))

    def shape_differs(x):
        out = nl.ndarray((2, 2 + nl.program_id(0)), nl.float32, buffer=nl.shared_hbm)
        return out

    with pytest.raises(errors.LncError, match="one tensor for every program"):
        run2(shape_differs, f32((2, 2)))


# ---- the two LNC degrees (NCC_EVRF066) ----------------------------------------------------------------------------
def _store_ids(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    if nl.program_id(0) == 0:
        nisa.dma_copy(dst=out, src=load(x))
    return out


def test_launch_refused_when_kernel_and_compiler_lnc_differ(monkeypatch) -> None:
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    x = f32((2, 2))
    k = nki.jit(_store_ids)
    # kernel[2] in an LNC=1 deployment (the emulator's default compiler degree) and a bare kernel (LNC=1) in an LNC=2
    # deployment: both refused, naming both degrees as neuronx-cc does
    with pytest.raises(errors.LncError, match=r"NCC_EVRF066.*'_store_ids' is configured with LNC=2, .*using LNC=1"):
        simulate(k[2])(x)
    with pytest.raises(errors.LncError, match=r"NCC_EVRF066.*configured with LNC=1, but neuronx-cc is using LNC=2"):
        simulate(k, compiler_lnc=2)(x)
    with pytest.raises(errors.LncError, match="configured with LNC=1, but neuronx-cc is using LNC=2"):
        simulate(k[1], compiler_lnc=2)(x)
    # NEURON_LOGICAL_NC_CONFIG sets both the kernel's degree and the compiler's [EVRF066 resolution]
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert np.array_equal(simulate(k)(x), x) and nki.last_counters().num_programs == 2
    # ... unless NEURON_CC_FLAGS overrides the compiler's --lnc (EVRF066's third cause)
    monkeypatch.setenv("NEURON_CC_FLAGS", "--target=trn2 --lnc=1")
    with pytest.raises(errors.LncError, match="configured with LNC=2, but neuronx-cc is using LNC=1"):
        simulate(k)(x)
    monkeypatch.delenv("NEURON_CC_FLAGS")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "4")
    with pytest.raises(errors.LncError, match="LNC degree 4 is not supported"):
        simulate(k)(x)
    with pytest.raises(errors.LncError, match="LNC degree 8 is not supported"):
        k[8]


# ---- cross-core operations ---------------------------------------------------------------------------------------
def _exchange_through_hbm(with_barrier: bool):
    def k(x):
        p = nl.program_id(0)
        buf = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm)
        out = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm)
        t = load(x[p : p + 1, :])
        nisa.dma_copy(dst=buf[p : p + 1, :], src=t)  # each core writes its row of the shared buffer
        if with_barrier:
            nisa.core_barrier(buf, (0, 1))
        other = load(buf[1 - p : 2 - p, :])  # ... and reads the other core's row
        nisa.dma_copy(dst=out[p : p + 1, :], src=other)
        return out

    return k


def test_core_barrier_makes_the_other_cores_writes_visible() -> None:
    x = f32((2, 8))
    out, c = run2(_exchange_through_hbm(True), x)
    assert np.array_equal(out, x[::-1])
    assert c.programs[0].instructions["core_barrier"] == c.programs[1].instructions["core_barrier"] == 1
    # without the barrier program 0 runs to its end first and reads a row nobody has written yet
    out, _ = run2(_exchange_through_hbm(False), x)
    assert np.isnan(out[0]).all() and np.array_equal(out[1], x[0])


def test_sendrecv_swaps_tiles_between_the_cores() -> None:
    def k(x):
        p = nl.program_id(0)
        out = nl.ndarray((2, 4, 8), nl.float32, buffer=nl.shared_hbm)
        mine = load(x[p])
        theirs = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - p, recv_from_rank=1 - p, pipe_id=0)
        nisa.dma_copy(dst=out[p], src=theirs)
        return out

    x = f32((2, 4, 8))
    out, c = run2(k, x)
    assert np.array_equal(out[0], x[1]) and np.array_equal(out[1], x[0])
    assert c.programs[0].dma_sbuf_to_sbuf_bytes == 4 * 8 * 4 and c.instructions["sendrecv"] == 2


def test_a_cross_core_operation_the_other_program_never_reaches_is_an_error() -> None:
    def k(x):
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        if nl.program_id(0) == 0:
            nisa.core_barrier(out, (0, 1))
        return out

    with pytest.raises(errors.LncError, match=r"program 0 waits at core_barrier #1; program 1 returned after no"):
        run2(k, f32((1, 1)))

    def one_core(x):
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        nisa.core_barrier(out, (0, 1))
        return out

    with pytest.raises(errors.LncError, match="LNC=1"):
        simulate(nki.jit(one_core))(f32((1, 1)))


def test_an_error_in_one_program_is_raised_and_the_other_unwinds() -> None:
    def k(x):
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        if nl.program_id(0) == 1:
            nl.ndarray((256, 1), nl.float32, buffer=nl.sbuf)  # > 128 partitions
        nisa.core_barrier(out, (0, 1))
        return out

    with pytest.raises(errors.PartitionLimitError):
        run2(k, f32((1, 1)))
    # the emulator is usable afterwards
    out, _ = run2(_exchange_through_hbm(True), f32((2, 8)))
    assert out.shape == (2, 8)
