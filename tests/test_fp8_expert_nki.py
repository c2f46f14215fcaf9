"""The FP8 expert NKI kernel (kernels/fp8_expert_nki.py) in the NKI emulator, against float64 math and the op's
definition, which is also the model's torch path (kernels/fp8_expert.py: fp8_expert, fp8_experts).

Bounds used below (u = 2^-24, fp32 rounding): a matmul of exact FP8 products summed in n fp32 steps, then scaled
twice and biased, is within (n + 3) u (|q| |w|^T s_tok s_row + |b|) of the float64 value; n = K / 256 for the kernel
(the emulator rounds each 256-term double-row matmul once and accumulates those in fp32 PSUM; TensorE's internal
order is not modelled), n = K for torch's matmul (any order). A token's h is
re-quantized to FP8, so two computations of h that differ by fp32 rounding can pick neighbouring FP8 codes for an
element sitting on a rounding midpoint; such a flip moves y[d] by at most one FP8 step of h (<= 16 s_h) times
s2[d] max_i |w2[d, i]|.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.emulator_helpers import assert_counters_equal_cost, lnc2
from vllm_trn_plugin.kernels import fp8_expert_nki as K
from vllm_trn_plugin.kernels import nki_emu
from vllm_trn_plugin.kernels.fp8 import fp8_linear, quantize_per_token
from vllm_trn_plugin.kernels.fp8_expert import ExpertWeights, fp8_expert, fp8_experts, from_kernel_layout
from vllm_trn_plugin.kernels.nki_shim import nisa, nki, nl, simulate

U = 2.0**-24
FP8 = torch.float8_e4m3fn


def _weights(g: torch.Generator, e: int, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """FP8 rows within +-192 with power-of-two row scales and fp32 bias corrections, as the loader makes them."""
    w = (torch.randn(e, rows, cols, generator=g) * 48).clamp(-192, 192).to(FP8)
    s = torch.exp2(torch.randint(-14, -9, (e, rows), generator=g).float())
    b = torch.randn(e, rows, generator=g) * 0.01
    return w, s, b


def _experts(seed: int, e: int, hd: int, inter: int) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(*_weights(g, e, 2 * inter, hd), *_weights(g, e, hd, inter))


def _routing(seed: int, t: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.topk(torch.randn(t, e, generator=g).softmax(-1), k)


def _f64(t: torch.Tensor) -> np.ndarray:
    return t.double().numpy()


def _matmul_bound(q: np.ndarray, w: np.ndarray, s_tok: np.ndarray, s_row: np.ndarray, b: np.ndarray, n: int):
    """(float64 value, fp32 error bound) of ((q @ w.T) * s_tok) * s_row + b summed in n fp32 steps."""
    val = (q @ w.T) * s_tok[:, None] * s_row[None, :] + b[None, :]
    mag = (np.abs(q) @ np.abs(w).T) * s_tok[:, None] * s_row[None, :] + np.abs(b)[None, :]
    return val, (n + 3) * U * mag


@nki.jit
def one_expert_kernel(x, w13, s13, b13, w2, s2, b2):  # noqa: ANN001, ANN201 - an NKI kernel
    """One expert through the kernel's building blocks, returning what the tests check: y [T, Hd] fp32 and the
    intermediates xq [T, Hd] FP8, s_x [T], h [T, I] fp32 (before quantization), hq [T, I] FP8, s_h [T]."""
    t, hd = x.shape
    inter = w13.shape[0] // 2
    K.check_shapes(t, hd, 2 * inter)
    xq, sx = K.load_quantized_x(x, t, hd)
    y, h, hq, sh = K.expert_mlp(xq, sx, t, w13, s13, b13, w2, s2, b2, None)
    outs = []
    tiles = ((y, hd, nl.float32), (xq, hd, nl.float8_e4m3), (h, inter, nl.float32), (hq, inter, nl.float8_e4m3))
    for tile, cols, dtype in tiles:
        out = nl.ndarray((t, cols), dtype=dtype, buffer=nl.shared_hbm)
        K.store_transposed(out, tile, t, cols)
        outs.append(out)
    for scales in (sx, sh):  # every partition holds every token's scale
        out = nl.ndarray((t,), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=scales[0:1, :])
        outs.append(out)
    y, xq, h, hq, sx, sh = outs
    return y, xq, sx, h, hq, sh


# The ScalarE polynomials' error is undocumented (docs/nki.md section 7.1; kernels/nki_emu/ops.py): the project assumes
# SiLU within ACT_ERR relative, the emulator's perturbation model (the FP8 matmuls are exact products whatever TensorE's
# fp32 precision; the quantization runs on VectorE, which the model leaves exact).
ACT_ERR = 2.0**-10


@pytest.mark.parametrize("act_err", [0.0, ACT_ERR], ids=["exact", "device"])
@pytest.mark.parametrize(
    ("t", "hd", "inter", "dtype"),
    [
        (1, 256, 256, torch.float32),
        (7, 512, 256, torch.bfloat16),
        (32, 256, 512, torch.float32),
        (3, 2048, 1024, torch.bfloat16),
    ],  # fmt: skip
)
def test_expert_kernel_against_float64_and_reference(
    t: int, hd: int, inter: int, dtype: torch.dtype, act_err: float
) -> None:
    """One expert through the kernel's building blocks, with SiLU exact ("exact") or off by up to ACT_ERR relative
    ("device": h then moves by ACT_ERR |SiLU(gate) up| more, and an h element within that of an FP8 midpoint may take
    the neighbouring code: up to 32 ACT_ERR of them, E4M3's relative code spacing being >= 2^-4)."""
    expert = _experts(t + hd, 1, hd, inter).expert(0)
    w13, s13, b13, w2, s2, b2 = expert
    x = (torch.randn(t, hd, generator=torch.Generator().manual_seed(t)) * 3).to(dtype)
    with nki_emu.numerics(activation_rel_error=act_err):
        y, xq, sx, h, hq, sh = simulate(one_expert_kernel)(x, *expert)

    # x's codes and scales: bit for bit the reference quantizer's.
    xq_r, sx_r = quantize_per_token(x)
    assert torch.equal(xq.view(torch.uint8), xq_r.view(torch.uint8)) and torch.equal(sx, sx_r)

    # h against float64 from those codes: products exact, only fp32 accumulation/scaling and SiLU round.
    gu, err = _matmul_bound(_f64(xq), _f64(w13), _f64(sx), _f64(s13), _f64(b13), hd // 256)
    gate, up, e_gate, e_up = gu[:, :inter], gu[:, inter:], err[:, :inter], err[:, inter:]
    silu = gate / (1 + np.exp(-gate))
    h64 = silu * up
    bound_h = 1.1 * e_gate * np.abs(up) + np.abs(silu) * e_up + (3 * U + act_err) * np.abs(h64) + 1e-30
    assert np.all(np.abs(_f64(h) - h64) <= 2 * bound_h)

    # h's codes and scales: bit for bit the reference quantizer applied to the kernel's own h; never beyond 240.
    hq_r, sh_r = quantize_per_token(h)
    assert torch.equal(hq.view(torch.uint8), hq_r.view(torch.uint8)) and torch.equal(sh, sh_r)
    assert torch.all(hq.float().abs() <= 240) and torch.all(torch.isfinite(y))

    # y against float64 from the kernel's h codes.
    y64, e_y = _matmul_bound(_f64(hq), _f64(w2), _f64(sh), _f64(s2), _f64(b2), inter // 256)
    assert np.all(np.abs(_f64(y) - y64) <= 2 * e_y)

    # End to end against the op's definition: equal up to fp32 rounding and the h codes that flipped.
    ref = fp8_expert(x, expert)
    g_r, u_r = ((xq_r.float() @ w13.float().t()) * sx_r[:, None] * s13 + b13).chunk(2, dim=-1)
    hq_ref, sh_ref = quantize_per_token(torch.nn.functional.silu(g_r) * u_r)
    _, e_yr = _matmul_bound(_f64(hq_ref), _f64(w2), _f64(sh_ref), _f64(s2), _f64(b2), inter)  # torch: any order
    moved = np.abs(_f64(hq) * _f64(sh)[:, None] - _f64(hq_ref) * _f64(sh_ref)[:, None])
    flips = moved @ (np.abs(_f64(w2)) * _f64(s2)[:, None]).T
    assert np.all(np.abs(_f64(y) - _f64(ref)) <= e_y + e_yr + flips * (1 + 1e-6))
    assert (hq.float() != hq_ref.float()).float().mean() < 1e-3 + 32 * act_err


def test_expert_kernel_saturates_at_240() -> None:
    """Rows whose amax times 240 * (1/amax) rounds to 240 + ulp: their amax element is code 240, never beyond.

    (RNE alone would also give 240 here; the kernel clamps first because the engines' handling of an fp32 value
    past 240 on an FP8 write is undocumented. The emulator's E4M3 cast makes values from 248 up NaN.)
    """
    hd, inter, t = 256, 256, 16
    g = torch.Generator().manual_seed(5)
    a = torch.rand(4096, generator=g) * 20 + 0.01
    past = a[a * ((1.0 / a) * 240.0) > 240][:t]
    assert len(past) == t
    x = (torch.rand(t, hd, generator=g) * 2 - 1) * past[:, None] * 0.99
    x[torch.arange(t), torch.randint(0, hd, (t,), generator=g)] = past * torch.where(torch.arange(t) % 2 == 0, 1, -1)
    y, xq, _, _, hq, _ = simulate(one_expert_kernel)(x, *_experts(6, 1, hd, inter).expert(0))
    assert torch.equal(xq.float().abs().amax(1), torch.full((t,), 240.0))
    assert torch.equal(xq.view(torch.uint8), quantize_per_token(x)[0].view(torch.uint8))
    assert torch.all(hq.float().abs() <= 240) and torch.all(torch.isfinite(y))


def test_expert_blocks_layout() -> None:
    tw = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]])
    ti = torch.tensor([[5, 2], [2, 7], [5, 2]])
    blk = K.expert_blocks(tw, ti, 8)
    assert blk.n_always == 2 and blk.expert.dtype == torch.int32 and blk.weight.shape == (6, 3)
    assert blk.expert[:3].tolist() == [2, 5, 7] and blk.active.tolist() == [1, 1, 1, 0, 0, 0]
    assert sorted(blk.expert.tolist()) == sorted(set(blk.expert.tolist()))  # distinct experts
    assert torch.equal(blk.weight[:3], torch.tensor([[0.3, 0.6, 0.5], [0.7, 0.0, 0.5], [0.0, 0.4, 0.0]]))
    assert torch.all(blk.weight[3:] == 0)
    one = K.expert_blocks(torch.ones(1, 4), torch.tensor([[3, 0, 9, 1]]), 16)
    assert one.expert.tolist() == [0, 1, 3, 9] and one.active.tolist() == [1, 1, 1, 1]


def _model_bound(
    x: torch.Tensor, tw: torch.Tensor, ti: torch.Tensor, experts: tuple, ref: torch.Tensor
) -> torch.Tensor:
    """Tolerance of kernel vs model per element: fp32 rounding plus one flipped FP8 step of h per (token, expert)."""
    w13, s13, b13, w2, s2, b2 = experts
    tol = torch.full(ref.shape, 1e-5) * ref.float().abs().max()
    for e in ti.unique().tolist():
        tok, k = (ti == e).nonzero(as_tuple=True)
        gate, up = fp8_linear(x[tok], w13[e], s13[e], b13[e]).chunk(2, dim=-1)
        sh = quantize_per_token(torch.nn.functional.silu(gate) * up)[1]
        row = s2[e] * w2[e].float().abs().amax(1)
        tol[tok] += (tw[tok, k].float() * 16 * sh)[:, None] * row[None, :]
    if ref.dtype == torch.bfloat16:
        tol += ref.float().abs() * 2.0**-8  # fp32 values within the above may round to neighbouring bf16 values
    return tol


ROUTINGS = {
    # name: (tokens, experts, top_k, hidden, inter, x dtype, routing override)
    "random_some_empty": (5, 16, 2, 256, 256, torch.float32, None),
    "single_token": (1, 16, 4, 256, 256, torch.float32, None),
    "all_on_one_expert": (7, 8, 1, 256, 256, torch.float32, "one"),
    "one_shared_expert": (9, 8, 2, 512, 256, torch.bfloat16, "shared"),
    "split_beyond_128": (130, 4, 2, 256, 256, torch.float32, None),
    "trinity_geometry": (4, 4, 2, 2048, 1024, torch.bfloat16, None),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_experts_kernel_matches_model_path(name: str) -> None:
    t, e, k, hd, inter, dtype, how = ROUTINGS[name]
    experts = _experts(len(name), e, hd, inter)
    x = (torch.randn(t, hd, generator=torch.Generator().manual_seed(t)) * 2).to(dtype)
    tw, ti = _routing(t * e, t, e, k)
    if how == "one":
        ti = torch.full_like(ti, 5)
    elif how == "shared":
        other = torch.randint(0, e - 1, (t,), generator=torch.Generator().manual_seed(3))
        ti = torch.stack([torch.full((t,), 3), other + (other >= 3).long()], 1)
    out = K.fp8_experts_nki(x, tw, ti, experts, simulate)
    model = fp8_experts(x, tw, ti, experts)
    assert out.dtype == model.dtype == dtype and out.shape == model.shape
    diff = (out.float() - model.float()).abs()
    assert torch.all(diff <= _model_bound(x, tw, ti, experts, model))
    # Flips are the exception (a systematic rounding error would also stay within one step): most tokens agree
    # to fp32 rounding (and the output dtype's).
    fp32_tol = 1e-5 * model.float().abs().max() + (model.float().abs() * 2.0**-8 if dtype == torch.bfloat16 else 0)
    assert int((diff > fp32_tol).any(1).sum()) <= max(1, t // 4)
    if name == "random_some_empty":
        assert int(K.expert_blocks(tw, ti, e).active.sum()) < min(e, t * k)  # some blocks are empty

    if t <= K.MAX_TOKENS:  # the kernel alone, its fp32 output against the torch path's before the cast to x.dtype
        blk = K.expert_blocks(tw, ti, e)
        ref = fp8_experts(x.float(), tw, ti, experts)  # x's codes and scales are those of x.float()
        raw = simulate(K.fp8_experts_kernel)(x, *blk[:3], *experts)
        assert raw.dtype == torch.float32 and torch.all((raw - ref).abs() <= _model_bound(x, tw, ti, experts, ref))


def test_expert_parallel_ranks_skip_other_ranks_experts() -> None:
    """Expert parallelism: each of two ranks holds half the stack and sees the other's ids as -1. Each rank's torch
    path equals the whole stack's with the other experts' routing weights zeroed, its kernel agrees with it as for a
    whole stack (token 0 has no expert on rank 1: zeros there), and the two ranks sum to the single-rank result (what
    the all-reduce adds)."""
    t, e, k, hd, inter = 6, 8, 2, 256, 256
    experts = _experts(21, e, hd, inter)
    x = torch.randn(t, hd, generator=torch.Generator().manual_seed(22)) * 2
    tw, ti = _routing(23, t, e, k)
    ti[0] = torch.tensor([0, 1])  # token 0: both experts on rank 0, none on rank 1
    total = torch.zeros(t, hd)
    for r in range(2):
        own = torch.arange(e) // (e // 2) == r
        ids = torch.where(own, torch.cumsum(own, 0) - 1, -1)[ti]
        mine = ExpertWeights(*(w[own] for w in experts))
        model = fp8_experts(x, tw, ids, mine)
        masked = tw * own[ti]
        assert torch.equal(model, fp8_experts(x, masked, ti, experts))
        out = K.fp8_experts_nki(x, tw, ids, mine, simulate, all_local=False)
        assert torch.all((out - model).abs() <= _model_bound(x, masked, ti, experts, model))
        if r == 1:
            assert torch.equal(out[0], torch.zeros(hd)) and torch.equal(model[0], torch.zeros(hd))
        total += model
    whole = fp8_experts(x, tw, ti, experts)
    assert torch.allclose(total, whole, rtol=0, atol=1e-5 * float(whole.abs().max()))


def test_each_token_equals_its_single_token_run() -> None:
    """Per-token scales make tokens independent: every batch size 1..32 gives each token its single-token result."""
    e, k, hd, inter = 8, 2, 256, 256
    experts = _experts(11, e, hd, inter)
    x = torch.randn(32, hd, generator=torch.Generator().manual_seed(12)) * 2
    tw, ti = _routing(13, 32, e, k)
    run = simulate(K.fp8_experts_kernel)

    def call(sl: slice) -> torch.Tensor:
        blk = K.expert_blocks(tw[sl], ti[sl], e)
        return run(x[sl].contiguous(), *blk[:3], *experts)

    single = torch.cat([call(slice(i, i + 1)) for i in range(32)])
    for n in range(1, 33):
        assert torch.equal(call(slice(0, n)), single[:n]), n


@pytest.mark.parametrize("layout", ["tiled", "row-major"])
@pytest.mark.parametrize("lnc", [1, 2])
def test_empty_blocks_cost_no_weight_dma_and_counters_match_cost(lnc: int, layout: str) -> None:
    """Only the active blocks run (the block loop's trip count is their number, read at run time): every counter of
    each program equals `fp8_experts_cost` for that many experts, in either weight layout, at LNC=1 and LNC=2."""
    t, e, k, hd, inter = 6, 16, 2, 256, 512
    experts = _experts(21, e, hd, inter)
    if layout == "tiled":
        experts = experts.to_kernel_layout()
    x = torch.randn(t, hd, generator=torch.Generator().manual_seed(22))
    tw = torch.full((t, k), 0.5)
    for used in ([1, 4, 9, 12, 15], [0, 1, 2, 3, 5, 6, 8, 9, 10, 11]):
        ti = torch.tensor([[used[2 * i % len(used)], used[(2 * i + 1) % len(used)]] for i in range(t)])
        K.fp8_experts_nki(x, tw, ti, experts, simulate if lnc == 1 else lnc2)
        c = nki.last_counters()
        nb = min(e, t * k)
        cost = K.fp8_experts_cost(t, hd, inter, len(used), nb, x_itemsize=4, lnc=lnc, layout=layout)
        assert_counters_equal_cost(c, cost)
        assert c.instructions["fori_loop"] == lnc  # one block loop per program, entered once
        # the nb - len(used) empty blocks read nothing: all traffic is less than one more expert's weights
        assert c.dma_hbm_to_sbuf_bytes < (len(used) + 1) * 3 * inter * hd


# --- LNC=2, the kernel layout, compiled loops (issue 28) ---


@pytest.mark.parametrize("layout", ["tiled", "row-major"])
@pytest.mark.parametrize(("t", "e", "hd", "inter"), [(3, 8, 256, 512), (5, 4, 512, 256), (3, 4, 2048, 1024)])
def test_lnc2_and_the_kernel_layout_are_bit_identical(t: int, e: int, hd: int, inter: int, layout: str) -> None:
    """At LNC=2 each program computes the gate/up rows of its half of I, the two swap their halves of h (`sendrecv`),
    and each computes the down rows of its half of Hd and stores those features: every output bit equals the LNC=1
    launch's, in either weight layout, and the tiled layout's equal the row-major layout's. Catches a program that
    computes or stores the other's rows, a half of h not swapped (NaN from the unwritten half), and a layout whose
    tiles are read in another order."""
    experts = _experts(t * e, e, hd, inter)
    x = (torch.randn(t, hd, generator=torch.Generator().manual_seed(t)) * 2).to(torch.bfloat16)
    tw, ti = _routing(7, t, e, 2)
    blk = K.expert_blocks(tw, ti, e)
    weights = experts.to_kernel_layout() if layout == "tiled" else experts
    one = simulate(K.fp8_experts_kernel)(x, *blk[:3], *experts)
    two = lnc2(K.fp8_experts_kernel)(x, *blk[:3], *weights)
    c = nki.last_counters()
    assert torch.equal(one.view(torch.int32), two.view(torch.int32))
    cost = K.fp8_experts_cost(t, hd, inter, int(blk.active.sum()), len(blk.expert), 2, lnc=2, layout=layout)
    assert_counters_equal_cost(c, cost)
    ref = fp8_experts(x.float(), tw, ti, experts)
    assert torch.all((two - ref).abs() <= _model_bound(x, tw, ti, experts, ref))


def test_no_local_expert_at_lnc2() -> None:
    """Expert parallelism can leave a rank no routed token: zero blocks run on both programs (the block loop, its
    `sendrecv` included, is compiled but never entered) and the output is zeros."""
    experts = _experts(3, 4, 256, 256).to_kernel_layout()
    x = torch.randn(2, 256)
    ids = torch.full((2, 2), -1)
    out = K.fp8_experts_nki(x, torch.ones(2, 2), ids, experts, lnc2, all_local=False)
    assert torch.equal(out, torch.zeros(2, 256))
    c = nki.last_counters()
    assert c.instructions["fori_loop"] == 2 and "sendrecv" not in c.instructions and c.emitted["sendrecv"] == 2


def test_torch_path_reads_the_kernel_layout_bit_for_bit() -> None:
    """The loader stores FP8 stacks in the kernel layout (fp8_expert.to_kernel_layout); the model's torch path on it
    gives the row-major path's bits, and the layout round-trips exactly. Catches a tile transposed the wrong way."""
    experts = _experts(5, 6, 512, 256)
    tiled = experts.to_kernel_layout()
    assert tiled.kernel_layout and tiled.w13.shape == (6, 128, 4, 4, 128) and tiled.w2.shape == (6, 128, 4, 2, 128)
    for w, tw in ((experts.w13, tiled.w13), (experts.w2, tiled.w2)):
        assert torch.equal(from_kernel_layout(tw).view(torch.uint8), w.view(torch.uint8))
        e, p, rt, kt, j = 2, 17, 1, 1, 9
        assert tw[e, p, rt, kt, j].view(torch.uint8) == w[e, rt * 128 + j, kt * 128 + p].view(torch.uint8)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(6)).bfloat16()
    tw, ti = _routing(8, 9, 6, 2)
    got, want = fp8_experts(x, tw, ti, tiled), fp8_experts(x, tw, ti, experts)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(fp8_expert(x, tiled.expert(3)), fp8_expert(x, experts.expert(3)))


def test_loader_stores_the_kernel_layout_once() -> None:
    """`Fp8RowMoEMethod.process_weights_after_loading` (model_executors/mxfp4_fp8.py) rewrites each FP8 stack into
    the kernel layout once: called again (the Neuron path calls it after vLLM did) it changes nothing, and a stack
    not made of 128 x 128 tiles stays row-major. Catches a loader that leaves FP8 stacks row-major (the kernel
    would read them one byte per descriptor) or tiles a stack it cannot."""
    from types import SimpleNamespace

    from torch.nn import Parameter

    from vllm_trn_plugin.model_executors.mxfp4_fp8 import Fp8RowMoEMethod

    experts = _experts(9, 3, 256, 256)
    method = Fp8RowMoEMethod.__new__(Fp8RowMoEMethod)
    method.bf16_parts = {}
    names = ("w13_weight", "w13_weight_scale", "w13_bias_correction", "w2_weight", "w2_weight_scale",
             "w2_bias_correction")  # fmt: skip
    layer = SimpleNamespace(**{n: Parameter(w.clone(), requires_grad=False) for n, w in zip(names, experts)})
    method.process_weights_after_loading(layer)
    tiled = experts.to_kernel_layout()
    assert torch.equal(layer.w13_weight.view(torch.uint8), tiled.w13.view(torch.uint8))
    assert torch.equal(layer.w2_weight.view(torch.uint8), tiled.w2.view(torch.uint8))
    method.process_weights_after_loading(layer)
    assert torch.equal(layer.w13_weight.view(torch.uint8), tiled.w13.view(torch.uint8))
    odd = _experts(9, 2, 192, 256)  # 192 is not a whole number of 128-wide tiles
    layer = SimpleNamespace(**{n: Parameter(w.clone(), requires_grad=False) for n, w in zip(names, odd)})
    method.process_weights_after_loading(layer)
    assert layer.w13_weight.shape == odd.w13.shape and layer.w2_weight.shape == odd.w2.shape


EMITTED_CAP = 400  # the project's cap (docstring of test_compiled_program_does_not_grow_with_experts_or_tokens)


@pytest.mark.parametrize("layout", ["tiled", "row-major"])
def test_compiled_program_does_not_grow_with_experts_or_tokens(layout: str) -> None:
    """Emitted (compiled) instructions per program at Trinity-Mini's hidden 2048 / intermediate 1024 are the same for
    every expert count, routing and token count, at each LNC: the blocks are one `nl.fori_loop` (before: a Python
    loop over NB = min(E, T K) blocks, each unrolled) and the PSUM groups have a fixed width. Cap: 400 per program,
    the project's choice: 302 at LNC=1 (of which 192 matmuls, one per 256 x 128 weight tile: the expert body stays
    unrolled over its tiles), 185 at LNC=2; a second expert body unrolled exceeds it. Prints the counts."""
    hd, inter = 2048, 1024
    seen = {}
    for e, t, k in ((4, 1, 2), (8, 3, 2), (2, 5, 1)):
        experts = _experts(e, e, hd, inter)
        experts = experts.to_kernel_layout() if layout == "tiled" else experts
        tw, ti = _routing(e + t, t, e, k)
        blk = K.expert_blocks(tw, ti, e)
        x = torch.randn(t, hd).bfloat16()
        for lnc, runner in ((1, simulate), (2, lnc2)):
            runner(K.fp8_experts_kernel)(x, *blk[:3], *experts)
            c = nki.last_counters()
            seen[(e, t, lnc)] = [p.emitted_instructions for p in c.programs]
    print(f"\nFP8 experts ({layout}), emitted instructions per program by (E, T, LNC): {seen}")
    for lnc in (1, 2):
        counts = {n for (_, _, d), per in seen.items() if d == lnc for n in per}
        assert len(counts) == 1 and counts.pop() <= EMITTED_CAP, seen


def test_kernel_layout_reads_weights_in_long_runs() -> None:
    """At Trinity-Mini's geometry the tiled weights move in one run per partition and range (8 KiB and more):
    per active expert 2 descriptors per partition at LNC=1, 3 at LNC=2 instead of one per byte (6.3 M and 3.1 M
    per core), and the DMA engines' busy time per core is within 1.3x of the analytic minimum (all bytes once, every
    engine at full rate). Catches any weight read through the transposing row-major pattern."""
    hd, inter, e, t = 2048, 1024, 4, 3
    experts = _experts(1, e, hd, inter).to_kernel_layout()
    tw, ti = _routing(2, t, e, 2)
    blk = K.expert_blocks(tw, ti, e)
    a = int(blk.active.sum())
    x = torch.randn(t, hd).bfloat16()
    for lnc, runner in ((1, simulate), (2, lnc2)):
        runner(K.fp8_experts_kernel)(x, *blk[:3], *experts)
        c = nki.last_counters()
        cost = K.fp8_experts_cost(t, hd, inter, a, len(blk.expert), 2, lnc=lnc)
        for p in c.programs:
            assert p.dma_descriptors < a * (128 * (lnc + 1) + 200) + 400, p.dma_descriptors
            assert p.dma_transfer_ns <= 1.3 * cost["dma_time_min_ns"], (p.dma_transfer_ns, cost["dma_time_min_ns"])


def test_wrapper_refuses_weights_not_in_fp8() -> None:
    experts = _experts(1, 2, 256, 256)
    x = torch.randn(1, 256)
    tw, ti = torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="FP8"):
        K.fp8_experts_nki(x, tw, ti, experts._replace(w13=experts.w13.to(torch.bfloat16)), simulate)
