"""The GLA decode-step NKI kernel (kernels/simple_gla_nki.py), run in the NKI emulator.

References, each independent of the kernel:
- the op's definition `simple_gla_decode_step` (kernels/simple_gla.py, also the model's torch path),
  run on a copy of the same pool;
- a float64 statement of the spec (models.md section 2), written here, with
  lambda_h = 2^(-1/T_h), T_h geometric in [1, 2048], computed in float64:
      S <- lambda_h S + k v^T ;  o = scale q^T S + sigmoid(sum_c q_c a_h,c k_c) v.

Contracts checked (the kernel's numerics contract: docs/kernels.md, section
'GLA decode kernel (`kernels/simple_gla_nki.py`): design'):
- new states bit-exact vs the torch reference (same fp32 operations);
- o vs the torch reference: fp32 outputs within 1e-6 (normwise, fp32 sums in another order),
  bf16 outputs within one bf16 ulp (plus that 1e-6);
- vs float64: 1e-5 for fp32 outputs and states (as tests/test_simple_gla.py: fp32 roundoff with
  >= 10x margin), 1e-2 for bf16 outputs (bf16 unit roundoff 2^-8), the fp32 state keeping 1e-5;
- every batch size 1..32 gives each row the bits of its single-sequence run;
- the state write lands in the caller's tensor, also through a vLLM state-page view;
- padding rows (-1): their output is +0.0, no slot they could reach changes (NaN sentinels
  kept bit for bit), even when their q, k, v are NaN/inf;
- the emulator's counters equal `gla_decode_cost`.
Tolerance helper: |actual - ref| <= tol * |ref| + tol * max|ref|, elementwise, in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.emulator_helpers import assert_counters_equal_cost, lnc2
from vllm_trn_plugin.kernels import nki_emu
from vllm_trn_plugin.kernels.nki_shim import nki, simulate
from vllm_trn_plugin.kernels.simple_gla import geometric_log_decay, simple_gla_decode_step
from vllm_trn_plugin.kernels.simple_gla_nki import gla_decode_cost, gla_decode_nki, state_rows

FP32_TOL = 1e-5
BF16_OUT_TOL = 1e-2
VS_TORCH_TOL = 1e-6
T_MIN, T_MAX = 1.0, 2048.0
REAL = (16, 96, 192)  # Laplace 3B: H, dk, dv


# --------------------------------------------------------------------------- helpers


def assert_close(actual: torch.Tensor, ref: torch.Tensor, tol: float, what: str, rel: float | None = None) -> None:
    """|actual - ref| <= rel * |ref| + tol * max|ref| elementwise (rel defaults to tol)."""
    rel = tol if rel is None else rel
    assert actual.shape == ref.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(ref.shape)}"
    a, r = actual.double(), ref.double()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    scale = r.abs().max().item() if r.numel() else 0.0
    err = (a - r).abs()
    bad = err > rel * r.abs() + tol * scale
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} out of tolerance; max|err|={err.max().item():.3e}, "
        f"max|ref|={scale:.3e}"
    )


def assert_o_matches_torch(o: torch.Tensor, o_ref: torch.Tensor, what: str) -> None:
    # bf16: the two fp32 values may round to neighbouring bf16 numbers (one ulp <= 2^-7 |x|).
    rel = 2.0**-7 if o.dtype == torch.bfloat16 else VS_TORCH_TOL
    assert o.dtype == o_ref.dtype
    assert_close(o, o_ref, VS_TORCH_TOL, what, rel=rel)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view({4: torch.int32, 2: torch.int16}[x.element_size()]).clone()


def lam64(H: int) -> torch.Tensor:
    h = torch.arange(H, dtype=torch.float64)
    T = T_MIN * (T_MAX / T_MIN) ** (h / max(H - 1, 1))
    return 2.0 ** (-1.0 / T)


def ref64(q, k, v, aug, scale, S0):  # noqa: ANN001, ANN202
    """Spec step in float64: q, k [B, H, dk], v [B, H, dv], S0 [B, H, dk, dv] -> (o, S)."""
    q, k, v, aug, S0 = (x.double() for x in (q, k, v, aug, S0))
    lam = lam64(q.shape[1])[None, :, None, None]
    S = lam * S0 + k[..., :, None] * v[..., None, :]
    gate = torch.sigmoid((q * aug * k).sum(-1, keepdim=True))
    o = scale * (q[..., :, None] * S).sum(-2) + gate * v
    return o, S


def make_case(B, H, dk, dv, num_slots, dtype, seed):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, dk, generator=g) * 0.5).to(dtype)
    k = (torch.randn(B, H, dk, generator=g) * 0.5).to(dtype)
    v = torch.randn(B, H, dv, generator=g).to(dtype)
    aug = (torch.randn(H, dk, generator=g) * 0.3).to(dtype)
    pool = torch.randn(num_slots, H, dk, dv, generator=g)
    return q, k, v, aug, pool


def run_both(q, k, v, aug, pool, slots, scale):  # noqa: ANN001, ANN202
    """(o_kernel, pool after the kernel, o_reference, pool after the reference) from one pool."""
    log_decay = geometric_log_decay(q.shape[1], T_MIN, T_MAX)
    pool_k, pool_r = pool.clone(), pool.clone()
    o_k = gla_decode_nki(q, k, v, aug, log_decay, scale, pool_k, slots, simulate)
    o_r = simple_gla_decode_step(q, k, v, aug, log_decay, scale, pool_r, slots)
    return o_k, pool_k, o_r, pool_r


# --------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "B,H,dk,dv",
    [(3, 2, 8, 16), (5, 4, 32, 48), (3, 40, 16, 8), pytest.param(9, *REAL, id="real-B9")],
)
def test_matches_reference_and_float64(B, H, dk, dv, dtype):
    num_slots = B + 3
    q, k, v, aug, pool = make_case(B, H, dk, dv, num_slots, dtype, seed=B * 1000 + H + dk)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(B))[:B]
    slots[1] = -1  # one padding row in every case
    scale = dk**-0.5
    o_k, pool_k, o_r, pool_r = run_both(q, k, v, aug, pool, slots, scale)

    assert o_k.dtype == dtype and o_k.shape == (B, H, dv)
    assert torch.equal(bits(pool_k), bits(pool_r)), "new states differ from the torch reference"
    assert_o_matches_torch(o_k, o_r, "o vs torch reference")

    real = slots >= 0
    o64, S64 = ref64(q[real], k[real], v[real], aug, scale, pool[slots[real]])
    assert_close(o_k[real], o64, FP32_TOL if dtype == torch.float32 else BF16_OUT_TOL, "o vs float64")
    assert_close(pool_k[slots[real]], S64, FP32_TOL, "S vs float64")
    assert torch.equal(bits(o_k[~real]), torch.zeros_like(bits(o_k[~real]))), "padding output is not +0.0"


# --------------------------------------------------------------------------- batch invariance


def test_every_batch_size_equals_single_sequence_runs():
    """Batch sizes 1..32 with H = 16 as in Laplace (8 sequences per group, so 1..4 groups, full
    and partial; dk, dv reduced to keep the 64 calls quick): each row's output and new state have
    the bits of the same row run alone."""
    H, dk, dv, n, num_slots = 16, 32, 64, 32, 40
    q, k, v, aug, pool = make_case(n, H, dk, dv, num_slots, torch.bfloat16, seed=77)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(5))[:n]
    slots[[3, 8, 17, 31]] = -1
    log_decay, scale = geometric_log_decay(H, T_MIN, T_MAX), dk**-0.5

    def run(rows: slice, p: torch.Tensor) -> torch.Tensor:
        return gla_decode_nki(q[rows], k[rows], v[rows], aug, log_decay, scale, p, slots[rows], simulate)

    single_o, single_pool = [], pool.clone()
    for b in range(n):
        p = pool.clone()
        single_o.append(run(slice(b, b + 1), p)[0])
        if slots[b] >= 0:
            single_pool[slots[b]] = p[slots[b]]
    single_o = torch.stack(single_o)

    for B in range(1, n + 1):
        p = pool.clone()
        o = run(slice(0, B), p)
        assert torch.equal(bits(o), bits(single_o[:B])), f"B={B}: outputs differ from single-sequence runs"
        expect = pool.clone()
        touched = slots[:B][slots[:B] >= 0]
        expect[touched] = single_pool[touched]
        assert torch.equal(bits(p), bits(expect)), f"B={B}: pool differs from single-sequence runs"


# --------------------------------------------------------------------------- in-place state


def test_state_write_lands_in_callers_tensor():
    B, (H, dk, dv) = 4, REAL
    q, k, v, aug, pool = make_case(B, H, dk, dv, 6, torch.bfloat16, seed=11)
    slots = torch.tensor([4, 0, -1, 2])
    expect = pool.clone()
    log_decay, scale = geometric_log_decay(H, T_MIN, T_MAX), dk**-0.5
    simple_gla_decode_step(q, k, v, aug, log_decay, scale, expect, slots)
    ptr, before = pool.data_ptr(), pool.clone()
    gla_decode_nki(q, k, v, aug, log_decay, scale, pool, slots, simulate)
    assert pool.data_ptr() == ptr
    assert torch.equal(bits(pool), bits(expect))
    assert not torch.equal(pool[[4, 0, 2]], before[[4, 0, 2]]), "state pool unchanged"


def test_state_write_through_vllm_state_page_view():
    """vLLM keeps each sequence's GLA state and conv window in one page, all layers' pools in one
    buffer; a layer's pool is a strided view (vLLM 0.32's layout on the demo model: shape
    [slots, H, dk, dv], slot stride = page, storage offset = layer * slots * page). The kernel must
    update that view in place and leave the conv windows and the other layer alone."""
    B, H, dk, dv = 3, 4, 16, 24
    num_slots, gla = 5, H * dk * dv
    page = gla + 3 * 40  # fp32 elements per page: the GLA state, then the conv window
    q, k, v, aug, _ = make_case(B, H, dk, dv, num_slots, torch.bfloat16, seed=12)
    raw = torch.randn(2, num_slots, page)  # two layers
    raw[:, :, gla:] = float("nan")  # sentinel in every conv window
    pool = raw[1, :, :gla].view(num_slots, H, dk, dv)  # layer 1
    assert pool.stride() == (page, dk * dv, dv, 1) and pool.storage_offset() == num_slots * page
    assert state_rows(pool).data_ptr() == raw[1].data_ptr()
    slots = torch.tensor([3, -1, 0])
    raw_before = raw.clone()
    expect = pool.clone()
    log_decay, scale = geometric_log_decay(H, T_MIN, T_MAX), dk**-0.5
    simple_gla_decode_step(q, k, v, aug, log_decay, scale, expect, slots)
    gla_decode_nki(q, k, v, aug, log_decay, scale, pool, slots, simulate)
    assert torch.equal(bits(pool), bits(expect))
    assert not torch.equal(pool[[3, 0]], raw_before[1, [3, 0], :gla].view(2, H, dk, dv)), "state pool unchanged"
    assert torch.equal(bits(raw[:, :, gla:]), bits(raw_before[:, :, gla:])), "conv windows changed"
    assert torch.equal(bits(raw[0]), bits(raw_before[0])), "the other layer changed"


# --------------------------------------------------------------------------- padding


def test_padding_rows_untouched():
    B, H, dk, dv = 6, 4, 16, 24
    num_slots = 8
    q, k, v, aug, pool = make_case(B, H, dk, dv, num_slots, torch.float32, seed=13)
    slots = torch.tensor([-1, 5, -1, 2, -1, -1])
    # Unused slots hold sentinels: NaN, a NaN with a payload, -0.0, inf; padding inputs are garbage.
    pool[[0, 7]] = float("nan")
    pool[1].view(torch.int32).fill_(0x7FC01234)
    pool[3] = -0.0
    pool[4] = float("inf")
    pool[6] = 123.0
    for x in (q, k, v):
        x[slots < 0] = float("nan")
    q[2, 0, 0] = float("inf")
    o_k, pool_k, o_r, pool_r = run_both(q, k, v, aug, pool, slots, dk**-0.5)
    assert torch.equal(bits(pool_k), bits(pool_r))
    unused = [s for s in range(num_slots) if s not in (2, 5)]
    assert torch.equal(bits(pool_k[unused]), bits(pool[unused])), "an unused slot changed"
    assert torch.equal(bits(o_k[slots < 0]), torch.zeros_like(bits(o_k[slots < 0]))), "padding output not +0.0"
    assert_o_matches_torch(o_k[slots >= 0], o_r[slots >= 0], "real rows")


def test_all_padding_changes_nothing():
    B, H, dk, dv = 3, 2, 8, 16
    q, k, v, aug, pool = make_case(B, H, dk, dv, 4, torch.bfloat16, seed=14)
    before = pool.clone()
    o = gla_decode_nki(q, k, v, aug, geometric_log_decay(H, T_MIN, T_MAX), 0.3, pool, torch.full((B,), -1), simulate)
    assert torch.equal(bits(pool), bits(before))
    assert torch.equal(bits(o), torch.zeros_like(bits(o)))


# --------------------------------------------------------------------------- several steps


def test_repeated_steps_follow_the_recurrence():
    """Six decode steps in a row at the Laplace geometry (bf16 activations), rows changing slots
    and padding between steps: every step bit-equal to the torch path in S, and the whole run
    within fp32/bf16 tolerance of the float64 per-token recurrence."""
    (H, dk, dv), num_slots, steps = REAL, 5, 6
    schedule = [[1, 3, -1], [1, 3, 4], [-1, 3, 4], [1, -1, 4], [1, 3, 4], [4, 1, 3]]
    g = torch.Generator().manual_seed(21)
    pool = torch.zeros(num_slots, H, dk, dv)
    pool[0] = float("nan")  # never used
    pool_ref, S64 = pool.clone(), pool.double().clone()
    aug = (torch.randn(H, dk, generator=g) * 0.3).to(torch.bfloat16)
    log_decay, scale = geometric_log_decay(H, T_MIN, T_MAX), dk**-0.5
    for t in range(steps):
        slots = torch.tensor(schedule[t])
        B = len(slots)
        q = (torch.randn(B, H, dk, generator=g) * 0.5).to(torch.bfloat16)
        k = (torch.randn(B, H, dk, generator=g) * 0.5).to(torch.bfloat16)
        v = torch.randn(B, H, dv, generator=g).to(torch.bfloat16)
        o = gla_decode_nki(q, k, v, aug, log_decay, scale, pool, slots, simulate)
        o_r = simple_gla_decode_step(q, k, v, aug, log_decay, scale, pool_ref, slots)
        assert torch.equal(bits(pool), bits(pool_ref)), f"step {t}: state differs from the torch path"
        assert_o_matches_torch(o, o_r, f"step {t} o")
        real = slots >= 0
        o64, S_new = ref64(q[real], k[real], v[real], aug, scale, S64[slots[real]])
        S64[slots[real]] = S_new
        assert_close(o[real], o64, BF16_OUT_TOL, f"step {t} o vs float64")
        assert_close(pool[slots[real]], S_new, FP32_TOL, f"step {t} S vs float64")
    assert torch.isnan(pool[0]).all()


# --------------------------------------------------------------------------- cost


@pytest.mark.parametrize("lnc", [1, 2])
def test_counters_match_cost_formula(lnc):
    """Every counter of each program (bytes, descriptors, DMA times, instructions) equals `gla_decode_cost`'s; the
    padding rows' state is never read nor written (their q, k, v neither), so the state traffic is 2 R slot states."""
    (H, dk, dv), B = REAL, 10
    q, k, v, aug, pool = make_case(B, H, dk, dv, 12, torch.bfloat16, seed=15)
    aug = aug.float()
    slots = torch.tensor([0, 1, -1, 3, 4, 5, 6, -1, 8, 9])
    runner = simulate if lnc == 1 else lnc2
    gla_decode_nki(q, k, v, aug, geometric_log_decay(H, T_MIN, T_MAX), dk**-0.5, pool, slots, runner)
    c = nki.last_counters()
    cost = gla_decode_cost(B, H, dk, dv, in_bytes=2, aug_bytes=4, num_padding=2, lnc=lnc)
    assert_counters_equal_cost(c, cost)
    # Laplace shape, B = 32: the kernel's traffic is within 1 % of the analytic minimum.
    full = gla_decode_cost(32)
    assert full["dma_bytes"] <= 1.01 * full["dma_min_bytes"]
    assert math.isclose(full["dma_state_bytes"], 2 * 32 * 16 * 96 * 192 * 4)


# --------------------------------------------------------------------------- LNC=2, compiled loops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,H,dk,dv", [(3, *REAL), (5, 4, 32, 48), (1, 2, 8, 16)], ids=["real-B3", "B5", "B1"])
def test_lnc2_is_bit_identical_to_lnc1(B, H, dk, dv, dtype):
    """At LNC=2 each program updates half of the heads of every row (one head group, `head_groups`); every output bit
    and every bit of the pool (updated slots, untouched ones, padding rows') equals the LNC=1 launch's, which runs
    the same two groups one after the other. Catches a program that takes the other's heads (a wrong first head), a
    group size that depends on the LNC degree (then q^T S sums in another order) and a missed or repeated head."""
    q, k, v, aug, pool = make_case(B, H, dk, dv, B + 3, dtype, seed=B * 7 + H)
    slots = torch.randperm(B + 3, generator=torch.Generator().manual_seed(B))[:B]
    if B > 2:
        slots[1] = -1
    log_decay, scale = geometric_log_decay(H, T_MIN, T_MAX), dk**-0.5
    p1, p2 = pool.clone(), pool.clone()
    o1 = gla_decode_nki(q, k, v, aug, log_decay, scale, p1, slots, simulate)
    o2 = gla_decode_nki(q, k, v, aug, log_decay, scale, p2, slots, lnc2)
    c = nki.last_counters()
    assert torch.equal(bits(o1), bits(o2)) and torch.equal(bits(p1), bits(p2))
    ref = pool.clone()
    o_r = simple_gla_decode_step(q, k, v, aug, log_decay, scale, ref, slots)
    assert torch.equal(bits(p2), bits(ref))
    assert_o_matches_torch(o2, o_r, "LNC=2 o vs torch reference")
    cost = gla_decode_cost(B, H, dk, dv, in_bytes=dtype.itemsize, aug_bytes=dtype.itemsize,
                           num_padding=int((slots < 0).sum()), lnc=2)  # fmt: skip
    assert_counters_equal_cost(c, cost)


EMITTED_CAP = 100  # the project's cap (docstring of test_compiled_program_does_not_grow_with_the_batch)


def test_compiled_program_does_not_grow_with_the_batch():
    """The emitted (compiled) instructions per program are the same for every batch width (the rows are a
    `nl.fori_loop`, a padding row's work a zero-trip one): before, the sequences were a Python loop, one body per
    row. Cap: 100 per program, the project's choice: 66 at LNC=1 and 40 at LNC=2 at Laplace's geometry (16 + J per
    head group, two groups per program at LNC=1); an unrolled row loop exceeds it from B = 2. Prints the counts."""
    H, dk, dv = REAL
    seen = {}
    for B in (1, 2, 7, 32):
        q, k, v, aug, pool = make_case(B, H, dk, dv, B + 1, torch.bfloat16, seed=B)
        slots = torch.arange(B) - int(B > 1)  # row 0 padding when B > 1
        for lnc, runner in ((1, simulate), (2, lnc2)):
            gla_decode_nki(q, k, v, aug, geometric_log_decay(H, T_MIN, T_MAX), dk**-0.5, pool, slots, runner)
            c = nki.last_counters()
            seen[(B, lnc)] = [p.emitted_instructions for p in c.programs]
            assert seen[(B, lnc)][0] == gla_decode_cost(B, H, dk, dv, lnc=lnc)["programs"][0]["emitted_instructions"]
    print(f"\nGLA step, emitted instructions per program by (B, LNC): {seen}")
    for lnc in (1, 2):
        counts = {n for (_, d), per in seen.items() if d == lnc for n in per}
        assert len(counts) == 1 and counts.pop() <= EMITTED_CAP, seen


# --------------------------------------------------------------------------- numerics the device may have

# The ScalarE polynomials' error and TensorE's fp32 product precision are undocumented (docs/nki.md section 7.1;
# kernels/nki_emu/ops.py): the project assumes sigmoid within ACT_ERR relative and fp32 TensorE operands at worst
# rounded to bf16 (or tf32), the emulator's models of them.
ACT_ERR = 2.0**-10
OPERAND_ROUNDING = {"tf32": 2.0**-11, "bf16": 2.0**-8}


@pytest.mark.parametrize("operands", ["tf32", "bf16"])
def test_tolerance_holds_under_device_numerics(operands):
    """At Laplace's geometry with bf16 activations, sigmoid off by up to ACT_ERR and fp32 TensorE operands rounded to
    `operands` (unit roundoff u): the new states stay bit-exact against the torch path (their arithmetic is VectorE
    fp32, and the PE's copy of v onto the state's partitions multiplies bf16 values by 1.0, exact at any operand
    width), and o stays within 4 u + 4 ACT_ERR + 2^-8 (its bf16 rounding) of max |o| per row against float64: the
    first-order error of q^T S with S rounded as an operand (u |q|^T |S|, normwise) and of the gate (ACT_ERR |g v|,
    and the logit's sum u sum |q a k|). Measured errors are printed with -s. Catches a state update moved onto an
    engine whose arithmetic the precision model changes, and an output error beyond the model's."""
    (H, dk, dv), B = REAL, 4
    q, k, v, aug, pool = make_case(B, H, dk, dv, 6, torch.bfloat16, seed=31)
    slots = torch.tensor([4, -1, 0, 2])
    log_decay, scale = geometric_log_decay(H, T_MIN, T_MAX), dk**-0.5
    ref_pool = pool.clone()
    simple_gla_decode_step(q, k, v, aug, log_decay, scale, ref_pool, slots)

    p = pool.clone()
    with nki_emu.numerics(activation_rel_error=ACT_ERR, fp32_matmul=operands):
        o = gla_decode_nki(q, k, v, aug, log_decay, scale, p, slots, simulate)
    assert torch.equal(bits(p), bits(ref_pool))
    real = slots >= 0
    o64, _ = ref64(q[real], k[real], v[real], aug, scale, pool[slots[real]])
    err = (o[real].double() - o64).abs().amax(dim=(1, 2)) / o64.abs().amax(dim=(1, 2))
    tol = 4 * OPERAND_ROUNDING[operands] + 4 * ACT_ERR + 2.0**-8
    assert (err <= tol).all(), err
    assert torch.equal(bits(o[~real]), torch.zeros_like(bits(o[~real])))
    print(
        f"\nGLA step, {operands} operands: normwise o error {[f'{e:.1e}' for e in err.tolist()]} (tolerance {tol:.1e})"
    )
