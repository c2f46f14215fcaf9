"""The FP8 format of every quantized matrix (MLPs, experts, LM head) and of the FP8 latent cache: per-token FP8
activations, FP8 x FP8 products with fp32 accumulation, and the linear layer built on them.

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
  packed bf16 copy that kernels/fp8_cpu.py multiplies with bf16 dot products (AMX tiles where present) into fp32,
  applying the scales and bias as it stores; elsewhere FBGEMM's
  fp16 copy (every E4M3 value is an fp16 value), which FBGEMM multiplies by fp32 activations with fp32 accumulation.
  Products exact, as above, either way. Where neither runs, an fp32 copy (4 bytes per weight). torch has no CPU
  GEMM that reads FP8 or returns fp32 from bf16 operands (`_scaled_mm` on CPU converts per call: docs/fp8.md has
  the measurements). A layer without a copy (the FP8-only residency opt-in) converts its weight in bounded row
  chunks per call.
- GPU (and the Neuron graph): `torch._scaled_mm` on the FP8 operands with unit scales and an fp32 output: the
  hardware's FP8 GEMM, the same products and fp32 accumulation; the scales are applied here, in the order written.
- Trainium's FP8 experts: TensorE in double-row FP8 mode (fp8_expert_nki.py).

This module is the definition and the torch path at once (plain torch, no tiling). Oracles: float64 math and
ml_dtypes' FP8 (tests/test_fp8_expert.py); kernels/fp8_cpu.py computes the same bits where its C builds.
"""

from __future__ import annotations

import warnings

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


_E4M3FN_MAX = 448.0  # float8_e4m3fn's largest finite value (fp8_to_float32's NaN codes come out beyond it)
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
    if bool(hi > _E4M3FN_MAX) or bool(lo < -_E4M3FN_MAX):
        nan = out.abs() > _E4M3FN_MAX
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
