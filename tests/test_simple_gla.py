"""Simple GLA kernels (kernels/simple_gla.py) against independent references.

References, all written here and never taken from the code under test:
- a float64 per-token recurrence of the spec equations (models.md section 2):
      S_t = lambda_h S_{t-1} + k_t v_t^T
      o_t = scale * q_t^T S_t + sigmoid(sum_c q_c a_h,c k_c) * v_t
  with lambda_h = 2^(-1/T_h), T_h = t_min (t_max/t_min)^(h/(H-1)), computed in float64 here;
- fla's `naive_recurrent_simple_gla` (fla-core, a test dependency) for the GLA core;
- a depthwise `F.conv1d` over the zero-left-padded full sequence, then SiLU, for the conv.

Tolerances (elementwise: |actual - ref| <= rtol * |ref| + atol_frac * max|ref|):
- fp32 inputs vs float64 reference: rtol = atol_frac = 1e-5 for outputs and states (fp32 roundoff);
- bf16 inputs (reference run on the same bf16-rounded inputs in float64): outputs, which are
  rounded to bf16, rtol = atol_frac = 1e-2 (bf16 unit roundoff 2^-8 ~ 3.9e-3); the fp32 final
  state keeps the fp32 bound;
- vs fla: rtol = atol_frac = 1e-4. fla's naive recurrence is itself a sequential fp32 loop whose
  rounding grows with length (test_fla_agrees_with_float64_recurrence bounds it against float64),
  so this bound is set by fla, not the kernel;
- batch invariance and split-vs-whole prefill (fp32 vs fp32): rtol = atol_frac = 1e-6.
The errors measured against these bounds are in docs/kernels.md.
Cost (a step of many prompts costs what its tokens cost) is checked by counting what the aten
ops create (`OpOutputSizes`, a TorchDispatchMode), never by timing.
Set GLA_TEST_REPORT=1 and run with -s to print every measured error (and the proportionality test's sizes).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.references.simple_gla import ref_conv_silu, ref_conv_state, ref_lambda, ref_packed, ref_recurrence
from vllm_trn_plugin.kernels.causal_conv1d import (
    causal_conv1d_prefill,
    causal_conv1d_prefill_padded,
    causal_conv1d_step,
)
from vllm_trn_plugin.kernels.simple_gla import (
    geometric_log_decay,
    simple_gla_advance,
    simple_gla_chunked_prefill,
    simple_gla_decode_step,
    simple_gla_prefill_padded,
    simple_gla_verify,
)

FP32_TOL = 1e-5
BF16_OUT_TOL = 1e-2
FLA_TOL = 1e-4
INVARIANCE_TOL = 1e-6

LENGTHS = (1, 5, 127, 128, 129, 300, 1000)
REAL = (16, 96, 192)  # Laplace 3B: H, d_k, d_v
REAL_LENGTHS = (1, 5, 129, 300)

_REPORT = os.environ.get("GLA_TEST_REPORT") == "1"


# --------------------------------------------------------------------------- helpers


def assert_close(actual: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    """|actual - ref| <= tol * |ref| + tol * max|ref|, elementwise, computed in float64."""
    assert actual.shape == ref.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(ref.shape)}"
    a, r = actual.double(), ref.double()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    scale = r.abs().max().item() if r.numel() else 0.0
    err = (a - r).abs()
    if _REPORT:
        worst = err.max().item() if err.numel() else 0.0
        print(f"\n[{what}] max|err|={worst:.3e} max|ref|={scale:.3e} normwise={worst / max(scale, 1e-300):.3e}")
    bound = tol * r.abs() + tol * scale
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements out of tolerance {tol}; "
        f"max|err|={err.max().item():.3e}, max|ref|={scale:.3e}"
    )


def bits(x: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float tensor (so NaN compares equal to the same NaN)."""
    return x.contiguous().view({4: torch.int32, 2: torch.int16, 8: torch.int64}[x.element_size()]).clone()


class OpOutputSizes(TorchDispatchMode):
    """Records the element count of every tensor each aten op returns, and the number of ops."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self.numels += [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def cu_of(lengths) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def make_inputs(lengths, H, dk, dv, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    q = torch.randn(T, H, dk, generator=g).to(dtype)
    k = torch.randn(T, H, dk, generator=g).to(dtype)
    v = torch.randn(T, H, dv, generator=g).to(dtype)
    aug = (0.3 * torch.randn(H, dk, generator=g)).to(dtype)
    S0 = torch.randn(N, H, dk, dv, generator=g)
    return q, k, v, aug, S0


# --------------------------------------------------------------------------- decay schedule


def test_geometric_log_decay_matches_spec():
    H, t_min, t_max = 16, 1.0, 2048.0
    ld = geometric_log_decay(H, t_min, t_max)
    assert ld.shape == (H,) and ld.dtype == torch.float32
    lam = torch.exp(ld.double())
    # Spec figures: head 0 lambda = 0.5, head 15 lambda ~ 0.99966 (= 2^(-1/2048)).
    assert abs(lam[0].item() - 0.5) < 1e-7
    assert abs(lam[-1].item() - 0.99966) < 5e-6
    assert abs(lam[-1].item() - 2.0 ** (-1.0 / 2048.0)) < 1e-9
    # Every head against the formula, written out directly.
    for h in range(H):
        t_h = t_min * (t_max / t_min) ** (h / (H - 1))
        assert math.isclose(ld[h].item(), -math.log(2.0) / t_h, rel_tol=1e-6), h
    # Decays strictly increase with the head index (half-lives are geometric and increasing).
    assert (lam[1:] > lam[:-1]).all()


@pytest.mark.parametrize("H,t_min,t_max", [(4, 1.0, 64.0), (8, 2.0, 512.0), (3, 0.5, 10.0)])
def test_geometric_log_decay_other_schedules(H, t_min, t_max):
    lam = torch.exp(geometric_log_decay(H, t_min, t_max).double())
    torch.testing.assert_close(lam, ref_lambda(H, t_min, t_max), rtol=1e-6, atol=1e-9)


# --------------------------------------------------------------------------- chunked prefill


GEOMETRIES = [
    pytest.param(2, 8, 16, LENGTHS, id="H2-dk8-dv16"),
    pytest.param(4, 32, 16, LENGTHS, id="H4-dk32-dv16"),
    pytest.param(3, 16, 48, LENGTHS, id="H3-dk16-dv48"),
    pytest.param(*REAL, REAL_LENGTHS, id="real-H16-dk96-dv192"),
]


@pytest.mark.parametrize("H,dk,dv,lengths", GEOMETRIES)
def test_prefill_matches_recurrence_fp32(H, dk, dv, lengths):
    t_min, t_max = 1.0, 2048.0
    q, k, v, aug, S0 = make_inputs(lengths, H, dk, dv, seed=1000 + H * dk + dv)
    scale = dk**-0.5
    S0_before = S0.clone()
    o, S = simple_gla_chunked_prefill(q, k, v, aug, geometric_log_decay(H, t_min, t_max), scale, cu_of(lengths), S0)
    assert o.dtype == torch.float32 and o.shape == v.shape
    assert S.dtype == torch.float32 and S.shape == S0.shape
    assert torch.equal(S0, S0_before), "initial_state must not be modified"
    o_ref, _, S_ref = ref_packed(q, k, v, aug, ref_lambda(H, t_min, t_max), scale, lengths, S0)
    assert_close(o, o_ref, FP32_TOL, f"prefill fp32 o {H}x{dk}x{dv}")
    assert_close(S, S_ref, FP32_TOL, f"prefill fp32 S {H}x{dk}x{dv}")


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_prefill_other_chunk_sizes(chunk_size):
    H, dk, dv, lengths = 3, 16, 24, (1, 15, 16, 17, 63, 64, 65, 200)
    q, k, v, aug, S0 = make_inputs(lengths, H, dk, dv, seed=7 + chunk_size)
    lam = ref_lambda(H, 1.0, 300.0)
    o, S = simple_gla_chunked_prefill(q, k, v, aug, torch.log(lam).float(), 0.2, cu_of(lengths), S0, chunk_size)
    o_ref, _, S_ref = ref_packed(q, k, v, aug, lam, 0.2, lengths, S0)
    assert_close(o, o_ref, FP32_TOL, f"prefill C={chunk_size} o")
    assert_close(S, S_ref, FP32_TOL, f"prefill C={chunk_size} S")


@pytest.mark.parametrize(
    "H,dk,dv,lengths",
    [pytest.param(4, 32, 16, LENGTHS, id="H4-dk32-dv16"), pytest.param(*REAL, REAL_LENGTHS, id="real")],
)
def test_prefill_matches_recurrence_bf16(H, dk, dv, lengths):
    q, k, v, aug, S0 = make_inputs(lengths, H, dk, dv, seed=2000 + H, dtype=torch.bfloat16)
    scale = dk**-0.5
    o, S = simple_gla_chunked_prefill(q, k, v, aug, geometric_log_decay(H, 1.0, 2048.0), scale, cu_of(lengths), S0)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    # Reference on exactly the bf16-rounded inputs, in float64.
    o_ref, _, S_ref = ref_packed(q, k, v, aug, ref_lambda(H, 1.0, 2048.0), scale, lengths, S0)
    assert_close(o, o_ref, BF16_OUT_TOL, f"prefill bf16 o {H}x{dk}x{dv}")
    assert_close(S, S_ref, FP32_TOL, f"prefill bf16 S {H}x{dk}x{dv}")


def _fla_recurrent():
    # Imported here so that a broken fla fails these tests (it is a test dependency) without
    # taking the rest of the file down at collection.
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    return naive_recurrent_simple_gla


@pytest.mark.parametrize(
    "H,dk,dv,lengths",
    [pytest.param(2, 8, 16, LENGTHS, id="H2-dk8-dv16"), pytest.param(*REAL, (5, 129, 300), id="real")],
)
def test_prefill_core_matches_fla(H, dk, dv, lengths):
    naive_recurrent_simple_gla = _fla_recurrent()
    q, k, v, _, S0 = make_inputs(lengths, H, dk, dv, seed=3000 + H)
    aug = torch.zeros(H, dk)  # self-augmentation term becomes sigmoid(0) * v = v / 2
    log_decay = geometric_log_decay(H, 1.0, 2048.0)
    scale = dk**-0.5
    o, S = simple_gla_chunked_prefill(q, k, v, aug, log_decay, scale, cu_of(lengths), S0)
    core = o - 0.5 * v
    cu = cu_of(lengths).tolist()
    for n, L in enumerate(lengths):
        s, e = cu[n], cu[n + 1]
        # fla layout: q, k [B, T, H, K], v [B, T, H, V]; g [B, T, H] = log decay of each token/head.
        g = log_decay[None, None, :].expand(1, L, H).contiguous()
        o_fla, S_fla = naive_recurrent_simple_gla(
            q[None, s:e],
            k[None, s:e],
            v[None, s:e],
            g,
            scale=scale,
            initial_state=S0[n : n + 1].clone(),
            output_final_state=True,
        )
        assert_close(core[s:e], o_fla[0], FLA_TOL, f"fla core seq{n} L={L}")
        assert_close(S[n], S_fla[0], FLA_TOL, f"fla state seq{n} L={L}")


def test_fla_agrees_with_float64_recurrence():
    """Cross-check of the two references against each other (both independent of the kernel)."""
    naive_recurrent_simple_gla = _fla_recurrent()
    H, dk, dv, L = 3, 8, 12, 1000
    q, k, v, aug, S0 = make_inputs((L,), H, dk, dv, seed=31)
    lam = ref_lambda(H, 1.0, 2048.0)
    _, core_ref, S_ref = ref_recurrence(q, k, v, aug, lam, 0.3, S0[0])
    g = torch.log(lam).float()[None, None, :].expand(1, L, H).contiguous()
    o_fla, S_fla = naive_recurrent_simple_gla(q[None], k[None], v[None], g, scale=0.3, initial_state=S0.clone())
    assert_close(o_fla[0], core_ref, FLA_TOL, "fla vs float64 core")
    assert_close(S_fla[0], S_ref, FLA_TOL, "fla vs float64 state")


@pytest.mark.parametrize(
    "lengths,splits",
    [
        ((300, 1000, 129, 7), (128, 1, 127, 6)),
        ((256, 130, 2, 500), (128, 129, 1, 250)),
    ],
)
def test_prefill_continues_from_saved_state(lengths, splits):
    H, dk, dv = 4, 16, 24
    q, k, v, aug, S0 = make_inputs(lengths, H, dk, dv, seed=sum(splits))
    lam = ref_lambda(H, 1.0, 2048.0)
    log_decay, scale = geometric_log_decay(H, 1.0, 2048.0), dk**-0.5
    cu = cu_of(lengths).tolist()
    first = [slice(cu[n], cu[n] + splits[n]) for n in range(len(lengths))]
    second = [slice(cu[n] + splits[n], cu[n + 1]) for n in range(len(lengths))]

    def gather(x, parts):
        return torch.cat([x[p] for p in parts])

    o_whole, S_whole = simple_gla_chunked_prefill(q, k, v, aug, log_decay, scale, cu_of(lengths), S0)
    o1, S1 = simple_gla_chunked_prefill(
        gather(q, first), gather(k, first), gather(v, first), aug, log_decay, scale, cu_of(splits), S0
    )
    rest = [L - s for L, s in zip(lengths, splits, strict=True)]
    o2, S2 = simple_gla_chunked_prefill(
        gather(q, second), gather(k, second), gather(v, second), aug, log_decay, scale, cu_of(rest), S1
    )
    # Reassemble the two calls in the packed order of the whole batch.
    c1, c2 = cu_of(splits).tolist(), cu_of(rest).tolist()
    o_split = torch.cat([torch.cat([o1[c1[n] : c1[n + 1]], o2[c2[n] : c2[n + 1]]]) for n in range(len(lengths))])

    assert_close(o_split, o_whole, INVARIANCE_TOL, "split vs whole o")
    assert_close(S2, S_whole, INVARIANCE_TOL, "split vs whole S")
    o_ref, _, S_ref = ref_packed(q, k, v, aug, lam, scale, lengths, S0)
    assert_close(o_split, o_ref, FP32_TOL, "split vs recurrence o")
    assert_close(S2, S_ref, FP32_TOL, "split vs recurrence S")


@pytest.mark.parametrize(
    "H,dk,dv,lengths",
    [pytest.param(3, 16, 48, LENGTHS, id="H3-dk16-dv48"), pytest.param(*REAL, REAL_LENGTHS, id="real")],
)
def test_prefill_batch_invariance(H, dk, dv, lengths):
    q, k, v, aug, S0 = make_inputs(lengths, H, dk, dv, seed=4000 + H)
    log_decay, scale = geometric_log_decay(H, 1.0, 2048.0), dk**-0.5
    o, S = simple_gla_chunked_prefill(q, k, v, aug, log_decay, scale, cu_of(lengths), S0)
    cu = cu_of(lengths).tolist()
    for n, L in enumerate(lengths):
        s, e = cu[n], cu[n + 1]
        o_n, S_n = simple_gla_chunked_prefill(q[s:e], k[s:e], v[s:e], aug, log_decay, scale, cu_of([L]), S0[n : n + 1])
        assert_close(o[s:e], o_n, INVARIANCE_TOL, f"batch invariance o seq{n} L={L}")
        assert_close(S[n : n + 1], S_n, INVARIANCE_TOL, f"batch invariance S seq{n} L={L}")


# One long sequence among many short ones, in an order where chunk counts rise and fall and tie,
# so that every way of numbering the real chunks shows; 0 = a sequence with no tokens this step.
MIXED = (64, 1000, 1, 127, 128, 129, 300, 0, 5, 257) + (64,) * 12 + (129, 1)


@pytest.mark.parametrize(
    "H,dk,dv,lengths",
    [pytest.param(3, 16, 24, MIXED, id="H3-dk16-dv24"), pytest.param(*REAL, (300, 1, 129, 64, 128, 64), id="real")],
)
def test_prefill_mixed_lengths_matches_recurrence(H, dk, dv, lengths):
    q, k, v, aug, S0 = make_inputs(lengths, H, dk, dv, seed=8000 + H)
    lam = ref_lambda(H, 1.0, 2048.0)
    log_decay, scale = geometric_log_decay(H, 1.0, 2048.0), dk**-0.5
    o, S = simple_gla_chunked_prefill(q, k, v, aug, log_decay, scale, cu_of(lengths), S0)
    o_ref, _, S_ref = ref_packed(q, k, v, aug, lam, scale, lengths, S0)
    assert_close(o, o_ref, FP32_TOL, f"mixed lengths o {H}x{dk}x{dv}")
    assert_close(S, S_ref, FP32_TOL, f"mixed lengths S {H}x{dk}x{dv}")


def check_step_sizes(lengths: tuple[int, ...], padded_rows: int, what: str, seed: int) -> None:
    """The prefill of one step of `lengths` creates no tensor above B = padded_rows H max(C, dk, dv) + N H dk dv
    elements (a padded row holds at most max(C, dk, dv) values per head: a row of scores, or of q, k, v, o; a
    state is dk x dv per head and sequence) and at most 16 B in all, and matches the float64 recurrence."""
    H, dk, dv, C = 2, 16, 32, 128
    N = len(lengths)
    q, k, v, aug, S0 = make_inputs(lengths, H, dk, dv, seed=seed)
    lam = ref_lambda(H, 1.0, 2048.0)
    log_decay, scale = geometric_log_decay(H, 1.0, 2048.0), dk**-0.5
    with OpOutputSizes() as sizes:
        o, S = simple_gla_chunked_prefill(q, k, v, aug, log_decay, scale, cu_of(lengths), S0)
    bound = padded_rows * H * max(C, dk, dv) + N * H * dk * dv
    largest, total = max(sizes.numels), sum(sizes.numels)
    if _REPORT:
        print(f"\n[{what} sizes] largest {largest / bound:.2f} B, total {total / bound:.1f} B")
    assert largest <= bound, f"{what}: largest intermediate {largest} elements > {bound} (T={sum(lengths)}, N={N})"
    assert total <= 16 * bound, f"{what}: elements created {total} > 16 x {bound} (T={sum(lengths)}, N={N})"
    o_ref, _, S_ref = ref_packed(q, k, v, aug, lam, scale, lengths, S0)
    assert_close(o, o_ref, FP32_TOL, f"{what} o")
    assert_close(S, S_ref, FP32_TOL, f"{what} S")


def test_prefill_memory_proportional_to_tokens():
    """A step of one long and many short prompts must cost what its tokens cost.

    Independent bound: chunked prefill pads each sequence to whole chunks, at most C-1 rows per sequence, so the
    padded rows number at most T + N (C-1) (`check_step_sizes` has the rest of B; docs/kernels.md the measured
    multiples, and those of the earlier version that padded every sequence to the longest one's chunk count).
    """
    lengths = (64, 1000, 1, 127, 128, 129, 300) + (64,) * 26
    check_step_sizes(lengths, sum(lengths) + len(lengths) * 127, "proportional step", seed=81)


def test_prefill_memory_follows_tokens_under_a_burst_of_tiny_prompts():
    """A step of many tiny prompts (a burst of one- and two-token requests) costs its tokens plus one state per
    sequence, not a 128-token chunk per prompt.

    Independent bound: a sequence's last chunk of L rows may be padded to the power of two that holds it, at least
    16 rows (< max(2L, 16)); every other chunk is full. So the padded rows number under 2T + 16N. Padding every
    sequence to a whole chunk (C rows for a two-token prompt) exceeds it several times over.
    """
    lengths = (2,) * 32 + (1,) * 8 + (5, 17, 33, 129)
    check_step_sizes(lengths, 2 * sum(lengths) + 16 * len(lengths), "burst step", seed=82)


def _call_prefill(cu: torch.Tensor, T: int, N: int) -> None:
    H, d = 2, 4
    q = torch.randn(T, H, d)
    simple_gla_chunked_prefill(q, q, q, torch.zeros(H, d), torch.full((H,), -0.1), 1.0, cu, torch.zeros(N, H, d, d))


def _call_conv(cu: torch.Tensor, T: int, N: int) -> None:
    causal_conv1d_prefill(torch.randn(T, 6), torch.randn(6, 4), None, cu, torch.zeros(N, 3, 6))


@pytest.mark.parametrize("call", [_call_prefill, _call_conv], ids=["gla", "conv"])
@pytest.mark.parametrize("cu", [[0, 4, 8], [0, 4, 12], [0, 6, 4, 10], [2, 6, 10]], ids=str)
def test_prefill_rejects_cu_seqlens_not_matching_tokens(call, cu):
    # 10 packed tokens: cu_seqlens ending short (tokens silently dropped), past the end, falling, not from 0.
    with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to the 10 packed tokens"):
        call(torch.tensor(cu), 10, len(cu) - 1)


@pytest.mark.parametrize("call", [_call_prefill, _call_conv], ids=["gla", "conv"])
def test_prefill_rejects_state_of_other_batch(call):
    with pytest.raises(ValueError, match=r"the state holds 3 sequences, cu_seqlens 2"):
        call(torch.tensor([0, 4, 10]), 10, 3)


# --------------------------------------------------------------------------- decode step


# Each step: the slot of every batch row, -1 = padding. Slots 0 and 6 (= num_slots - 1, which
# a stray Python -1 index would hit) are never used, so a padding row writing anywhere shows.
DECODE_SCHEDULE = [
    [4, -1, 2, 5, -1],
    [2, 5, -1, 4, -1],
    [-1, -1, 5, 2, 4],
    [5, 4, 2, -1, -1],
    [3, -1, 2, -1, 5],  # a sequence joins at slot 3 (its state set before), slot 4 idles
]
NUM_SLOTS = 7


@pytest.mark.parametrize(
    "H,dk,dv,dtype",
    [
        pytest.param(3, 16, 24, torch.float32, id="H3-fp32"),
        pytest.param(*REAL, torch.float32, id="real-fp32"),
        pytest.param(3, 16, 24, torch.bfloat16, id="H3-bf16"),
    ],
)
def test_decode_steps_on_state_pool(H, dk, dv, dtype):
    gen = torch.Generator().manual_seed(5000 + H)
    lam = ref_lambda(H, 1.0, 2048.0)
    log_decay, scale = geometric_log_decay(H, 1.0, 2048.0), dk**-0.5
    aug = (0.3 * torch.randn(H, dk, generator=gen)).to(dtype)
    pool = torch.randn(NUM_SLOTS, H, dk, dv, generator=gen)
    pool[0] = float("nan")  # e.g. never-initialised memory: must not leak anywhere
    pool_ptr = pool.data_ptr()
    ref_state = {s: pool[s].double().clone() for s in range(NUM_SLOTS)}
    used = {s for step in DECODE_SCHEDULE for s in step if s >= 0}
    out_tol = FP32_TOL if dtype == torch.float32 else BF16_OUT_TOL

    for i, slot_list in enumerate(DECODE_SCHEDULE):
        B = len(slot_list)
        slots = torch.tensor(slot_list, dtype=torch.int32)
        q = (torch.randn(B, H, dk, generator=gen)).to(dtype)
        k = (torch.randn(B, H, dk, generator=gen)).to(dtype)
        v = (torch.randn(B, H, dv, generator=gen)).to(dtype)
        pad = slots < 0
        q[pad], k[pad], v[pad] = 1e4, -1e4, 1e4  # garbage in padding rows
        before = bits(pool)

        o = simple_gla_decode_step(q, k, v, aug, log_decay, scale, pool, slots)

        assert o.shape == (B, H, dv) and o.dtype == dtype
        assert pool.data_ptr() == pool_ptr
        after = bits(pool)
        touched = {s for s in slot_list if s >= 0}
        for s in range(NUM_SLOTS):
            if s not in touched:
                assert torch.equal(after[s], before[s]), f"step {i}: slot {s} not in batch was modified"
        assert (o[pad] == 0).all(), f"step {i}: padding rows must output zero"
        for b, s in enumerate(slot_list):
            if s < 0:
                continue
            o_ref, _, S_ref = ref_recurrence(q[b : b + 1], k[b : b + 1], v[b : b + 1], aug, lam, scale, ref_state[s])
            ref_state[s] = S_ref
            assert_close(o[b], o_ref[0], out_tol, f"decode {dtype} step {i} row {b} o")
            # The new state must be in the caller's pool tensor (written in place).
            assert_close(pool[s], S_ref, FP32_TOL, f"decode {dtype} step {i} slot {s} S")

    assert torch.isnan(pool[0]).all()
    for s in set(range(NUM_SLOTS)) - used:
        assert torch.equal(bits(pool[s]), bits(ref_state[s].float())), f"unused slot {s} changed"


def test_decode_all_padding_is_a_no_op():
    H, dk, dv = 2, 8, 8
    pool = torch.randn(3, H, dk, dv)
    before = bits(pool)
    q, k, v = torch.randn(2, H, dk), torch.randn(2, H, dk), torch.randn(2, H, dv)
    slots = torch.tensor([-1, -1])
    o = simple_gla_decode_step(q, k, v, torch.randn(H, dk), geometric_log_decay(H, 1.0, 8.0), 0.5, pool, slots)
    assert (o == 0).all()
    assert torch.equal(bits(pool), before)


@pytest.mark.parametrize(
    "H,dk,dv,lengths",
    [pytest.param(4, 16, 24, (1, 127, 300), id="H4"), pytest.param(*REAL, (5, 129), id="real")],
)
def test_prefill_then_decode_matches_recurrence(H, dk, dv, lengths):
    n_decode = 4
    N = len(lengths)
    full = [L + n_decode for L in lengths]
    q, k, v, aug, S0 = make_inputs(full, H, dk, dv, seed=6000 + H)
    lam = ref_lambda(H, 1.0, 2048.0)
    log_decay, scale = geometric_log_decay(H, 1.0, 2048.0), dk**-0.5
    cu_full = cu_of(full).tolist()
    pre = torch.cat([torch.arange(cu_full[n], cu_full[n] + lengths[n]) for n in range(N)])

    o_pre, S_pre = simple_gla_chunked_prefill(q[pre], k[pre], v[pre], aug, log_decay, scale, cu_of(lengths), S0)

    slot_of = [2 * n + 1 for n in range(N)]  # slots 1, 3, 5, ...
    pool = torch.zeros(2 * N + 1, H, dk, dv)
    pool[slot_of] = S_pre
    o_dec = torch.empty(N, n_decode, H, dv)
    for t in range(n_decode):
        # Rows in reverse sequence order with a padding row in the middle.
        rows = list(reversed(range(N)))
        rows.insert(1, -1)
        tok = torch.tensor([cu_full[n] + lengths[n] + t if n >= 0 else 0 for n in rows])
        slots = torch.tensor([slot_of[n] if n >= 0 else -1 for n in rows])
        o = simple_gla_decode_step(q[tok], k[tok], v[tok], aug, log_decay, scale, pool, slots)
        for b, n in enumerate(rows):
            if n >= 0:
                o_dec[n, t] = o[b]
            else:
                assert (o[b] == 0).all()

    o_ref, _, S_ref = ref_packed(q, k, v, aug, lam, scale, full, S0)
    pre_cu = cu_of(lengths).tolist()
    for n in range(N):
        s = cu_full[n]
        assert_close(o_pre[pre_cu[n] : pre_cu[n + 1]], o_ref[s : s + lengths[n]], FP32_TOL, f"prefill part seq{n}")
        assert_close(o_dec[n], o_ref[s + lengths[n] : cu_full[n + 1]], FP32_TOL, f"decode part seq{n}")
        assert_close(pool[slot_of[n]], S_ref[n], FP32_TOL, f"final state seq{n}")


@pytest.mark.parametrize("H,dk,dv", [pytest.param(3, 16, 24, id="H3"), pytest.param(*REAL, id="real")])
def test_verify_then_advance_over_the_accepted_tokens(H, dk, dv):
    """A speculative step: rows of 1..P tokens computed from their states, the states left as they were; then each
    state moved over only its first `accepted` tokens. Outputs and states equal the float64 recurrence over exactly
    those tokens, and the decode step run token by token (what a step without speculation computes): its states bit
    for bit."""
    lens, accepted = [4, 1, 3, 2], [2, 1, 3, 0]
    B, P = len(lens), max(lens)
    gen = torch.Generator().manual_seed(7100 + H)
    q, k, v = (torch.randn(B, P, H, d, generator=gen) for d in (dk, dk, dv))
    aug, S0 = 0.3 * torch.randn(H, dk, generator=gen), torch.randn(B, H, dk, dv, generator=gen)
    lam, log_decay, scale = ref_lambda(H, 1.0, 2048.0), geometric_log_decay(H, 1.0, 2048.0), dk**-0.5
    before = bits(S0)
    o, first = simple_gla_verify(q, k, v, aug, log_decay, scale, S0, torch.tensor(lens))
    assert torch.equal(bits(S0), before), "verification moved a state"
    S = simple_gla_advance(k, v, log_decay, S0, torch.tensor(accepted))
    pool = S0.clone()
    for b in range(B):
        o_ref, _, _ = ref_recurrence(q[b, : lens[b]], k[b, : lens[b]], v[b, : lens[b]], aug, lam, scale, S0[b])
        assert_close(o[b, : lens[b]], o_ref, FP32_TOL, f"row {b} outputs")
        assert (o[b, lens[b] :] == 0).all(), f"row {b}: outputs past its tokens"
        _, _, S_ref = ref_recurrence(
            q[b, : accepted[b]], k[b, : accepted[b]], v[b, : accepted[b]], aug, lam, scale, S0[b]
        )
        assert_close(S[b], S_ref, FP32_TOL, f"row {b} state after {accepted[b]} accepted")
        slot = torch.tensor([b])
        for t in range(lens[b]):
            o_t = simple_gla_decode_step(
                q[b, t : t + 1], k[b, t : t + 1], v[b, t : t + 1], aug, log_decay, scale, pool, slot
            )
            # the einsum's summation order follows the batch; the state's update is elementwise
            assert_close(o[b, t], o_t[0], INVARIANCE_TOL, f"row {b} token {t}: the decode step's output")
            if t + 1 == accepted[b]:
                assert torch.equal(bits(S[b]), bits(pool[b])), f"row {b}: not the decode step's state"
            if t == 0:
                assert torch.equal(bits(first[b]), bits(pool[b])), f"row {b}: not the state after its first token"


# --------------------------------------------------------------------------- causal conv1d


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_prefill_continuing_from_state(W, with_bias):
    gen = torch.Generator().manual_seed(70 + W + int(with_bias))
    D = 24
    history = (0, 1, 2, 3, 10, 200)  # tokens already seen before this prefill
    new = (1, 2, 3, 5, 17, 129)  # tokens of this prefill
    weight = torch.randn(D, W, generator=gen)
    bias = torch.randn(D, generator=gen) if with_bias else None
    seqs = [torch.randn(h + n, D, generator=gen) for h, n in zip(history, new, strict=True)]
    conv_state = torch.stack([ref_conv_state(s[:h], W) for s, h in zip(seqs, history, strict=True)])
    state_before = conv_state.clone()
    x = torch.cat([s[h:] for s, h in zip(seqs, history, strict=True)])

    y, new_state = causal_conv1d_prefill(x, weight, bias, cu_of(new), conv_state)

    assert torch.equal(conv_state, state_before), "conv_state argument must not be modified"
    y_ref = torch.cat([ref_conv_silu(s, weight, bias)[h:] for s, h in zip(seqs, history, strict=True)])
    assert_close(y, y_ref, FP32_TOL, f"conv prefill W={W} y")
    torch.testing.assert_close(new_state, torch.stack([ref_conv_state(s, W) for s in seqs]), rtol=0, atol=0)


@pytest.mark.parametrize("W", [2, 4])
def test_conv_prefill_then_steps_with_padding(W):
    gen = torch.Generator().manual_seed(80 + W)
    D, n_steps = 16, 5
    lengths = (1, 2, 40)
    weight = torch.randn(D, W, generator=gen)
    bias = torch.randn(D, generator=gen)
    seqs = [torch.randn(L + n_steps, D, generator=gen) for L in lengths]
    N = len(lengths)

    x = torch.cat([s[:L] for s, L in zip(seqs, lengths, strict=True)])
    y_pre, state = causal_conv1d_prefill(x, weight, bias, cu_of(lengths), torch.zeros(N, W - 1, D))
    slot_of = [3, 1, 4]  # pool slots 0, 2 and 5 (the last) stay unused
    pool = torch.randn(6, W - 1, D, generator=gen)
    pool[0] = float("nan")
    pool[slot_of] = state
    pool_ptr = pool.data_ptr()
    unused_before = {s: bits(pool[s]) for s in (0, 2, 5)}

    y_dec = torch.empty(N, n_steps, D)
    for t in range(n_steps):
        rows = [2, -1, 0, -1, 1] if t % 2 == 0 else [-1, 1, 2, 0]
        xs = torch.stack([seqs[n][lengths[n] + t] if n >= 0 else torch.full((D,), 1e4) for n in rows])
        slots = torch.tensor([slot_of[n] if n >= 0 else -1 for n in rows])
        y = causal_conv1d_step(xs, weight, bias, pool, slots)
        assert y.shape == (len(rows), D) and pool.data_ptr() == pool_ptr
        for b, n in enumerate(rows):
            if n >= 0:
                y_dec[n, t] = y[b]

    for s, before in unused_before.items():
        assert torch.equal(bits(pool[s]), before), f"unused conv slot {s} changed"
    pre_cu = cu_of(lengths).tolist()
    for n, s in enumerate(seqs):
        ref = ref_conv_silu(s, weight, bias)
        assert_close(y_pre[pre_cu[n] : pre_cu[n + 1]], ref[: lengths[n]], FP32_TOL, f"conv W={W} prefill seq{n}")
        assert_close(y_dec[n], ref[lengths[n] :], FP32_TOL, f"conv W={W} steps seq{n}")
        torch.testing.assert_close(pool[slot_of[n]], ref_conv_state(s, W), rtol=0, atol=0)


def test_conv_prefill_mixed_lengths_one_pass():
    """Many prompts in one step: the result of the float64 reference, in as many ops as for two.

    A loop over sequences (host reads of cu_seqlens, one conv per sequence) stalls a device at
    every prompt; the op count must not grow with the number of sequences.
    """
    gen = torch.Generator().manual_seed(90)
    D, W = 8, 4
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)

    def run(history, new):
        seqs = [torch.randn(h + n, D, generator=gen) for h, n in zip(history, new, strict=True)]
        conv_state = torch.stack([ref_conv_state(s[:h], W) for s, h in zip(seqs, history, strict=True)])
        x = torch.cat([s[h:] for s, h in zip(seqs, history, strict=True)])
        with OpOutputSizes() as counter:
            y, state = causal_conv1d_prefill(x, weight, bias, cu_of(new), conv_state)
        y_ref = torch.cat([ref_conv_silu(s, weight, bias)[h:] for s, h in zip(seqs, history, strict=True)])
        assert_close(y, y_ref, FP32_TOL, f"conv mixed N={len(new)} y")
        torch.testing.assert_close(state, torch.stack([ref_conv_state(s, W) for s in seqs]), rtol=0, atol=0)
        return counter.ops

    ops_two = run((0, 5), (300, 2))
    ops_many = run((0, 1, 2, 0, 9) * 8, (300, 1, 2, 3, 64) * 8)
    assert ops_many == ops_two, f"{ops_many} ops for 40 sequences vs {ops_two} for 2"


# --------------------------------------------------------------------------- one padded sequence (static shapes)


@pytest.mark.parametrize("T", [128, 96, 300])
def test_padded_prefill_matches_recurrence_for_every_real_length(T):
    """A sequence padded to T tokens: output and state after its real tokens equal the float64 recurrence over those
    tokens alone, whatever the padding holds, from a saved state."""
    H, dk, dv = 3, 8, 16
    q, k, v, aug, S0 = make_inputs([T], H, dk, dv, seed=90 + T)
    lam = ref_lambda(H, 1.0, 64.0)
    log_decay = geometric_log_decay(H, 1.0, 64.0)
    for n in sorted({0, 1, 5, 127, 128, 129, T - 1, T} & set(range(T + 1))):
        noisy = [t.clone() for t in (q, k, v)]
        for t in noisy:
            t[n:] = 1e3  # padding never reaches a real output or the state
        o, S = simple_gla_prefill_padded(*noisy, aug, log_decay, 0.3, torch.tensor(n), S0[0])
        o_ref, _, S_ref = ref_recurrence(q[:n], k[:n], v[:n], aug, lam, 0.3, S0[0])
        assert_close(o[:n], o_ref.float(), FP32_TOL, f"padded prefill T={T} n={n} o")
        assert_close(S, S_ref.float(), FP32_TOL, f"padded prefill T={T} n={n} state")


@pytest.mark.parametrize("W", [2, 4])
def test_padded_conv_prefill_matches_reference(W):
    gen = torch.Generator().manual_seed(95 + W)
    D, T = 12, 40
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    for history, n in [(0, 1), (0, 40), (2, 1), (10, 17), (1, 2)]:
        seq = torch.randn(history + n, D, generator=gen)
        x = torch.cat([seq[history:], torch.full((T - n, D), 1e4)])
        y, state = causal_conv1d_prefill_padded(x, weight, bias, torch.tensor(n), ref_conv_state(seq[:history], W))
        assert_close(y[:n], ref_conv_silu(seq, weight, bias)[history:], FP32_TOL, f"padded conv W={W} n={n}")
        torch.testing.assert_close(state, ref_conv_state(seq, W), rtol=0, atol=0)


def test_padded_forms_compile_to_one_graph_for_every_length():
    """Under torch.compile(fullgraph=True) one graph per padded length T serves every real length: no recompile,
    and the compiled results equal the eager ones."""
    import torch._dynamo

    H, dk, dv, D, W, T = 2, 8, 16, 12, 4, 128
    q, k, v, aug, S0 = make_inputs([T], H, dk, dv, seed=97)
    log_decay = geometric_log_decay(H, 1.0, 64.0)
    gen = torch.Generator().manual_seed(98)
    x, weight, bias = torch.randn(T, D, generator=gen), torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    conv0 = torch.randn(W - 1, D, generator=gen)

    def step(n: torch.Tensor):  # noqa: ANN202
        o, S = simple_gla_prefill_padded(q, k, v, aug, log_decay, 0.3, n, S0[0])
        y, c = causal_conv1d_prefill_padded(x, weight, bias, n, conv0)
        return o, S, y, c

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")
    compiled(torch.tensor(1))  # warm-up
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in (0, 7, 127, 128):
            for got, want in zip(compiled(torch.tensor(n)), step(torch.tensor(n))):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
