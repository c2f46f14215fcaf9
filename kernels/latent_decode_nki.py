"""Absorbed latent decode attention (MLA-Trinity's global layers) as an NKI 0.6 kernel for trn2: the kernel,
its host wrapper `latent_decode_nki` and its cost formula `latent_decode_cost`.

The op (its math, its definition `latent_decode_reference` and the torch path) is in latent_decode.py;
`latent_decode_nki` takes the same arguments plus a runner and returns the same result. NKI semantics the
kernel relies on: docs/nki-0.6.md (section 9 (a) for the idioms).

Indices. The torch-facing entry `latent_decode_nki` expands the block table into a per-key row
table `rows [B, bucket]` int32 (row_i for i < L_b, the out-of-range row `cache.shape[0]` after).
Computing rows in the kernel would take a second, dependent indirect DMA per tile (the block ids
of the tile's keys when bs < 128), and vLLM's block table can be narrower than the bucket; the
table costs 4 B per key of HBM reads beside the 512 + 16 B of latent and key scales (0.8%) and
one small elementwise torch op. The kernel does not trust the table's tail: once per sequence it
replaces every entry with i >= L_b by the out-of-range row (iota, compare, predicated copy), so
keys past L_b are never read, whatever the block table or the row table hold there.

Tiling (P = 128 partitions; H = 32, Hkv = 4, hd = 128, r = 256 at full size; RC = r / 128):
- Once per call: gamma, seq_lens (broadcast to 128 partitions), W_k as [hd, Hkv, r] fp32 (hd on
  partitions: the stationary of q~'s contraction over hd), W_v PE-transposed into
  [r % 128, RC, Hkv, hd] fp32 (r on partitions: the output's contraction over r). NBUF latent
  gather buffers [128 keys, r] and key-scale buffers [128 keys, Hkv] are zeroed once.
- Per sequence (a compile-time loop over B): q_b [H, hd] PE-transposed and scaled by
  gamma * scale, then q~^T [r, H] fp32 = RC x Hkv matmuls (stationary W_k,g chunk [hd, 128],
  moving [hd, G]); running state U [H, r], l [H, 1] and -m [H, 1] in SBUF, fp32.
- Per 128-key tile (a compile-time loop of bucket / 128 tiles; the tail is masked): 2 DMAs,
  RC + 2 PE transposes, RC + 1 matmuls, 9 ScalarE/VectorE instructions:
  1. one indirect DMA gathers the tile's latents C [128 keys, r] through the row table, one more
     their key scales S [128 keys, Hkv] with the same indices (oob_mode.skip for rows past L_b);
  2. C^T [r, 128 keys] by RC PE transposes into one PSUM bank, copied to SBUF as fp32;
  3. scores [128 keys, H] = RC accumulating fp32 matmuls (stationary C^T chunk, moving q~^T
     chunk), times S broadcast over the G heads of each group (keys are the partitions here, so
     the per-key, per-group scale is one stride-0 operand), PE-transposed to [H, 128 keys];
  4. range_select keeps keys 128 t + j < L_b and puts FP32_MIN elsewhere (selection, never a
     product), giving the tile's row max in the same instruction;
  5. online softmax: -m_new = min(-m, -rowmax); alpha = exp(m - m_new); p = exp(score - m_new)
     with its row sum from the same ScalarE instruction; l = alpha l + rowsum. The running max
     starts at FP32_MIN and tile maxima are >= FP32_MIN, so the state is never infinite and
     -inf - -inf cannot occur;
  6. p^T [128 keys, H] by one PE transpose; U = alpha U + p^T^T C: one matmul whose moving
     operand is C [128 keys, r] as gathered, so the sum stays in latent space.
- After the last tile: u = U / l, u^T by RC PE transposes, out_b = Hkv x RC matmuls into one
  PSUM bank [G, Hkv * hd] (stationary u^T of group g, moving W_v,g^T chunk), one DMA to out[b].
PSUM: 7 sites of one 2 KiB bank each (a scratch bank for setup and per-sequence work, the output
bank, and per tile C^T, scores, scores^T, p^T, p^T C). SBUF per partition at full size: 20.4 KiB
at bucket 2304, 21.8 KiB at 16640 (FP8 cache: 20.6 and 22.0 KiB).

FP8 latent cache (`latent_scales` given: codes float8_e4m3, |code| <= 240, c_i = d_i * code_i; the op's
docstring). The tile moves as FP8, 1 B per element (half of bf16's HBM bytes), and its keys' d_i
[128 keys, 1] fp32 come in one more indirect gather with the same indices (4 B per key). d_i is folded
into the per-key factors, never into the r-wide tile: keys are on the partitions both where the scores
get their key scale and where p^T leaves PSUM, so d_i is a per-partition scalar there and costs no
instruction of its own:
  1'. after the gathers, C8 is copied on chip to a bf16 tile C (exact: every E4M3 value is a bf16
     value) because the TensorE has no FP8 transpose [L-ABT] and fp32 operands pair only with fp32;
     C then feeds steps 2 and 6 as a bf16 cache's tile does (C^T copied out as fp32);
  3'. scores = (sc_ps * d_i) * S in one scalar_tensor_tensor (instead of the tensor_tensor);
  5'. p stays fp32 (the activation's output) and is PE-transposed as fp32;
  6'. p^T d_i is the PSUM eviction (tensor_scalar, instead of the tensor_copy), rounded once to bf16,
     the stationary of the bf16 x bf16 matmul with C.
Per tile: 3 DMAs, the same PE instructions, 10 ScalarE/VectorE instructions (the upcast). (FP8 x bf16
matmul operands are allowed on trn2, but C^T needs the bf16 copy anyway.)
Masked keys never put a NaN into a product: a skipped gather leaves the zeroed or an earlier
tile's (finite) rows in its buffer, selection replaces their scores, and their p = 0 meets only
finite latents (and finite d_i) in p^T C.

DMA traffic per call (HBM side; `latent_decode_cost` gives the formulas): the latents and key
scales (and an FP8 cache's dequantization scales) of the L_b valid keys of every sequence exactly
once (skipped rows move nothing), the row table (4 B x bucket per sequence), q, out, both weights
and gamma once, seq_lens x 128. The analytic minimum is the same without the row table and the
seq_lens broadcast: at full size, B = 32 and 2k-16k context the kernel moves at most 0.9% more.
Per valid key at full size: 512 + 16 B with a bf16 cache, 256 + 16 + 4 B with an FP8 one.

Numerics contract. The only rounding below fp32 is p, cast to the cache dtype for the p^T C matmul (its
operands must pair with the latents; with an FP8 cache p d_i, cast to bf16); q~, C^T (copied out as
fp32) and the score matmul are fp32, the query and output projections are fp32 whatever the weights'
dtype, every matmul accumulates in fp32 PSUM, and the softmax state is fp32. So with an fp32 cache the
kernel equals the fp32 torch reference to fp32 rounding (summation order, online vs full softmax, scale
folded into q); with a bf16 cache out_h moves by at most 2^-8 sum_i p_i |v_i|. With an FP8 cache the
reference is the dequantized latents c_i = d_i code_i: the codes enter both matmuls exactly, the scores'
d_i s_g,i is fp32, and the one rounding is p_i d_i (formed in fp32) to bf16, so out_h moves by at most
2^-8 sum_i p_i |v_i| as with bf16 (the FP8 quantization itself is the cache's, not the kernel's). The
score path stays in fp32 because q~ . c cancels heavily: rounding q~ to bf16 as well costs several times
that error (docs/kernels.md).
Bit-exact: every sequence of a batch runs the same instruction sequence on the same shapes
(nothing is batched across sequences), so each output row equals the sequence's single-sequence
run; NaN or garbage in cache rows, key scales, dequantization scales or table entries past L_b
changes no bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_trn_plugin.kernels.latent_decode import AbsorbedWeights, PagedLatents, check_latent_scales
from vllm_trn_plugin.kernels.nki_shim import nisa, nki, nl

P = 128  # partitions; keys per tile
LNC_DEGREES = (1,)  # the LNC degrees the kernel runs at (kernels/nki_ops.py refuses a deployment at another)
NBUF = 2  # gather buffers: the next tile's DMA need not wait for the previous tile's last read
BUCKETS = (2304, 4352, 8448, 16640)  # context buckets (keys); each a whole number of 128-key tiles
FLT_MAX = 3.4028234663852886e38


@nki.jit
def latent_decode_kernel(q, gamma, w_k, w_v, cache, key_scales, rows, seq_lens, scale, latent_scales=None):
    """Absorbed latent decode attention for B sequences of one query token each.

    q [B, H, hd] (after q_norm), gamma [hd] (k_norm weight), w_k / w_v [Hkv, hd, r],
    cache [N, r] latents, key_scales [N, Hkv] fp32, rows [B, bucket] int32 (row of key i),
    seq_lens [B] int32 (1 <= L_b <= bucket), scale: float; latent_scales [N] or [N, 1] fp32 with an FP8
    cache (its per-key dequantization scales d_i), None with a float cache. Returns out [B, H, hd] fp32.
    B, the bucket (rows.shape[1], a multiple of 128) and all sizes are compile-time; limits:
    hd <= 128, H <= 128, r a multiple of 128 and <= 512, Hkv * hd <= 512 (one PSUM bank each for
    p^T C and the output). Tiling and numerics: the module docstring.
    """
    B, H, hd = q.shape
    Hkv, _, r = w_k.shape
    G = H // Hkv
    n_rows = cache.shape[0]
    bucket = rows.shape[1]
    NT = bucket // P
    RC = r // P
    cdt = cache.dtype
    f32 = nl.float32
    fp8 = latent_scales is not None  # an FP8 cache (the wrapper checks the pairing: check_latent_scales)
    mdt = nl.bfloat16 if fp8 else cdt  # dtype of the latents' PE operands (the TensorE has no FP8 transpose)
    out = nl.ndarray((B, H, hd), dtype=f32, buffer=nl.shared_hbm)

    # ---- once per call ----
    gam = nl.ndarray((hd, 1), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=gam, src=gamma.ap([[1, hd], [1, 1]]))
    lens = nl.ndarray((P, B), dtype=f32, buffer=nl.sbuf)  # L_b on every partition
    nisa.dma_copy(dst=lens, src=seq_lens.ap([[0, P], [1, B]]))
    wk = nl.ndarray((hd, Hkv, r), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=wk, src=w_k.ap([[r, hd], [hd * r, Hkv], [1, r]]))
    wv = nl.ndarray((hd, Hkv, r), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=wv, src=w_v.ap([[r, hd], [hd * r, Hkv], [1, r]]))
    # One PSUM bank of scratch for everything outside the tile loop, reused in program order.
    scratch = nl.ndarray((P, 512), dtype=f32, buffer=nl.psum)
    wvT = nl.ndarray((P, RC, Hkv, hd), dtype=f32, buffer=nl.sbuf)
    for g in range(Hkv):
        for c in range(RC):
            nisa.nc_transpose(dst=scratch[:, 0:hd], data=wv[:, g, c * P : (c + 1) * P])
            nisa.tensor_copy(dst=wvT[:, c, g, :], src=scratch[:, 0:hd])
    key_idx = nl.ndarray((P, NT), dtype=nl.int32, buffer=nl.sbuf)  # key index 128 t + p
    nisa.iota(dst=key_idx, pattern=[[P, NT]], offset=0, channel_multiplier=1)
    zero_col = nl.ndarray((H, 1), dtype=f32, buffer=nl.sbuf)
    nisa.memset(dst=zero_col, value=0.0)
    c_buf = nl.ndarray((P, NBUF, r), dtype=cdt, buffer=nl.sbuf)
    nisa.memset(dst=c_buf, value=0.0)
    s_buf = nl.ndarray((P, NBUF, Hkv), dtype=f32, buffer=nl.sbuf)
    nisa.memset(dst=s_buf, value=0.0)
    if fp8:
        d_buf = nl.ndarray((P, NBUF, 1), dtype=f32, buffer=nl.sbuf)  # d_i, keys on partitions
        nisa.memset(dst=d_buf, value=0.0)

    for b in range(B):
        # ---- row indices: rows past L_b become the out-of-range row (never read) ----
        rows_sb = nl.ndarray((P, NT), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows_sb, src=rows.ap([[1, P], [P, NT]], offset=b * bucket))
        valid = nl.ndarray((P, NT), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=valid, data=key_idx, op0=nl.less, operand0=lens[:, b : b + 1])
        idx = nl.ndarray((P, NT), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=idx, value=n_rows)
        nisa.tensor_copy_predicated(dst=idx, src=rows_sb, predicate=valid)

        # ---- q~^T [r, H] = W_k,g^T (gamma * scale * q_h) ----
        q_sb = nl.ndarray((H, hd), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=q_sb, src=q[b])
        nisa.nc_transpose(dst=scratch[0:hd, 0:H], data=q_sb)
        qg = nl.ndarray((hd, H), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_scalar(
            dst=qg, data=scratch[0:hd, 0:H], op0=nl.multiply, operand0=gam, op1=nl.multiply, operand1=float(scale)
        )
        qt_ps = scratch[:, H : H + RC * H]
        for c in range(RC):
            for g in range(Hkv):
                nisa.nc_matmul(
                    dst=qt_ps[:, c * H + g * G : c * H + (g + 1) * G],
                    stationary=wk[:, g, c * P : (c + 1) * P],
                    moving=qg[:, g * G : (g + 1) * G],
                    accumulate=False,
                )
        qt = nl.ndarray((P, RC, H), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=qt, src=qt_ps)

        U = nl.ndarray((H, r), dtype=f32, buffer=nl.sbuf)
        nisa.memset(dst=U, value=0.0)
        l_sum = nl.ndarray((H, 1), dtype=f32, buffer=nl.sbuf)
        nisa.memset(dst=l_sum, value=0.0)
        # -running max, ping-pong by tile parity; it starts at FP32_MIN, not -inf, so no softmax
        # state is ever infinite (m_old - m_new = -inf - -inf cannot occur)
        neg_m = nl.ndarray((H, 2), dtype=f32, buffer=nl.sbuf)
        nisa.memset(dst=neg_m[:, 0:1], value=FLT_MAX)

        for t in range(NT):
            k = t % NBUF
            c_t = c_buf[:, k, :]
            s_t = s_buf[:, k, :]
            nisa.dma_copy(
                dst=c_t,
                src=cache.ap([[r, P], [1, r]], offset=0, vector_offset=idx[:, t : t + 1], indirect_dim=0),
                oob_mode=nisa.oob_mode.skip,
            )
            nisa.dma_copy(
                dst=s_t,
                src=key_scales.ap([[Hkv, P], [1, Hkv]], offset=0, vector_offset=idx[:, t : t + 1], indirect_dim=0),
                oob_mode=nisa.oob_mode.skip,
            )
            if fp8:
                d_t = d_buf[:, k, :]
                nisa.dma_copy(
                    dst=d_t,
                    src=latent_scales.ap([[1, P], [1, 1]], offset=0, vector_offset=idx[:, t : t + 1], indirect_dim=0),
                    oob_mode=nisa.oob_mode.skip,
                )
                # the codes as bf16 (exact: every E4M3 value is a bf16 value), on chip: the DMA moved 1 B each
                c_mm = nl.ndarray((P, r), dtype=mdt, buffer=nl.sbuf)
                nisa.tensor_copy(dst=c_mm, src=c_t)
            else:
                c_mm = c_t
            cT_ps = nl.ndarray((P, RC, P), dtype=mdt, buffer=nl.psum)
            for c in range(RC):
                nisa.nc_transpose(dst=cT_ps[:, c, :], data=c_mm[:, c * P : (c + 1) * P])
            cT = nl.ndarray((P, RC, P), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=cT, src=cT_ps)

            sc_ps = nl.ndarray((P, H), dtype=f32, buffer=nl.psum)  # keys on partitions
            for c in range(RC):
                nisa.nc_matmul(dst=sc_ps, stationary=cT[:, c, :], moving=qt[:, c, :], accumulate=c > 0)
            sc = nl.ndarray((P, Hkv, G), dtype=f32, buffer=nl.sbuf)
            if fp8:  # (q~ . code_i) d_i s_g,i: d_i is a per-partition scalar here, same instruction count
                nisa.scalar_tensor_tensor(
                    dst=sc,
                    data=sc_ps.reshape((P, Hkv, G)),
                    op0=nl.multiply,
                    operand0=d_t,
                    op1=nl.multiply,
                    operand1=s_t.expand_dim(2).broadcast(2, G),
                )
            else:
                nisa.tensor_tensor(
                    dst=sc,
                    data1=sc_ps.reshape((P, Hkv, G)),
                    data2=s_t.expand_dim(2).broadcast(2, G),
                    op=nl.multiply,
                )
            scT_ps = nl.ndarray((H, P), dtype=f32, buffer=nl.psum)  # heads on partitions
            nisa.nc_transpose(dst=scT_ps, data=sc.reshape((P, H)))

            # keys j + 128 t >= L_b -> FP32_MIN by selection; the tile's row max comes out of the
            # same instruction (finite: every row keeps FP32_MIN at worst)
            s_m = nl.ndarray((H, P), dtype=f32, buffer=nl.sbuf)
            t_max = nl.ndarray((H, 1), dtype=f32, buffer=nl.sbuf)
            nisa.range_select(
                dst=s_m,
                on_true_tile=scT_ps,
                comp_op0=nl.less,
                comp_op1=nl.greater_equal,
                bound0=lens[0:H, b : b + 1],
                bound1=zero_col,
                reduce_cmd=nisa.reduce_cmd.reset_reduce,
                reduce_res=t_max,
                reduce_op=nl.maximum,
                range_start=t * P,
            )
            nm_old = neg_m[:, t % 2 : t % 2 + 1]
            nm_new = neg_m[:, (t + 1) % 2 : (t + 1) % 2 + 1]
            nisa.tensor_scalar(dst=nm_new, data=t_max, op0=nl.multiply, operand0=-1.0, op1=nl.minimum, operand1=nm_old)
            alpha = nl.ndarray((H, 1), dtype=f32, buffer=nl.sbuf)  # exp(m_old - m_new)
            nisa.activation(dst=alpha, op=nl.exp, data=nm_old, bias=nm_new, scale=-1.0)
            p = nl.ndarray((H, P), dtype=f32 if fp8 else cdt, buffer=nl.sbuf)
            row_sum = nl.ndarray((H, 1), dtype=f32, buffer=nl.sbuf)
            nisa.activation(
                dst=p,
                op=nl.exp,
                data=s_m,
                bias=nm_new,
                scale=1.0,
                reduce_op=nl.add,
                reduce_res=row_sum,
                reduce_cmd=nisa.reduce_cmd.reset_reduce,
            )
            nisa.scalar_tensor_tensor(
                dst=l_sum, data=l_sum, op0=nl.multiply, operand0=alpha, op1=nl.add, operand1=row_sum
            )

            pT_ps = nl.ndarray((P, H), dtype=p.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=pT_ps, data=p)
            pT = nl.ndarray((P, H), dtype=mdt, buffer=nl.sbuf)
            if fp8:  # p_i d_i, keys on partitions: the PSUM eviction does it, rounded to bf16 once
                nisa.tensor_scalar(dst=pT, data=pT_ps, op0=nl.multiply, operand0=d_t)
            else:
                nisa.tensor_copy(dst=pT, src=pT_ps)
            u_ps = nl.ndarray((H, r), dtype=f32, buffer=nl.psum)
            nisa.nc_matmul(dst=u_ps, stationary=pT, moving=c_mm, accumulate=False)
            nisa.scalar_tensor_tensor(dst=U, data=U, op0=nl.multiply, operand0=alpha, op1=nl.add, operand1=u_ps)

        # ---- out_b = W_v,g (U / l) ----
        inv_l = nl.ndarray((H, 1), dtype=f32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv_l, data=l_sum)
        u_n = nl.ndarray((H, r), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=u_n, data=U, op0=nl.multiply, operand0=inv_l)
        uT_ps = scratch[:, 0 : RC * H]
        for c in range(RC):
            nisa.nc_transpose(dst=uT_ps[:, c * H : (c + 1) * H], data=u_n[:, c * P : (c + 1) * P])
        uT = nl.ndarray((P, RC, H), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=uT, src=uT_ps)
        o_ps = nl.ndarray((G, Hkv * hd), dtype=f32, buffer=nl.psum)
        for g in range(Hkv):
            for c in range(RC):
                nisa.nc_matmul(
                    dst=o_ps[:, g * hd : (g + 1) * hd],
                    stationary=uT[:, c, g * G : (g + 1) * G],
                    moving=wvT[:, c, g, :],
                    accumulate=c > 0,
                )
        o_sb = nl.ndarray((G, Hkv * hd), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o_sb, src=o_ps)
        # head h = g * G + j sits at [j, g * hd + d]
        nisa.dma_copy(dst=out.ap([[hd, G], [G * hd, Hkv], [1, hd]], offset=b * H * hd), src=o_sb)
    return out


def pick_bucket(max_len: int) -> int:
    """The smallest context bucket holding max_len keys; longer contexts are an error."""
    for bucket in BUCKETS:
        if max_len <= bucket:
            return bucket
    raise ValueError(f"context {max_len} exceeds the largest decode bucket {BUCKETS[-1]}")


def row_table(
    block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, bucket: int, n_rows: int
) -> torch.Tensor:
    """rows [B, bucket] int32: block_table[b, i // bs] * bs + i % bs for i < L_b, n_rows (out of range) after."""
    i = torch.arange(bucket, device=block_table.device)
    blk = (i // block_size).clamp(max=block_table.shape[1] - 1)
    rows = block_table.long()[:, blk] * block_size + i % block_size
    live = i[None, :] < seq_lens.to(block_table.device).long()[:, None]
    return torch.where(live, rows, n_rows).to(torch.int32)


def kernel_inputs(q: torch.Tensor, w: AbsorbedWeights, h: PagedLatents, bucket: int) -> tuple[Any, ...]:
    """`latent_decode_kernel`'s arguments for a context bucket of `bucket` keys (a multiple of 128 holding every
    L_b), from the model's tensors as it holds them: torch ops only, no host read (a compiled graph holds them).
    The cache may be [num_blocks, bs, r] or [rows, r], the key scales [..., Hkv] and an FP8 cache's latent_scales
    [num_blocks, bs] or [rows] (viewed, not copied); the block table becomes the per-key row table (`row_table`)."""
    cache = h.cache.reshape(-1, h.cache.shape[-1])
    key_scales = h.key_scales.reshape(-1, h.key_scales.shape[-1])
    lens = h.seq_lens.to(h.block_table.device)
    rows = row_table(h.block_table, lens, h.block_size, bucket, cache.shape[0])
    args = (q, w.gamma, w.w_k, w.w_v, cache, key_scales, rows, lens.to(q.device, torch.int32), float(w.scale))
    if h.latent_scales is not None:
        args += (h.latent_scales.reshape(-1),)
    return args


def device_bucket(table_width: int, block_size: int) -> int:
    """The kernel's bucket for a block table of `table_width` blocks (a compiled graph's context bucket): its keys
    rounded up to whole 128-key tiles. Fixed by the shapes alone, so a graph needs no host read to choose it."""
    return -(-table_width * block_size // P) * P


def latent_decode_nki(
    q: torch.Tensor,
    w: AbsorbedWeights,
    h: PagedLatents,
    runner: Callable[[Callable[..., Any]], Callable[..., torch.Tensor]],
    bucket: int | None = None,
) -> torch.Tensor:
    """Run `latent_decode_kernel` on the model's tensors as it holds them; [B, H, hd] fp32.

    `runner` is the shim's `simulate` in emulation, or whatever calls an `nki.jit` kernel on the
    device. Checks the compile-time contract (the op's `PagedLatents.lengths`, a block size that is a
    power of two, L_b <= bucket), picks the smallest bucket holding max(L_b) unless `bucket` is
    given (a multiple of 128; tests use small ones), and calls `runner(latent_decode_kernel)` on
    `kernel_inputs`. A float cache calls the kernel with the same arguments as before the FP8 variant existed.
    """
    check_latent_scales(h)
    bs = h.block_size
    if bs < 1 or bs & (bs - 1):
        raise ValueError(f"block_size {bs} is not a power of two")
    max_len = max(h.lengths(q.shape[0]))
    if bucket is None:
        bucket = pick_bucket(max_len)
    elif bucket % P:
        raise ValueError(f"bucket {bucket} is not a multiple of {P}")
    if max_len > bucket:
        raise ValueError(f"seq_len {max_len} exceeds the kernel's bucket {bucket}")
    return runner(latent_decode_kernel)(*kernel_inputs(q, w, h, bucket)).float()


def latent_decode_cost(
    seq_lens: list[int],
    bucket: int | None = None,
    H: int = 32,
    Hkv: int = 4,
    hd: int = 128,
    r: int = 256,
    cache_bytes: int = 2,
    q_bytes: int = 2,
    w_bytes: int = 2,
    gamma_bytes: int = 2,
    fp8: bool = False,
) -> dict[str, int]:
    """Per-call cost of `latent_decode_kernel` for a batch with these context lengths.

    `cache_bytes` is the latent cache's element size; `fp8=True` is an FP8 cache (1 byte per latent
    element whatever `cache_bytes` says, plus its 4-byte dequantization scale per key, one more
    gather per tile). DMA bytes are counted on the HBM side, skipped (out-of-range) gather rows move
    nothing. Returns HBM->SBUF and SBUF->HBM bytes, their sum `dma_bytes`, the analytic minimum
    `dma_bytes_min` (every valid latent, key scale and dequantization scale once, q, out, weights,
    gamma), `latent_bytes` (the latent elements of the valid keys, the part FP8 halves against bf16),
    the DMA, matmul and PE-transpose instruction counts and the matmuls' multiply-accumulates.
    """
    B, n_keys = len(seq_lens), sum(seq_lens)
    bucket = pick_bucket(max(seq_lens)) if bucket is None else bucket
    NT, RC = bucket // P, r // P
    latent_bytes = r * (1 if fp8 else cache_bytes)
    per_key = latent_bytes + Hkv * 4 + (4 if fp8 else 0)
    weights = 2 * Hkv * hd * r * w_bytes
    to_sbuf = hd * gamma_bytes + P * B * 4 + weights + B * (bucket * 4 + H * hd * q_bytes) + n_keys * per_key
    to_hbm = B * H * hd * 4
    return {
        "dma_hbm_to_sbuf_bytes": to_sbuf,
        "dma_sbuf_to_hbm_bytes": to_hbm,
        "dma_bytes": to_sbuf + to_hbm,
        "dma_bytes_min": n_keys * per_key + B * H * hd * (q_bytes + 4) + weights + hd * gamma_bytes,
        "latent_bytes": n_keys * latent_bytes,
        "dma_instructions": 4 + B * (3 + (3 if fp8 else 2) * NT),
        "matmul_instructions": B * (2 * RC * Hkv + NT * (RC + 1)),
        "transpose_instructions": Hkv * RC + B * (1 + RC + NT * (RC + 2)),
        "matmul_macs": B * (2 * H * hd * r + NT * 2 * P * H * r),
    }
