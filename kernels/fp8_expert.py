"""MLA-Trinity's routed FP8 experts on the FP8 format of kernels/fp8.py: one expert's MLP (`fp8_expert`), the
routed sum over a layer's experts (`fp8_experts`), and the kernel's weight layout.

This module is the definition and the torch path at once (plain torch, no tiling); the tests compare the NKI kernel
(fp8_expert_nki.py: kernel, host wrapper, cost formula) against it, and it against float64 and ml_dtypes' FP8
(tests/test_fp8_expert.py). `dispatch.fp8_experts` picks the torch path or the kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_trn_plugin.kernels import fp8_cpu
from vllm_trn_plugin.kernels.fp8 import FP8_DTYPE, fp8_compute_copy, fp8_matmul, quantize_per_token, row_linear

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


def fp8_expert(
    x: torch.Tensor, w: ExpertWeights, compute: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """One expert (`w` without the expert dimension, either layout) on every row of x [T, H]: y float32 [T, H] =
    down(SiLU(gate(x)) * up(x)), each projection a `row_linear` (every product FP8 for FP8 weights). With the
    compute copies of its row-major w13 and w2 (`expert_compute_copies`) the products come from them; without, a
    tiled matrix is made row-major first (an exact copy), so both layouts give the same products."""
    c13, c2 = compute if compute is not None else (None, None)
    if compute is None:
        w = w.row_major()
    gate, up = row_linear(x, w.w13, w.s13, w.b13, c13).chunk(2, dim=-1)
    return row_linear(torch.nn.functional.silu(gate) * up, w.w2, w.s2, w.b2, c2)


def expert_compute_copies(experts: ExpertWeights) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """Each expert's `fp8_compute_copy` of its row-major w13 and w2 (made once, at load), or None where a matrix has
    none (off the CPU)."""
    w = experts.row_major()
    c13 = [fp8_compute_copy(m) for m in w.w13]
    c2 = [fp8_compute_copy(m) for m in w.w2]
    return None if any(c is None for c in c13 + c2) else (c13, c2)


def fp8_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: ExpertWeights,
    compute: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Routed experts, torch path: sum_k topk_weights[t, k] * fp8_expert(x_t, experts[e]), e = topk_ids[t, k].

    Each token's terms are added in ascending expert order (the NKI kernel's order). An id < 0 is an expert this
    rank does not hold (expert parallelism): it adds nothing here. `compute`: `expert_compute_copies(experts)`, or
    None. Returns x.dtype [T, H].

    The (token, expert) pairs are computed together, sorted by expert: the per-token quantization, scales, biases
    and SiLU are row-wise, so doing them once over all pairs gives each pair's `fp8_expert` values bit for bit, and
    only the products run per expert. A decode step then costs a few dozen torch ops, not a few dozen per expert.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1)
    pairs = (flat >= 0).nonzero().squeeze(1)
    if pairs.numel() == 0:
        return out.to(x.dtype)
    pairs = pairs[torch.sort(flat[pairs], stable=True).indices]  # by expert, then token
    tok, e_of = pairs // topk_ids.shape[1], flat[pairs].long()
    ids, counts = torch.unique_consecutive(e_of, return_counts=True)
    spans = list(zip(ids.tolist(), torch.cumsum(counts, 0).tolist(), strict=True))

    def linear(
        rows: torch.Tensor,
        w: torch.Tensor,
        c: list[torch.Tensor] | None,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """row_linear of each expert's rows (`rows` sorted by expert), every row's own expert's matrix."""
        fp8 = w.dtype == FP8_DTYPE
        xq, s_tok = quantize_per_token(rows) if fp8 else (rows.float(), None)
        if fp8 and c is not None and c[0].dtype == torch.bfloat16:  # the AVX-512 BF16 kernel: every expert at once
            used = [e for e, _ in spans]
            return fp8_cpu.products(
                xq, [c[e] for e in used], scale.shape[-1], [0] + [end for _, end in spans], s_tok=s_tok,
                row_scale=[scale[e] for e in used], bias=None if bias is None else [bias[e] for e in used],
            )  # fmt: skip
        acc = torch.empty(rows.shape[0], scale.shape[-1], dtype=torch.float32, device=rows.device)
        start = 0
        for e, end in spans:
            copy = None if c is None else c[e]
            m = w[e] if copy is not None or w.dim() == 3 else from_kernel_layout(w[e])
            if fp8:
                acc[start:end] = fp8_matmul(xq[start:end], m, copy)
            else:
                acc[start:end] = xq[start:end] @ (m.float() if copy is None else copy).t()
            start = end
        y = acc * s_tok[:, None] * scale[e_of] if fp8 else acc * scale[e_of]
        return y if bias is None else y + bias[e_of].float()

    c13, c2 = compute if compute is not None else (None, None)
    gate, up = linear(x[tok], experts.w13, c13, experts.s13, experts.b13).chunk(2, dim=-1)
    y = linear(torch.nn.functional.silu(gate) * up, experts.w2, c2, experts.s2, experts.b2)
    out.index_add_(0, tok, y * topk_weights.reshape(-1)[pairs, None].float())  # index order: experts ascending
    return out.to(x.dtype)
