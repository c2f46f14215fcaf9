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

Where the FP8 x FP8 products are computed (`fp8_matmul`), never by converting a weight per call:
- CPU: a compute copy made once at load (`fp8_compute_copy`), 2 bytes per weight: on CPUs with AVX-512 BF16 a
  packed bf16 copy that kernels/fp8_cpu.py multiplies with bf16 dot products into fp32; elsewhere FBGEMM's
  fp16 copy (every E4M3 value is an fp16 value), which FBGEMM multiplies by fp32 activations with fp32 accumulation.
  Products exact, as above, either way. Where neither runs, an fp32 copy (4 bytes per weight). torch has no CPU
  GEMM that reads FP8 or returns fp32 from bf16 operands (`_scaled_mm` on CPU converts per call: docs/fp8.md has
  the measurements). A
  layer without a copy (the FP8-only residency opt-in) converts its weight in bounded row chunks per call.
- GPU (and the Neuron graph): `torch._scaled_mm` on the FP8 operands with unit scales and an fp32 output: the
  hardware's FP8 GEMM, the same products and fp32 accumulation; the scales are applied here, in the order written.
- Trainium's FP8 experts: TensorE in double-row FP8 mode (fp8_expert_nki.py).

Where each form lives: this module is the definition and the torch path at once (plain torch, no tiling):
`fp8_expert` is one expert's MLP and `fp8_experts` the routed sum over a layer's experts; the tests compare
the NKI kernel (fp8_expert_nki.py: kernel, host wrapper, cost formula) against them, and these against
float64 and ml_dtypes' FP8 (tests/test_fp8_expert.py). `dispatch.fp8_experts` picks the torch path or the
kernel.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from vllm_trn_plugin.kernels import fp8_cpu

FP8_MAX = 240.0  # Trainium2 E4M3 (IEEE-style, bias 7): largest finite value
FP8_DTYPE = torch.float8_e4m3fn  # carries Trainium2's values bit for bit for |x| <= 240
AMAX_FLOOR = 2.0**-100  # 240 / AMAX_FLOOR is finite and AMAX_FLOOR / 240 a normal float32
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))  # fp32(1 / 240), as the ALU holds it


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq float8_e4m3fn [T, K] with |xq| <= 240, s_tok float32 [T]), as in the module docstring. On
    CPU one compiled pass computes the same bits (fp8_cpu.quantize) where it applies."""
    fast = fp8_cpu.quantize(x, AMAX_FLOOR, INV_FP8_MAX) if x.device.type == "cpu" else None
    if fast is not None:
        return fast
    xf = x.float()
    a = xf.abs().amax(-1).clamp_min(AMAX_FLOOR)
    inv = (1.0 / a) * FP8_MAX
    xq = (xf * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, a * INV_FP8_MAX


FP8_E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value (fp8_to_float32's NaN codes come out beyond it)
# Below this many codes torch's own conversion is faster than fp8_to_float32's fixed cost of a few passes (measured on
# a 2-core CPU: 8 vs 73 us at 1k codes, 145 vs 83 us at 32k)
_FAST_FP8_MIN = 1 << 14


def fp8_to_float32(
    codes: torch.Tensor, out: torch.Tensor | None = None, *, work: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 values of float8_e4m3fn codes, bit for bit those of `codes.float()` (the NaN codes 0x7F / 0xFF
    included), written into `out` (contiguous fp32, codes' shape) when given; `work`: a reusable int16 buffer of at
    least codes.numel() elements (else one is allocated).

    On CPU torch converts FP8 one element at a time in software (about 5 ns a code: 40-60 ms for a 32k x 256
    history, on every decode step). Here the conversion is a few vectorised passes instead (about 3x faster on a
    whole history, about 10x on a cache-resident 2048-key decode tile, measured on a 2-core CPU host):
    an E4M3 code (exponent bias 7) is an IEEE half (bias 15) once its sign moves to bit 15 and its exponent and
    mantissa 7 bits up, with the value scaled by 2^-8 (subnormal codes land on half subnormals, step 2^-17 = 2^-9 x
    2^-8); half -> fp32 is exact and so is the x 256 after it. Only the NaN codes come out wrong (as +-480, out of
    E4M3's +-448 range), so a min/max pass finds them and they are rewritten (a cache the quantizer wrote has none).
    Other devices convert natively."""
    if codes.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_to_float32 takes {FP8_DTYPE} codes, got {codes.dtype}")
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    elif out.dtype != torch.float32 or out.shape != codes.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {tuple(codes.shape)}")
    if codes.device.type != "cpu" or codes.numel() < _FAST_FP8_MIN:
        return out.copy_(codes)
    if work is None:
        work = torch.empty(codes.numel(), dtype=torch.int16, device=codes.device)
    half = work[: codes.numel()].view(codes.shape)
    half.copy_(codes.view(torch.int8))  # sign-extending: a negative code 0x80 | m reads m - 128
    # (m - 128) x 128 = 0xC000 | m << 7 as int16: clearing bit 14 leaves the sign bit and m << 7 (a multiply, not a
    # shift: no overflow, |s| x 128 <= 2^14, so nothing implementation-defined about shifting negatives).
    half.mul_(128).bitwise_and_(~0x4000)
    out.copy_(half.view(torch.float16)).mul_(256.0)
    lo, hi = torch.aminmax(out)
    if bool(hi > FP8_E4M3_MAX) or bool(lo < -FP8_E4M3_MAX):
        nan = out.abs() > FP8_E4M3_MAX
        out[nan] = codes[nan].float()  # torch's own NaN bit patterns (0x7FF00000 for 0x7F), as `codes.float()` has
    return out


_CHUNK_ELEMS = 1 << 22  # weight elements converted at a time without a compute copy: a 16 MB fp32 temporary


def _fbgemm_fp16() -> bool:
    """Whether this torch has FBGEMM's fp16-weight GEMM and it computes FP8 products exactly (probed once)."""
    global _FBGEMM_OK
    if _FBGEMM_OK is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated in torch's Python API, still its fastest exact CPU GEMM
                # dtype spelled out: vLLM loads weights under its model dtype as torch's default
                w = torch.tensor([[2.0**-9, 240.0], [-1.5, 2.0**-6]], dtype=torch.float32)
                x = torch.tensor([[2.0**-9, 240.0]], dtype=torch.float32)
                got = torch.fbgemm_linear_fp16_weight_fp32_activation(x, torch.fbgemm_pack_gemm_matrix_fp16(w), None)
            _FBGEMM_OK = torch.equal(got, (x.double() @ w.double().t()).float())
        except (AttributeError, RuntimeError):
            _FBGEMM_OK = False
    return _FBGEMM_OK


_FBGEMM_OK: bool | None = None


def fp8_compute_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """What the CPU multiplies the FP8 matrix `weight` [N, K] with, made once when the weights are loaded: the packed
    bf16 copy of fp8_cpu (a bf16 tensor) on CPUs with AVX-512 BF16, else FBGEMM's packed fp16 copy (an opaque
    uint8 handle tensor, 2 bytes per weight behind it) where FBGEMM runs, else an fp32 copy (4 bytes per weight).
    Exact each way: every E4M3 value is a bf16 and an fp16 value. A bf16 matrix (the VLLM_TRN_ALLOW_BF16 opt-in,
    computed unquantized in fp32) gets its fp32 copy. None off the CPU (a device has its own FP8 GEMM)."""
    if weight.dtype not in (FP8_DTYPE, torch.bfloat16) or weight.device.type != "cpu":
        return None
    if weight.dtype == FP8_DTYPE and fp8_cpu.kernel() is not None:
        return fp8_cpu.pack(weight)
    w = weight.float()
    if weight.dtype == FP8_DTYPE and _fbgemm_fp16():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.fbgemm_pack_gemm_matrix_fp16(w)
    return w


def scaled_mm_products(xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_k xq[t, k] * weight[n, k] by torch's FP8 GEMM (`_scaled_mm`, unit scales, fp32 out): [T, N] float32."""
    one = torch.ones((), dtype=torch.float32, device=xq.device)
    return torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)


def _rows(weight: torch.Tensor) -> int:
    """Output rows of an FP8 matrix, row-major or one expert's `to_kernel_layout` tiles."""
    return weight.shape[0] if weight.dim() == 2 else weight.shape[1] * weight.shape[3]


def fp8_matmul(xq: torch.Tensor, weight: torch.Tensor, compute: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 x FP8 products with fp32 accumulation, [T, N] float32, for FP8 activations xq [T, K] and the FP8
    weight [N, K] (or one expert's `to_kernel_layout` tiles, with a compute copy): from its compute copy
    (`fp8_compute_copy`) on CPU, by the device's FP8 GEMM on a GPU, else converting the weight in row chunks
    (bounded memory: the FP8-only residency opt-in)."""
    if weight.is_cuda and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0:
        return scaled_mm_products(xq, weight)
    if compute is not None and compute.dtype == torch.bfloat16:
        return fp8_cpu.products(xq, compute, _rows(weight))
    xf = fp8_to_float32(xq) if xq.dtype == FP8_DTYPE else xq.float()
    if compute is not None:
        if compute.dtype == torch.float32:
            return xf @ compute.t()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.fbgemm_linear_fp16_weight_fp32_activation(xf, compute, None)
    if weight.dtype != FP8_DTYPE:
        return xf @ weight.float().t()
    n, k = weight.shape
    step = max(1, min(n, _CHUNK_ELEMS // max(1, k)))
    chunk = torch.empty(step, k, dtype=torch.float32, device=weight.device)
    work = torch.empty(step * k, dtype=torch.int16, device=weight.device)
    out = torch.empty(xq.shape[0], n, dtype=torch.float32, device=xq.device)
    for n0 in range(0, n, step):
        rows = min(step, n - n0)
        w = fp8_to_float32(weight[n0 : n0 + rows], chunk[:rows], work=work)
        torch.matmul(xf, w.t(), out=out[:, n0 : n0 + rows])
    return out


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    row_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    compute: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = (Q(x) @ weight^T) * s_tok[:, None] * row_scale[None, :] + bias, float32 [T, N].

    x [T, K] any float dtype; weight float8_e4m3fn [N, K]; row_scale float32 [N]; bias [N] or None; compute the
    weight's `fp8_compute_copy` (or None).
    """
    xq, s_tok = quantize_per_token(x)
    if compute is not None and compute.dtype == torch.bfloat16:  # the AVX-512 BF16 kernel applies them as it stores
        return fp8_cpu.products(xq, compute, _rows(weight), s_tok=s_tok, row_scale=row_scale, bias=bias)
    acc = fp8_matmul(xq, weight, compute)
    y = acc * s_tok[:, None] * row_scale[None, :]
    return y if bias is None else y + bias.float()


def row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    row_scale: torch.Tensor,
    bias: torch.Tensor | None,
    compute: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp8_linear for FP8 weights; for a weight held in bf16 (VLLM_TRN_ALLOW_BF16) the same formula unquantized."""
    if weight.dtype == FP8_DTYPE:
        return fp8_linear(x, weight, row_scale, bias, compute)
    y = (x.float() @ (weight.float() if compute is None else compute).t()) * row_scale[None, :]
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
