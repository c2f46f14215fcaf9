"""FP8 x FP8 matmul with fp32 accumulation: the numerics of every quantized matrix (MLPs, experts, LM head).

Weights arrive as Trainium2 FP8 (E4M3, |w| <= 240) with one float32 scale per output row (from the
exact MXFP4 expansion, or the FP8 LM head). Activations are quantized per token, inside the op:

    amax_t = max_k |x[t, k]|                       (x in float32)
    s_tok  = amax_t / 240,   xq[t] = RNE_e4m3(x[t] * (240 / amax_t))     (a zero row: s_tok = 1, xq = 0)
    y[t, n] = (sum_k xq[t, k] * wq[n, k]) * s_tok[t] * s_row[n] + b[n]

The products of two E4M3 values carry at most 8 significant bits, so each is exact in float32;
only the fp32 accumulation rounds (and its order is the device's, not part of the contract). The
scales are applied to the accumulator's output in the order written, then the bias, all in
float32. The result stays float32; callers cast.

On CPU the fastest exact path is torch's float32 matmul on the FP8 values upcast (exactly) to
float32: there is no FP8 GEMM on this host, and the upcast of a weight matrix is cheaper than any
emulation. On Trainium the same math runs on TensorE in double-row FP8 mode (kernels/ NKI issue).
"""

from __future__ import annotations

import torch

FP8_MAX = 240.0  # Trainium2 E4M3 (IEEE-style, bias 7): largest finite value
FP8_DTYPE = torch.float8_e4m3fn  # carries Trainium2's values bit for bit for |x| <= 240


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq float8_e4m3fn [T, K] with |xq| <= 240, s_tok float32 [T])."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    nonzero = amax > 0
    inv = torch.where(nonzero, FP8_MAX / torch.where(nonzero, amax, 1.0), 1.0)
    # x * (240 / amax) can round up past 240 by one ulp of float32; E4M3 rounds that back to 240.
    xq = (xf * inv[:, None]).to(FP8_DTYPE)
    return xq, torch.where(nonzero, amax / FP8_MAX, 1.0)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = (Q(x) @ weight^T) * s_tok[:, None] * row_scale[None, :] + bias, float32 [T, N].

    x [T, K] any float dtype; weight float8_e4m3fn [N, K]; row_scale float32 [N]; bias [N] or None.
    """
    xq, s_tok = quantize_per_token(x)
    acc = xq.float() @ weight.float().t()
    y = acc * s_tok[:, None] * row_scale[None, :]
    return y if bias is None else y + bias.float()
