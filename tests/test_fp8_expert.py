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


def test_fp8_experts_route_weight_and_sum() -> None:
    """Each token's output is sum_k w_k * down_e(SiLU(gate_e x) * up_e x) over its own experts: checked against the
    per-token composition of fp8_linear (whose numerics are checked above); a wrong expert, weight or order
    would be off by O(1)."""
    g = torch.Generator().manual_seed(2)
    E, H, I, T, K = 6, 128, 64, 9, 2
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 30).to(torch.float8_e4m3fn)
    w2 = (torch.randn(E, H, I, generator=g) * 30).to(torch.float8_e4m3fn)
    s13, s2 = torch.rand(E, 2 * I, generator=g) * 1e-2, torch.rand(E, H, generator=g) * 1e-2
    b13, b2 = torch.randn(E, 2 * I, generator=g) * 0.1, torch.randn(E, H, generator=g) * 0.1
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    wts = torch.rand(T, K, generator=g)
    out = fp8_experts(x, wts, ids, ExpertWeights(w13, s13, b13, w2, s2, b2))
    for t in range(T):
        want = torch.zeros(H)
        for k in range(K):
            e = int(ids[t, k])
            gate, up = fp8_linear(x[t : t + 1], w13[e], s13[e], b13[e]).chunk(2, -1)
            want += wts[t, k] * fp8_linear(torch.nn.functional.silu(gate) * up, w2[e], s2[e], b2[e])[0]
        torch.testing.assert_close(out[t], want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
