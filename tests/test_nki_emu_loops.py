"""The NKI emulator's loops: instructions emitted (the compiled program) against instructions executed for Python
loops, the deprecated nl.*_range aliases of range, nl.fori_loop and fori_loop(unroll=True); the check that every
iteration of a compiled loop emits the same instructions; zero-trip loops traced without running (docs/nki.md
section 8). Every expected count is worked out by hand from the kernel text."""

from __future__ import annotations

import numpy as np
import pytest

from tests.emulator_helpers import f32, load, run, store
from vllm_trn_plugin.kernels.nki_emu import errors
from vllm_trn_plugin.kernels.nki_shim import nisa, nki, nl, simulate

BODY = 2  # instructions per iteration of the loop bodies below: one tensor_scalar, one tensor_copy


def _looped(loop: str, n: int):
    def k(x):
        t = load(x)  # 1 dma_copy
        u = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)

        def body(i):
            nisa.tensor_scalar(dst=u, data=t, op0=nl.multiply, operand0=2.0)
            nisa.tensor_copy(dst=t, src=u)

        if loop == "range":
            for i in range(n):
                body(i)
        elif loop in ("affine_range", "sequential_range", "static_range"):
            for i in getattr(nl, loop)(n):
                body(i)
        elif loop == "fori_loop":
            nl.fori_loop(0, n, body)
        elif loop == "fori_unroll":
            nl.fori_loop(0, n, body, unroll=True)
        return store(t)  # 1 dma_copy

    return k


@pytest.mark.parametrize("loop", ["range", "affine_range", "sequential_range", "static_range"])
def test_python_loops_emit_their_body_every_iteration(loop: str) -> None:
    x = f32((4, 8))
    for n in (3, 7):
        out = run(_looped(loop, n), x)
        assert np.allclose(out, x * 2.0**n)
        c = nki.last_counters()
        assert c.executed_instructions == 2 + BODY * n
        assert c.emitted_instructions == 2 + BODY * n  # unrolled at specialization (NKI 0.7+: all are range)
        assert c.emitted == {"dma_copy": 2, "tensor_scalar": n, "tensor_copy": n}


def test_fori_loop_emits_its_body_once_whatever_the_trip_count() -> None:
    x = f32((4, 8))
    for n in (3, 7, 40):
        out = run(_looped("fori_loop", n), x)
        assert np.allclose(out, x * 2.0**n)  # every iteration still runs
        c = nki.last_counters()
        assert c.executed_instructions == 2 + BODY * n + 1  # + the loop entered once
        assert c.emitted_instructions == 2 + BODY + 1  # the body once, the loop instruction once
        assert c.emitted == {"dma_copy": 2, "tensor_scalar": 1, "tensor_copy": 1, "fori_loop": 1}


def test_fori_loop_unroll_emits_the_body_per_iteration_without_a_loop() -> None:
    x = f32((4, 8))
    out = run(_looped("fori_unroll", 5), x)
    assert np.allclose(out, x * 32.0)
    c = nki.last_counters()
    assert c.emitted_instructions == 2 + BODY * 5 and "fori_loop" not in c.emitted

    def reg_bound(x):
        nl.fori_loop(0, nisa.register_alloc(3), lambda i: None, unroll=True)

    with pytest.raises(errors.NkiValidationError, match="compile-time ints"):
        run(reg_bound, x)


def test_nested_loops_count_each_level() -> None:
    def k(x):
        t = load(x)  # 1

        def inner(j):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)  # 1 per inner iteration

        def outer(i):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=1.0)  # 1 per outer iteration
            nl.fori_loop(0, 4, inner)

        for _ in range(2):  # Python loop: two copies of the compiled outer loop
            nl.fori_loop(0, 3, outer)
        return store(t)  # 1

    x = f32((2, 4))
    out = run(k, x)
    assert np.allclose(out, x + 24)
    c = nki.last_counters()
    # executed: 2 DMAs + 2 x (3 x (1 + 4)) ALU + loops entered: 2 outer + 2 x 3 inner
    assert c.executed_instructions == 2 + 30 + 8
    # emitted: 2 DMAs + 2 copies of [outer loop + its 1 instruction + inner loop + its 1 instruction]
    assert c.emitted_instructions == 2 + 2 * 4
    assert c.emitted == {"dma_copy": 2, "tensor_scalar": 4, "fori_loop": 4}


def test_zero_trip_loop_is_compiled_but_moves_nothing() -> None:
    def k(x, n, acc):
        nt = load(n, nl.int32)
        trips = nisa.register_alloc(nt[0:1, 0:1])  # 1 register_alloc
        t = load(x)  # 1 dma_copy

        def body(i):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)  # an SBUF write
            nisa.dma_copy(dst=acc, src=t)  # an HBM write to the caller's array

        nl.fori_loop(0, trips, body)
        return store(t)  # 1 dma_copy

    x = f32((2, 4))
    for trips in (0, 1):
        acc = np.zeros((2, 4), np.float32)
        out = run(k, x, np.array([trips], np.int32), acc)
        c = nki.last_counters()
        # the traced-only body wrote nothing: neither the tile nor the caller's array
        assert np.array_equal(out, x + trips)
        assert np.array_equal(acc, (x + 1) if trips else np.zeros_like(x))
        # executed: the n load, register_alloc, the x load, the loop, the store, and 2 body instructions per trip
        assert c.executed_instructions == 5 + 2 * trips
        # emitted: the same program whatever the run-time trip count
        assert c.emitted == {"dma_copy": 4, "register_alloc": 1, "tensor_scalar": 1, "fori_loop": 1}
        assert c.dma_bytes == 4 + 2 * (2 * 4 * 4) + trips * (2 * 4 * 4)


def test_a_compiled_loop_body_must_emit_the_same_instructions_every_iteration() -> None:
    def k(x):
        t = load(x)
        seen = []

        def body(i):
            seen.append(1)  # Python state that changes per iteration: the compiler would see iteration 0 only
            if len(seen) % 2 == 0:
                nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
            else:
                nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)

        nl.fori_loop(0, 4, body)
        return store(t)

    with pytest.raises(errors.LoopBodyError, match=r"iteration 1 emits 1 instructions.*tensor_scalar at test_nki_emu"):
        run(k, f32((2, 2)))

    def extra(x):
        t = load(x)
        n = [0]

        def body(i):
            n[0] += 1
            for _ in range(n[0]):  # a body whose length grows
                nisa.tensor_copy(dst=t, src=t)

        nl.fori_loop(0, 3, body)

    with pytest.raises(errors.LoopBodyError, match="iteration 1 emits 2 instructions, iteration 0 emitted 1"):
        run(extra, f32((2, 2)))

    def on_index(x):
        def body(i):
            if i:  # the index is a run-time register, not a Python value
                pass

        nl.fori_loop(0, 2, body)

    with pytest.raises(errors.RegisterError, match="truth value"):
        run(on_index, f32((2, 2)))


def test_data_driven_bodies_are_fine() -> None:
    def k(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)

        def body(i):  # the same instructions every iteration; the index only addresses data
            t = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x.ap([[x.shape[1], 1], [1, x.shape[1]]], scalar_offset=i, indirect_dim=0))
            nisa.dma_copy(dst=out.ap([[x.shape[1], 1], [1, x.shape[1]]], scalar_offset=i, indirect_dim=0), src=t)

        nl.fori_loop(0, x.shape[0], body)
        return out

    x = f32((6, 5))
    assert np.array_equal(run(k, x), x)
    c = nki.last_counters()
    assert c.emitted == {"dma_copy": 2, "fori_loop": 1} and c.instructions == {"dma_copy": 12, "fori_loop": 1}


def test_counts_per_program_at_lnc2() -> None:
    def k(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        p = nl.program_id(0)
        t = load(x[p : p + 1, :])  # 1
        if p == 0:  # program-specific Python code is specialization: program 0's program has one more instruction
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=0.0)
        nl.fori_loop(0, 5, lambda i: nisa.tensor_copy(dst=t, src=t))  # loop + 1
        nisa.dma_copy(dst=out[p : p + 1, :], src=t)  # 1
        return out

    sim = simulate(nki.jit(k)[2], compiler_lnc=2)
    x = f32((2, 3))
    assert np.array_equal(sim(x), x)
    c = sim.counters
    assert [p.emitted_instructions for p in c.programs] == [5, 4]
    assert [p.executed_instructions for p in c.programs] == [9, 8]
    assert c.emitted_instructions == 9 and c.executed_instructions == 17
