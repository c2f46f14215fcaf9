"""The FP8 numerics every quantized matrix uses (kernels/fp8_expert.py: fp8_linear, fp8_experts),
against float64 and ml_dtypes' Trainium2 FP8 (`float8_e4m3`), op by op, where no rounding flip can hide an error."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from vllm_trn_plugin.kernels.fp8_expert import ExpertWeights, fp8_experts, fp8_linear, quantize_per_token

E4M3 = ml_dtypes.float8_e4m3  # Trainium2's IEEE-style E4M3: max 240, NaN beyond


def ref_quantize(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """float64: s = amax / 240, q = RNE_e4m3(x / s) (a zero row: s = 1, q = 0)."""
    xd = x.double().numpy()
    amax = np.abs(xd).max(-1, keepdims=True)
    s = np.where(amax > 0, amax / 240.0, 1.0)
    return (xd / s).astype(E4M3).astype(np.float64), s[:, 0]


@pytest.mark.parametrize("scale", [1e-3, 1.0, 37.0])
def test_quantize_per_token_is_rne_e4m3_with_amax_scale(scale: float) -> None:
    g = torch.Generator().manual_seed(int(scale * 1000))
    x = torch.randn(64, 512, generator=g) * scale
    x[3] = 0  # a zero row
    x[5, 7] = -x[5].abs().max() * 1.5  # negative amax
    xq, s_tok = quantize_per_token(x)
    q_ref, s_ref = ref_quantize(x)
    q = xq.double().numpy()
    assert np.all(np.abs(q) <= 240) and not np.isnan(q).any()
    nz = np.arange(64) != 3
    # s_tok = amax * fp32(1 / 240): within one float32 ulp of amax / 240
    assert np.allclose(s_tok.double().numpy()[nz], s_ref[nz], rtol=2**-23, atol=0)
    assert (q[3] == 0).all() and float(s_tok[3]) > 0  # a zero row: codes 0 whatever its (floored) scale
    # The op multiplies by 240 * fp32(1 / amax) in float32, the reference divides in float64: they may only disagree
    # on an input that sits within float32 rounding of an FP8 midpoint, and then by one FP8 step.
    diff = q != q_ref
    assert diff.mean() < 1e-4, diff.mean()
    if diff.any():
        y = (x.double().numpy() / s_ref[:, None])[diff]
        step = np.abs(q - q_ref)[diff]
        assert np.all(step <= 2.0 ** (np.floor(np.log2(np.abs(y))) - 3) * 1.0001)


def test_fp8_linear_scales_apply_to_the_accumulator() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(17, 256, generator=g)
    w = (torch.randn(96, 256, generator=g) * 40).clamp(-240, 240).to(torch.float8_e4m3fn)
    s_row = torch.exp2(torch.randint(-12, -4, (96,), generator=g).float())
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    y = fp8_linear(x, w, s_row, bias)
    q, s = ref_quantize(x)
    ref = (q @ w.double().numpy().T) * s[:, None] * s_row.double().numpy()[None, :] + bias.double().numpy()
    ok = (quantize_per_token(x)[0].double().numpy() == q).all(1)  # rows without a rounding flip
    assert ok.sum() >= 16
    np.testing.assert_allclose(y.double().numpy()[ok], ref[ok], rtol=2e-6, atol=2e-6 * np.abs(ref).max())
    assert y.dtype == torch.float32 and y.shape == (17, 96)


def random_routed_experts(
    seed: int, E: int, H: int, I: int, T: int, K: int
) -> tuple[ExpertWeights, torch.Tensor, torch.Tensor, torch.Tensor]:
    """E random FP8 experts (row-major), and T tokens x [T, H] each routed to K distinct experts with random weights:
    (experts, x, topk_weights, topk_ids)."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 30).to(torch.float8_e4m3fn)
    w2 = (torch.randn(E, H, I, generator=g) * 30).to(torch.float8_e4m3fn)
    s13, s2 = torch.rand(E, 2 * I, generator=g) * 1e-2, torch.rand(E, H, generator=g) * 1e-2
    b13, b2 = torch.randn(E, 2 * I, generator=g) * 0.1, torch.randn(E, H, generator=g) * 0.1
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    wts = torch.rand(T, K, generator=g)
    return ExpertWeights(w13, s13, b13, w2, s2, b2), x, wts, ids


def test_fp8_experts_route_weight_and_sum() -> None:
    """Each token's output is sum_k w_k * down_e(SiLU(gate_e x) * up_e x) over its own experts: checked against the
    per-token composition of fp8_linear (whose numerics are checked above); a wrong expert, weight or order
    would be off by O(1)."""
    E, H, I, T, K = 6, 128, 64, 9, 2
    experts, x, wts, ids = random_routed_experts(2, E, H, I, T, K)
    w13, s13, b13, w2, s2, b2 = experts
    out = fp8_experts(x, wts, ids, experts)
    for t in range(T):
        want = torch.zeros(H)
        for k in range(K):
            e = int(ids[t, k])
            gate, up = fp8_linear(x[t : t + 1], w13[e], s13[e], b13[e]).chunk(2, -1)
            want += wts[t, k] * fp8_linear(torch.nn.functional.silu(gate) * up, w2[e], s2[e], b2[e])[0]
        torch.testing.assert_close(out[t], want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))


def _integer_operands(t: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [t, k] and an FP8 weight [n, k] whose products and every partial sum are exact in float32 (integers |v| <=
    16, one 240 per row: each row quantizes with scale 1 to itself), so any accumulation order gives the float64
    sum bit for bit and a path that rounds a product or an operand shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-16, 17, (t, k), generator=g).float()
    x[:, 0] = 240.0
    w = torch.randint(-16, 17, (n, k), generator=g).float()
    w[:, 1] = -240.0
    return x, w.to(torch.float8_e4m3fn)


def _every_fp8_value() -> torch.Tensor:
    """The 253 finite E4M3FN values with |v| <= 240 (the packed range), subnormals and both zeros included."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    return v[v.float().abs() <= 240]


@pytest.mark.parametrize("path", ["compute copy", "fp32 copy", "fp8 only (row chunks)", "FP8 GEMM (_scaled_mm)"])
def test_fp8_products_exact_on_every_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way the FP8 x FP8 products are computed (fp8_expert.fp8_matmul: the CPU's compute copy made at load,
    FBGEMM's fp16 form where FBGEMM runs; an fp32 copy; FP8-only residency, converting row chunks per call; torch's
    FP8 GEMM, the graph form on a device) gives the float64 products bit for bit: on sums exact in fp32, and on
    every E4M3 value once (an fp16 copy that rounded a subnormal, or a bf16 path, would fail)."""
    from vllm_trn_plugin.kernels import fp8_expert as f

    monkeypatch.setattr(f, "_CHUNK_ELEMS", 7 * 256)  # several chunks and a short last one below

    def products(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if path == "compute copy":
            return f.fp8_matmul(xq, w, f.fp8_compute_copy(w))
        if path == "fp32 copy":
            return f.fp8_matmul(xq, w, w.float())
        if path == "fp8 only (row chunks)":
            return f.fp8_matmul(xq, w)
        return f.scaled_mm_products(xq, w)

    x, w = _integer_operands(5, 96, 256, seed=3)
    xq, s_tok = quantize_per_token(x)
    assert torch.equal(s_tok, torch.ones(5)) and torch.equal(xq.float(), x)
    got = products(xq, w)
    assert got.dtype == torch.float32 and torch.equal(got.double(), x.double() @ w.double().t())

    v = _every_fp8_value()  # one weight row per value, against activations 240 and 2^-9 (the extremes)
    w = torch.zeros(v.numel(), 256, dtype=torch.float8_e4m3fn)
    w[:, 0], w[:, 1] = v, v
    xq = torch.zeros(2, 256)
    xq[0, 0], xq[1, 1] = 240.0, 2.0**-9
    got = products(xq.to(torch.float8_e4m3fn), w)
    assert torch.equal(got.double(), xq.double() @ w.double().t())


def test_fp8_linear_from_its_compute_copy_equals_the_definition() -> None:
    """fp8_linear with the weight's compute copy (what a CPU layer computes with), row scales and a bias: the float64
    definition, bit for bit on operands whose sums are exact (power-of-two row scales, a bias exact in fp32)."""
    from vllm_trn_plugin.kernels.fp8_expert import fp8_compute_copy

    x, w = _integer_operands(9, 64, 256, seed=4)
    s_row = torch.exp2(torch.randint(-12, -4, (64,))).float()
    bias = torch.randint(-8, 9, (64,)).float() / 4
    y = fp8_linear(x, w, s_row, bias, fp8_compute_copy(w))
    ref = (x.double() @ w.double().t()) * s_row.double() + bias.double()
    assert torch.equal(y.double(), ref)


def test_fp8_experts_with_compute_copies_equal_without() -> None:
    """The routed experts from their compute copies (made once from the kernel-layout stacks, as the MoE layer holds
    them) equal the same experts converting their weights per call, token for token."""
    from vllm_trn_plugin.kernels.fp8_expert import expert_compute_copies, to_kernel_layout

    E = 4
    plain, x, wts, ids = random_routed_experts(5, E, 256, 128, 11, 2)
    tiled = plain._replace(w13=to_kernel_layout(plain.w13), w2=to_kernel_layout(plain.w2))
    copies = expert_compute_copies(tiled)
    assert copies is not None and len(copies[0]) == len(copies[1]) == E
    want = fp8_experts(x, wts, ids, plain)
    torch.testing.assert_close(fp8_experts(x, wts, ids, tiled, copies), want, rtol=1e-6, atol=1e-6)


def test_fp8_residency_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_TRN_FP8_RESIDENCY: `copy` (the default) gives a CPU layer its compute copy, `fp8` none (the layer then
    converts row chunks per call), anything else is refused naming the variable."""
    from vllm_trn_plugin.model_executors.mxfp4_fp8 import compute_copy

    w = torch.ones(32, 64).to(torch.float8_e4m3fn)
    monkeypatch.delenv("VLLM_TRN_FP8_RESIDENCY", raising=False)
    assert compute_copy(w) is not None
    monkeypatch.setenv("VLLM_TRN_FP8_RESIDENCY", "fp8")
    assert compute_copy(w) is None
    monkeypatch.setenv("VLLM_TRN_FP8_RESIDENCY", "bf16")
    with pytest.raises(ValueError, match="VLLM_TRN_FP8_RESIDENCY='bf16'"):
        compute_copy(w)
