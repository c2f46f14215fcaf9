"""The CPU's compiled FP8 helpers (C, vllm_trn_plugin/native.py): per-token quantization, and the FP8 x FP8 products
(fp8.fp8_matmul, fp8_linear) on CPUs with AVX-512 BF16, on AMX where present.

`quantize` is fp8.quantize_per_token's formula in one pass over a row, where torch takes ten ops (~30 us for
a decode step's row, most of an FP8 layer's overhead): the same fp32 operations in the same order (compiled without
floating-point contraction, so nothing is fused or reordered), and the fp32 -> E4M3 rounding (round to nearest,
ties to even) written out on the bits. A row holding a NaN or an infinity is left to torch (None), whose NaN
propagation is the definition. Plain C: it runs wherever the library compiles.

Products: every E4M3 value is a bf16 value (subnormals included: bf16 has fp32's exponent range, so they are normal
there), and the product of two is exact in fp32 (4 + 4 significant bits). `vdpbf16ps` multiplies bf16 pairs and
adds into fp32 lanes, so from a bf16 copy of the weight and the FP8 activations read as bf16 the kernel computes the
definition: exact products, fp32 accumulation (no operand or partial sum is ever subnormal, so the instruction's
flush-to-zero never acts: every product is a nonzero multiple of 2^-18 or zero). torch's CPU bf16 GEMM rounds its
output to bf16 and its fp32-output form has no CPU kernel, so neither can serve; this one writes fp32.

The copy is packed for the instruction: [ceil(N/16), ceil(K/2), 16, 2] bf16, 16 consecutive rows by one k pair per
512-bit vector, zero-padded (2 bytes per weight, as FBGEMM's fp16 copy). Each output vector holds 16 rows of one
token, so a weight vector loaded once serves up to 8 tokens from registers. One call can take a layer's experts,
each multiplying its own rows. The loop over row blocks runs on torch's OpenMP threads. Past a few tokens that loop
is bound by the dot products, not by reading the copy (the LM head at 8 tokens: twice its 1-token time); where the
CPU has AMX (Intel's tile unit, Sapphire Rapids on) the same copy feeds `TDPBF16PS` as it lies, 16 of its vectors
being one weight tile, and the same products (bf16 operands, flush-to-zero never acting, fp32 sums) cost a 16-token
step what one token does. `VLLM_TRN_NATIVE_GEMM=avx512` keeps to `vdpbf16ps`.

The scales and bias of fp8.fp8_linear are applied as the sums are stored, in its fp32 order ((sum x s_tok)
x row_scale + bias, no fused multiply-add): bit for bit torch's three ops, without their passes over the output.
Oracles: the float64 products, bit for bit on sums exact in fp32, torch's ops for the epilogue and torch's
quantize_per_token, bit for bit (tests/test_fp8_expert.py).

`kernel()` is None where the CPU lacks AVX-512 BF16, no C compiler is found, the compile fails or
`VLLM_TRN_NATIVE_GEMM=0`; fp8.fp8_compute_copy then makes FBGEMM's copy. `quantize` runs torch's ops where
the library is missing or VLLM_TRN_NATIVE_GEMM=0.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from vllm_trn_plugin import envs, native

FP8_DTYPE = torch.float8_e4m3fn

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define AMXBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

int trn_bf16dot_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

/* AMX-BF16 (CPUID.7.0:EDX bits 22 and 24) with the kernel's leave to use the tile registers, asked for once for
   the process (Linux keeps the 8 KB tile state off until a process requests it; threads and forks share it). */
int trn_amx_supported(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

/* Row block `blk` of n rows: its first row, the mask of its rows that exist, their row scales and biases (zeros
   where not given). */
struct block {
    int64_t n0;
    __mmask16 m;
    __m512 r, bv;
};
static inline AVX512BF16 __attribute__((always_inline)) struct block block_of(int64_t blk, int64_t n, const float *rs,
                                                                            const float *bias) {
    struct block e;
    e.n0 = blk * 16;
    e.m = n - e.n0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - e.n0)) - 1);
    e.r = rs ? _mm512_maskz_loadu_ps(e.m, rs + e.n0) : _mm512_setzero_ps();
    e.bv = bias ? _mm512_maskz_loadu_ps(e.m, bias + e.n0) : _mm512_setzero_ps();
    return e;
}

/* The epilogue on 16 sums of token t: (y x st[t]) x r + bv, each rounded to fp32 (separate instructions: no FMA). */
static inline AVX512BF16 __attribute__((always_inline)) __m512 finish(__m512 y, const float *st, int t, const float *rs,
                                                                    __m512 r, const float *bias, __m512 bv) {
    if (st) y = _mm512_mul_ps(y, _mm512_set1_ps(st[t]));
    if (rs) y = _mm512_mul_ps(y, r);
    if (bias) y = _mm512_add_ps(y, bv);
    return y;
}

/* NB row blocks of 16 from block b, TT tokens: out[t, 16b..] = sum over the kp pairs. NB and TT are constants at
   every call, so the compiler keeps the NB x TT accumulators in registers. */
static inline AVX512BF16 __attribute__((always_inline)) void tile(const uint32_t *x, int64_t kp, const uint16_t *w,
                                                                  int64_t b, const int NB, const int TT, int64_t n,
                                                                  float *out, int64_t ldo, const float *st,
                                                                  const float *rs, const float *bias) {
    __m512 acc[4][8];
    for (int i = 0; i < NB; i++)
        for (int t = 0; t < TT; t++) acc[i][t] = _mm512_setzero_ps();
    const uint16_t *wb = w + b * kp * 32;
    for (int64_t j = 0; j < kp; j++) {
        __m512bh wv[4];
        for (int i = 0; i < NB; i++) wv[i] = (__m512bh)_mm512_loadu_si512(wb + (i * kp + j) * 32);
        for (int t = 0; t < TT; t++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[t * kp + j]);
            for (int i = 0; i < NB; i++) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], wv[i], xv);
        }
    }
    for (int i = 0; i < NB; i++) {
        struct block e = block_of(b + i, n, rs, bias);
        for (int t = 0; t < TT; t++)
            _mm512_mask_storeu_ps(out + t * ldo + e.n0, e.m, finish(acc[i][t], st, t, rs, e.r, bias, e.bv));
    }
}

#define TOKENS(NB)                                                                  \
    switch (tt) {                                                                   \
    case 1: tile(xg, kp, wg, bb, NB, 1, n, og, ldo, sg, rsg, bg); break;            \
    case 2: tile(xg, kp, wg, bb, NB, 2, n, og, ldo, sg, rsg, bg); break;            \
    case 3: tile(xg, kp, wg, bb, NB, 3, n, og, ldo, sg, rsg, bg); break;            \
    case 4: tile(xg, kp, wg, bb, NB, 4, n, og, ldo, sg, rsg, bg); break;            \
    case 5: tile(xg, kp, wg, bb, NB, 5, n, og, ldo, sg, rsg, bg); break;            \
    case 6: tile(xg, kp, wg, bb, NB, 6, n, og, ldo, sg, rsg, bg); break;            \
    case 7: tile(xg, kp, wg, bb, NB, 7, n, og, ldo, sg, rsg, bg); break;            \
    default: tile(xg, kp, wg, bb, NB, 8, n, og, ldo, sg, rsg, bg); break;           \
    }

/* The AMX form of tile(): NB (1-4) row blocks from block b by the TT (1-16) tokens the loaded tile configuration
   has rows for; kp a multiple of 16. Per 32 k, TDPBF16PS adds a TT x 16 pairs activation tile (tile 4, rows of the
   scratch) times a block's 16 pairs x 16 rows x 2 (tiles 5-7: 16 consecutive vectors of the packed copy, as they
   lie) into that block's TT x 16 fp32 sums (tiles 0-3). The same exact products as tile(), summed in fp32. */
static AMXBF16 void amx_tile(const uint32_t *x, int64_t kp, const uint16_t *w, int64_t b, int NB, int TT,
                             int64_t n, float *out, int64_t ldo, const float *st, const float *rs, const float *bias) {
    const uint16_t *wb = w + b * kp * 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < kp; j += 16) {
        _tile_loadd(4, x + j, kp * 4);
        _tile_loadd(5, wb + j * 32, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (NB > 1) {
            _tile_loadd(6, wb + (kp + j) * 32, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (NB > 2) {
            _tile_loadd(7, wb + (2 * kp + j) * 32, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (NB > 3) {
            _tile_loadd(5, wb + (3 * kp + j) * 32, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    float sums[4][16][16];
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    for (int i = 0; i < NB; i++) {
        struct block e = block_of(b + i, n, rs, bias);
        for (int t = 0; t < TT; t++) {
            __m512 y = finish(_mm512_loadu_ps(sums[i][t]), st, t, rs, e.r, bias, e.bv);
            _mm512_mask_storeu_ps(out + t * ldo + e.n0, e.m, y);
        }
    }
}

/* Palette 1: tiles 0-4 with `tokens` rows of 64 bytes (sums, activations), tiles 5-7 16 rows (weights). */
static AMXBF16 void amx_configure(int tokens) {
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = i < 5 ? (uint8_t)tokens : 16;
    }
    __asm__ volatile("" : : "r"(&cfg) : "memory"); /* GCC drops these stores otherwise: LDTILECFG reads them */
    _tile_loadconfig(&cfg);
}

static AMXBF16 void amx_release(void) { _tile_release(); }

/* Row blocks per work item: 4 (64 rows); or 6, tiles of 3 + 3 blocks, where a copy multiplies more than 4 tokens on
   vdpbf16ps and has enough rows that the larger items still share out evenly among the threads (AMX tiles hold 4). */
#define GROUP_SMALL 4
#define GROUP_WIDE 6
#define WIDE_MIN_BLOCKS 256
#define TOKEN_CHUNK 64   /* tokens per work item: a work item's weights stay in cache across its token groups */

/* out[T, n] (row stride ldo) = xq[T, K] (FP8 bytes, row stride ldx) times packed copies (nb blocks, kp pairs each):
   rows bounds[g] .. bounds[g+1] of xq by the copy w[g], for groups g < ngroups (a layer's experts: one parallel
   loop for all of them). table[byte]: the bf16 bits of each FP8 byte. Then, where given, each sum times s_tok[t],
   times row_scale[g][r], plus bias[g][r] (fp32, in that order). Returns 0, or -1 where no scratch memory. */
AVX512BF16 int trn_fp8_bf16dot(const uint8_t *xq, int64_t T, int64_t K, int64_t ldx, const uint16_t *table,
                               const uint16_t *const *w, const int64_t *bounds, int64_t ngroups, int64_t nb,
                               int64_t kp, int64_t n, float *out, int64_t ldo, const float *s_tok,
                               const float *const *row_scale, const float *const *bias, int amx) {
    amx = amx && kp % 16 == 0; /* whole tiles of 32 k */
    uint32_t *x = malloc((size_t)(T * kp) * sizeof(uint32_t) + 1);
    int64_t *first = malloc((size_t)(ngroups + 1) * sizeof(int64_t));
    if (x == NULL || first == NULL) {
        free(x);
        free(first);
        return -1;
    }
    for (int64_t t = 0; t < T; t++) {
        const uint8_t *r = xq + t * ldx;
        uint16_t *d = (uint16_t *)(x + t * kp);
        for (int64_t k = 0; k < K; k++) d[k] = table[r[k]];
        if (K & 1) d[K] = 0;
    }
    int64_t most = 0; /* tokens of the largest group */
    for (int64_t g = 0; g < ngroups; g++) most = bounds[g + 1] - bounds[g] > most ? bounds[g + 1] - bounds[g] : most;
    const int64_t per_item = most > 4 && nb >= WIDE_MIN_BLOCKS && !amx ? GROUP_WIDE : GROUP_SMALL;
    int64_t nrg = (nb + per_item - 1) / per_item;
    first[0] = 0;  /* work items of group g: first[g] .. first[g+1], row groups by token chunks */
    for (int64_t g = 0; g < ngroups; g++)
        first[g + 1] = first[g] + nrg * ((bounds[g + 1] - bounds[g] + TOKEN_CHUNK - 1) / TOKEN_CHUNK);
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < first[ngroups]; item++) {
        int64_t lo = 0, hi = ngroups - 1;
        while (lo < hi) {  /* the group whose items hold this one */
            int64_t mid = (lo + hi + 1) / 2;
            if (first[mid] <= item) lo = mid; else hi = mid - 1;
        }
        int64_t grp = lo, local = item - first[grp];
        int64_t nt = (bounds[grp + 1] - bounds[grp] + TOKEN_CHUNK - 1) / TOKEN_CHUNK;
        int64_t rg = local / nt, tc = local % nt;
        int64_t t_begin = bounds[grp] + tc * TOKEN_CHUNK;
        int64_t t_end = t_begin + TOKEN_CHUNK < bounds[grp + 1] ? t_begin + TOKEN_CHUNK : bounds[grp + 1];
        const uint16_t *wg = w[grp];
        const float *rsg = row_scale ? row_scale[grp] : NULL, *bg = bias ? bias[grp] : NULL;
        if (amx) {
            int configured = 0;
            for (int64_t t0 = t_begin; t0 < t_end; t0 += 16) {
                int tt = t_end - t0 < 16 ? (int)(t_end - t0) : 16;
                if (tt != configured) amx_configure(configured = tt);
                int64_t bb = rg * per_item, b_end = bb + per_item < nb ? bb + per_item : nb;
                amx_tile(x + t0 * kp, kp, wg, bb, (int)(b_end - bb), tt, n, out + t0 * ldo, ldo,
                         s_tok ? s_tok + t0 : NULL, rsg, bg);
            }
            amx_release();
            continue;
        }
        for (int64_t t0 = t_begin; t0 < t_end; t0 += 8) {
            int64_t tt = t_end - t0 < 8 ? t_end - t0 : 8;
            const uint32_t *xg = x + t0 * kp;
            const float *sg = s_tok ? s_tok + t0 : NULL;
            float *og = out + t0 * ldo;
            int64_t bb = rg * per_item, b_end = bb + per_item < nb ? bb + per_item : nb;
            /* Up to 4 tokens: 4 blocks a tile (16 accumulators); more: 3 (24 of the 32 vector registers: each
               broadcast token pair feeds 3 dot products, each weight vector up to 8) */
            if (tt <= 4)
                for (; bb + 4 <= b_end; bb += 4) { TOKENS(4) }
            else
                for (; bb + 3 <= b_end; bb += 3) { TOKENS(3) }
            for (; bb + 2 <= b_end; bb += 2) { TOKENS(2) }
            if (bb < b_end) { TOKENS(1) }
        }
    }
    free(first);
    free(x);
    return 0;
}

/* fp32 -> E4M3FN code, round to nearest even, for finite |v| <= 240 (as torch's conversion). */
static inline uint8_t e4m3(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    uint32_t sign = (u >> 24) & 0x80, a = u & 0x7FFFFFFF;
    uint8_t code;
    if (a < 0x3C800000u) { /* below 2^-6: a multiple of 2^-9; v x 2^9 is exact, rounded by the 2^23 add */
        float m;
        memcpy(&m, &a, 4);
        m = (m * 512.0f + 8388608.0f) - 8388608.0f;
        code = (uint8_t)m; /* 0 .. 8, and 8 is 2^-6's code */
    } else { /* drop 20 of 23 mantissa bits with ties to even; a carry moves into the exponent */
        code = (uint8_t)(((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3));
    }
    return code | (uint8_t)sign;
}

static inline float load(const void *x, int bf16, int64_t i) {
    if (!bf16) return ((const float *)x)[i];
    uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* quantize_per_token on rows x [T, K] (fp32, or bf16 bits if bf16; row stride ldx elements): codes [T, K] and
   scale [T]. Returns -1, or the first row holding a NaN or an infinity (nothing of it or later rows is written). */
int64_t trn_fp8_quantize(const void *x, int64_t T, int64_t K, int64_t ldx, int bf16, float floor, float inv_max,
                         uint8_t *codes, float *scale) {
    for (int64_t t = 0; t < T; t++) {
        const char *row = (const char *)x + t * ldx * (bf16 ? 2 : 4);
        float a = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            float v = load(row, bf16, k);
            if (!(v - v == 0.0f)) return t; /* NaN or +-inf */
            v = v < 0 ? -v : v;
            a = v > a ? v : a;
        }
        a = a < floor ? floor : a;
        float inv = (1.0f / a) * 240.0f;
        uint8_t *c = codes + t * K;
        for (int64_t k = 0; k < K; k++) {
            float y = load(row, bf16, k) * inv;
            y = y < -240.0f ? -240.0f : (y > 240.0f ? 240.0f : y);
            c[k] = e4m3(y);
        }
        scale[t] = a * inv_max;
    }
    return -1;
}

/* The packed copy of the FP8 matrix w [n, K] (row stride ldw): out [nb, kp, 16, 2] bf16 bits, zeroed by the caller
   (the padding rows and column stay zero). */
void trn_fp8_bf16dot_pack(const uint8_t *w, int64_t n, int64_t K, int64_t ldw, const uint16_t *table, uint16_t *out,
                          int64_t kp) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *src = w + r * ldw;
        uint16_t *dst = out + (r / 16) * kp * 32 + (r % 16) * 2;
        for (int64_t k = 0; k < K; k++) dst[(k / 2) * 32 + (k & 1)] = table[src[k]];
    }
}
"""


@functools.cache
def _compiled() -> object | None:
    """The library (a ctypes CDLL) or None; `trn_bf16dot_supported` says whether its products can run here."""
    flags = ["-fopenmp", "-ffp-contract=off"]  # no fused multiply-adds: every fp32 operation rounds as written
    lib = native.load("fp8-cpu", SOURCE, flags, fallback="FP8 layers use torch's ops and FBGEMM's fp16 copy")
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.trn_fp8_quantize.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ctypes.c_float, ctypes.c_float, ptr, ptr]
    lib.trn_fp8_quantize.restype = i64
    lib.trn_fp8_bf16dot.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64] + [
        ptr, ptr, ptr, ctypes.c_int,  # the epilogue's s_tok, row_scale, bias; whether AMX
    ]  # fmt: skip
    lib.trn_fp8_bf16dot.restype = ctypes.c_int
    lib.trn_fp8_bf16dot_pack.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64]
    lib.trn_fp8_bf16dot_pack.restype = None
    lib.trn_amx_supported.restype = ctypes.c_int
    return lib


def kernel() -> object | None:
    """The compiled products kernel (a ctypes library), or None: disabled, no AVX-512 BF16, or no working C
    compiler."""
    lib = _compiled() if envs.native_gemm() != "0" else None
    return lib if lib is not None and lib.trn_bf16dot_supported() else None


AMX, AVX512 = "amx-bf16", "avx512-bf16"


@functools.cache
def _has_amx() -> bool:
    lib = _compiled()
    return lib is not None and bool(lib.trn_amx_supported())


def isas() -> tuple[str, ...]:
    """The instruction sets `products` may run with here, the one it uses first: AMX's tile dot products (Intel's
    matrix unit: the same exact products, 16 rows by up to 16 tokens by 32 k per instruction) where the CPU and the
    OS allow them and VLLM_TRN_NATIVE_GEMM is 1, then AVX-512 BF16's `vdpbf16ps`; empty where `kernel()` is None."""
    if kernel() is None:
        return ()
    return (AMX, AVX512) if envs.native_gemm() == "1" and _has_amx() else (AVX512,)


def quantize(x: torch.Tensor, floor: float, inv_max: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """fp8.quantize_per_token of a CPU x [T, K] (fp32 or bf16, unit column stride) in one pass: (codes, s_tok),
    bit for bit; `floor` and `inv_max` are its AMAX_FLOOR and fp32(1 / 240). None where it does not apply (the
    library missing or switched off, another dtype or layout, a NaN or an infinity in x): the caller runs torch."""
    if torch.compiler.is_compiling() or type(x) is not torch.Tensor or torch._C._len_torch_dispatch_stack():
        return None  # traced (dynamo, make_fx, fake tensors): a graph holds torch's ops, never a pointer
    lib = _compiled() if envs.native_gemm() != "0" else None
    if lib is None or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        return None
    if x.stride(1) != 1 and x.shape[1] > 1:
        return None
    t, k = x.shape
    codes = torch.empty(t, k, dtype=FP8_DTYPE)
    scale = torch.empty(t, dtype=torch.float32)
    bf16 = int(x.dtype == torch.bfloat16)
    bad = lib.trn_fp8_quantize(
        x.data_ptr(), t, k, x.stride(0), bf16, floor, inv_max, codes.data_ptr(), scale.data_ptr()
    )
    return None if bad >= 0 else (codes, scale)


def _lib() -> object:
    lib = kernel()
    if lib is None:
        raise RuntimeError("the AVX-512 BF16 FP8 kernel is not available on this host (fp8_cpu.kernel())")
    return lib


@functools.cache
def _bf16_bits() -> torch.Tensor:
    """The bf16 bit pattern of each FP8 byte (exact: every E4M3 value, NaN aside, is a bf16 value)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).to(torch.bfloat16).view(torch.int16)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's copy of the FP8 matrix `weight` [N, K]: bf16 [ceil(N/16), ceil(K/2), 16, 2], zero-padded."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise TypeError(f"pack: expected a 2-D {FP8_DTYPE} matrix, got {weight.dtype} {tuple(weight.shape)}")
    lib = _lib()
    n, k = weight.shape
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out = torch.zeros(-(-n // 16), -(-k // 2), 16, 2, dtype=torch.bfloat16)
    lib.trn_fp8_bf16dot_pack(
        weight.data_ptr(), n, k, weight.stride(0), _bf16_bits().data_ptr(), out.data_ptr(), out.shape[1]
    )
    return out


def _per_group(
    v: torch.Tensor | Sequence[torch.Tensor] | None, groups: int, n: int, name: str
) -> list[torch.Tensor] | None:
    """Row scales or biases for the epilogue: one fp32 contiguous [n] vector per group (cast where given another
    float dtype, as torch's fp32 arithmetic would), or None."""
    if v is None:
        return None
    vs = [v] * groups if isinstance(v, torch.Tensor) else list(v)
    if len(vs) != groups or any(t.shape != (n,) for t in vs):
        raise ValueError(f"products: {name} must be {groups} vector(s) of {n} values")
    return [t.float().contiguous() for t in vs]


def products(
    xq: torch.Tensor,
    packed: torch.Tensor | Sequence[torch.Tensor],
    n: int,
    bounds: Sequence[int] | None = None,
    *,
    s_tok: torch.Tensor | None = None,
    row_scale: torch.Tensor | Sequence[torch.Tensor] | None = None,
    bias: torch.Tensor | Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """sum_k xq[t, k] * weight[r, k], float32 [T, n], for FP8 activations xq [T, K] and `pack(weight)`. With a list
    of copies of one shape and `bounds` (one more row offset than copies, 0 to T), rows bounds[g] .. bounds[g+1] of
    xq multiply copies[g]: a layer's experts in one call.

    Given, the scales and bias apply to each sum as fp8.fp8_linear writes them, in fp32 and in order:
    (sum * s_tok[t]) * row_scale[r] + bias[r], bit for bit torch's ops on the sums; `row_scale` and `bias` are one
    [n] vector, or one per copy. Computed with `isas()[0]` (AMX takes K in whole 32s, else the call runs on
    AVX-512)."""
    lib = _lib()
    copies = [packed] if isinstance(packed, torch.Tensor) else list(packed)
    bounds = [0, xq.shape[0]] if bounds is None else list(bounds)
    nb, kp = copies[0].shape[0], copies[0].shape[1]
    t, k = xq.shape
    if xq.dtype != FP8_DTYPE or any(c.dtype != torch.bfloat16 or c.shape != copies[0].shape for c in copies):
        raise TypeError(f"products: FP8 activations and pack() copies of one shape expected, got {xq.dtype}")
    if copies[0].shape[2:] != (16, 2) or not (kp * 2 - 1 <= k <= kp * 2 and nb * 16 - 15 <= n <= nb * 16):
        raise ValueError(
            f"products: activations [{t}, {k}] and {n} rows do not fit a copy of {nb} x 16 rows, {kp} pairs"
        )
    if len(bounds) != len(copies) + 1 or bounds[0] != 0 or bounds[-1] != t or sorted(bounds) != bounds:
        raise ValueError(f"products: bounds {bounds} are not {len(copies) + 1} ascending row offsets from 0 to {t}")
    if s_tok is not None:
        if s_tok.shape != (t,):
            raise ValueError(f"products: s_tok must hold one scale per activation row ({t}), got {tuple(s_tok.shape)}")
        s_tok = s_tok.float().contiguous()
    scales = _per_group(row_scale, len(copies), n, "row_scale")
    biases = _per_group(bias, len(copies), n, "bias")
    if xq.stride(1) != 1:
        xq = xq.contiguous()
    out = torch.empty(t, n, dtype=torch.float32)
    if t:

        def pointers(ts: list[torch.Tensor] | None) -> torch.Tensor | None:
            return None if ts is None else torch.tensor([c.data_ptr() for c in ts], dtype=torch.int64)

        ptrs, scale_ptrs, bias_ptrs = pointers(copies), pointers(scales), pointers(biases)
        rows = torch.tensor(bounds, dtype=torch.int64)
        rc = lib.trn_fp8_bf16dot(
            xq.data_ptr(), t, k, xq.stride(0), _bf16_bits().data_ptr(), ptrs.data_ptr(), rows.data_ptr(),
            len(copies), nb, kp, n, out.data_ptr(), n, None if s_tok is None else s_tok.data_ptr(),
            None if scale_ptrs is None else scale_ptrs.data_ptr(), None if bias_ptrs is None else bias_ptrs.data_ptr(),
            int(isas()[0] == AMX),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError(f"products: no memory for the kernel's {t} x {kp} activation scratch")
    return out
