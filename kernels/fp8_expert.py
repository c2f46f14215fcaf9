"""FP8 x FP8 matmul with fp32 accumulation: the numerics of every quantized matrix (MLPs, experts, LM head),
and MLA-Trinity's routed FP8 experts built on it.

Weights arrive as Trainium2 FP8 (E4M3, |w| <= 240) with one float32 scale per output row (from the
exact MXFP4 expansion, or the FP8 LM head). Activations are quantized per token, inside the op:

    a_t    = max(max_k |x[t, k]|, 2^-100)                 (x in float32)
    s_tok  = a_t * fp32(1 / 240),   xq[t] = RNE_e4m3(clamp(x[t] * (240 * fp32(1 / a_t)), -240, 240))
    y[t, n] = (sum_k xq[t, k] * wq[n, k]) * s_tok[t] * s_row[n] + b[n]

each step rounded to float32. This is the FP8 expert kernel's formula (kernels/fp8_expert_nki.py):
Trainium's ALUs have a reciprocal but no divide, so 240 / a and a / 240 become products with
reciprocals (within an ulp of the quotients), and the torch path computes the same, so CPU and device
quantize bit for bit. The floor keeps 240 / a finite (a zero row: codes 0, product 0); the clamp
keeps a value one ulp past 240 from reaching an FP8 write, whose overflow behaviour is undocumented.

The products of two E4M3 values carry at most 8 significant bits, so each is exact in float32;
only the fp32 accumulation rounds (and its order is the device's, not part of the contract). The
scales are applied to the accumulator's output in the order written, then the bias, all in
float32. The result stays float32; callers cast.

On CPU the fastest exact path is torch's float32 matmul on the FP8 values upcast (exactly) to
float32: there is no FP8 GEMM on this host, and the upcast of a weight matrix is cheaper than any
emulation. On Trainium the same math runs on TensorE in double-row FP8 mode (fp8_expert_nki.py).

Where each form lives: this module is the definition and the torch path at once (plain torch, no tiling):
`fp8_expert` is one expert's MLP and `fp8_experts` the routed sum over a layer's experts; the tests compare
the NKI kernel (fp8_expert_nki.py: kernel, host wrapper, cost formula) against them, and these against
float64 and ml_dtypes' FP8 (tests/test_fp8_expert.py). `dispatch.fp8_experts` picks the torch path or the
kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_MAX = 240.0  # Trainium2 E4M3 (IEEE-style, bias 7): largest finite value
FP8_DTYPE = torch.float8_e4m3fn  # carries Trainium2's values bit for bit for |x| <= 240
AMAX_FLOOR = 2.0**-100  # 240 / AMAX_FLOOR is finite and AMAX_FLOOR / 240 a normal float32
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))  # fp32(1 / 240), as the ALU holds it


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq float8_e4m3fn [T, K] with |xq| <= 240, s_tok float32 [T]), as in the module docstring."""
    xf = x.float()
    a = xf.abs().amax(-1).clamp_min(AMAX_FLOOR)
    inv = (1.0 / a) * FP8_MAX
    xq = (xf * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, a * INV_FP8_MAX


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


def row_linear(
    x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """fp8_linear for FP8 weights; for a weight held in bf16 (VLLM_TRN_ALLOW_BF16) the same formula unquantized."""
    if weight.dtype == FP8_DTYPE:
        return fp8_linear(x, weight, row_scale, bias)
    y = (x.float() @ weight.float().t()) * row_scale[None, :]
    return y if bias is None else y + bias.float()


TILE = 128  # the kernel's tile edge: SBUF partitions, and rows per matmul tile


def to_kernel_layout(w: torch.Tensor) -> torch.Tensor:
    """An expert stack [E, R, K] in the FP8 kernel's layout, "K-major tiles" [E, 128, R/128, K/128, 128]:
    t[e, p, rt, kt, j] = w[e, rt*128 + j, kt*128 + p] (a copy; R and K multiples of 128).

    The kernel puts the contraction index k on the 128 partitions: partition p needs w[e, r, kt*128 + p] for every
    row r of its tiles. Row-major, that is one byte every K bytes (a transposing, 1-byte-granular DMA); here it is
    one contiguous run per partition, R_tiles * K bytes for any range of R_tiles consecutive row tiles
    (kernels/fp8_expert_nki.py)."""
    E, R, K = w.shape
    if R % TILE or K % TILE:
        raise ValueError(f"to_kernel_layout: [{E}, {R}, {K}] is not made of {TILE} x {TILE} tiles")
    return w.reshape(E, R // TILE, TILE, K // TILE, TILE).permute(0, 4, 1, 3, 2).contiguous()


def from_kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """`to_kernel_layout`'s inverse, for a stack [E, 128, R/128, K/128, 128] or one expert [128, R/128, K/128, 128]:
    the row-major [E, R, K] / [R, K] (a copy; exact, the same bytes moved)."""
    lead = t.shape[:-4]
    p, rt, kt, j = t.shape[-4:]
    n = len(lead)
    dims = tuple(range(n)) + (n + 1, n + 3, n + 2, n)
    return t.permute(dims).reshape(*lead, rt * j, kt * p)


def in_kernel_layout(w: torch.Tensor, stack: bool = True) -> bool:
    """Whether an expert stack (or one expert's matrix, `stack=False`) is held in `to_kernel_layout`'s layout."""
    return w.dim() == (5 if stack else 4)


class ExpertWeights(NamedTuple):
    """A layer's routed experts: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], FP8 (or bf16, the
    VLLM_TRN_ALLOW_BF16 opt-in), each with fp32 row scales s13 [E, 2I], s2 [E, H] and biases b13, b2 alike.

    An FP8 stack may be held in the kernel's layout (`to_kernel_layout`: w13 [E, 128, 2I/128, H/128, 128], w2
    [E, 128, H/128, I/128, 128]), as the loader stores them (model_executors/mxfp4_fp8.py); scales and biases stay
    [E, rows]. Every function here reads either layout, with the same result bit for bit."""

    w13: torch.Tensor
    s13: torch.Tensor
    b13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    b2: torch.Tensor

    def expert(self, e: int) -> ExpertWeights:
        """Expert e's matrices, scales and biases (the leading dimension dropped; the layout kept)."""
        return ExpertWeights(*(t[e] for t in self))

    @property
    def fp8(self) -> bool:
        """Both matrices in FP8 (what the NKI kernel takes)."""
        return self.w13.dtype == FP8_DTYPE and self.w2.dtype == FP8_DTYPE

    @property
    def kernel_layout(self) -> bool:
        """Both stacks held in `to_kernel_layout`'s layout."""
        return in_kernel_layout(self.w13) and in_kernel_layout(self.w2)

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def to_kernel_layout(self) -> ExpertWeights:
        """These experts with both matrices in the kernel's layout (copies; already so: unchanged)."""
        if self.kernel_layout:
            return self
        return self._replace(w13=to_kernel_layout(self.w13), w2=to_kernel_layout(self.w2))

    def row_major(self) -> ExpertWeights:
        """These experts (a stack, or one expert) with both matrices row-major (copies where they were tiled)."""
        stack = self.s13.dim() == 2
        w13, w2 = (from_kernel_layout(w) if in_kernel_layout(w, stack) else w for w in (self.w13, self.w2))
        return self._replace(w13=w13, w2=w2)


def fp8_expert(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """One expert (`w` without the expert dimension, either layout) on every row of x [T, H]: y float32 [T, H] =
    down(SiLU(gate(x)) * up(x)), each projection a `row_linear` (every product FP8 for FP8 weights). A tiled
    matrix is made row-major first (an exact copy), so both layouts give the same bits."""
    w = w.row_major()
    gate, up = row_linear(x, w.w13, w.s13, w.b13).chunk(2, dim=-1)
    return row_linear(torch.nn.functional.silu(gate) * up, w.w2, w.s2, w.b2)


def fp8_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: ExpertWeights
) -> torch.Tensor:
    """Routed experts, torch path: sum_k topk_weights[t, k] * fp8_expert(x_t, experts[e]), e = topk_ids[t, k].

    Experts are visited in ascending order (the NKI kernel's order). An id < 0 is an expert this rank does not
    hold (expert parallelism): it adds nothing here. Returns x.dtype [T, H].
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        if e < 0:
            continue
        tok, k = (topk_ids == e).nonzero(as_tuple=True)
        y = fp8_expert(x[tok], experts.expert(e))
        out.index_add_(0, tok, y * topk_weights[tok, k, None].float())
    return out.to(x.dtype)
