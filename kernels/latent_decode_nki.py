"""Absorbed latent decode attention (MLA-Trinity's global layers) as an NKI kernel for trn2 (NKI 0.7/0.8, LNC=1 or 2).

Entry points: the kernel `latent_decode_kernel`, its host wrapper `latent_decode_nki` (the op's arguments plus a
runner, the same result; `kernel_inputs` expands the block table into the per-key row table the kernel reads) and its
cost formula `latent_decode_cost`. The op's math, its definition `latent_decode_reference` and the torch path are in
latent_decode.py. The batch rows and a row's 128-key tiles are `nl.fori_loop`s; a masked key is pointed at the
sequence's key 0 and selected away, never addressed out of bounds. LNC=2: program p decodes its half of the batch rows
(at B = 1 one core idles). Numerics: the only rounding below fp32 is p, cast to the cache dtype for the p^T C matmul
(p d_i to bf16 with an FP8 cache); every output row is bit-identical to the sequence's single-sequence run at either
LNC, and NaN or garbage past a sequence's end changes no bit.

Design (indices, masking, loops, tiling, DMA traffic, numerics): docs/kernels.md, section
'Latent decode kernel (`kernels/latent_decode_nki.py`): design'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_trn_plugin.kernels.latent_decode import AbsorbedWeights, PagedLatents, check_latent_scales
from vllm_trn_plugin.kernels.nki_shim import nisa, nki, nl

P = 128  # partitions; keys per tile
LNC_DEGREES = (1, 2)  # the LNC degrees the kernel runs at (kernels/nki_ops.py refuses a deployment at another)
BUCKETS = (2304, 4352, 8448, 16640)  # context buckets (keys); each a whole number of 128-key tiles
FLT_MAX = 3.4028234663852886e38


@nki.jit
def latent_decode_kernel(q, gamma, w_k, w_v, cache, key_scales, rows, seq_lens, scale, latent_scales=None):
    """Absorbed latent decode attention for B sequences of one query token each.

    q [B, H, hd] (after q_norm), gamma [hd] (k_norm weight), w_k / w_v [Hkv, hd, r],
    cache [N, r] latents, key_scales [N, Hkv] fp32, rows [B, bucket] int32 (row of key i; only i < L_b is read),
    seq_lens [B] int32 (1 <= L_b <= bucket), scale: float; latent_scales [N] fp32 with an FP8 cache (its per-key
    dequantization scales d_i), None with a float cache. Returns out [B, H, hd] fp32.
    The shapes are compile-time, the lengths are not: B and the bucket (rows.shape[1], a multiple of 128) size no
    loop of the program (both loops are `nl.fori_loop`s, the tile loop's trip count ceil(L_b / 128) loaded at run
    time). At LNC=2 program p decodes its half of the batch rows. Limits: hd <= 128, H <= 128, r a multiple of 128
    and <= 512, Hkv * hd <= 512 (one PSUM bank each for p^T C and the output). Tiling and numerics: docs/kernels.md,
    section 'Latent decode kernel (`kernels/latent_decode_nki.py`): design'.
    """
    B, H, hd = q.shape
    Hkv, _, r = w_k.shape
    G = H // Hkv
    bucket = rows.shape[1]
    NT = bucket // P
    RC = r // P
    cdt = cache.dtype
    f32 = nl.float32
    fp8 = latent_scales is not None  # an FP8 cache (the wrapper checks the pairing: check_latent_scales)
    mdt = nl.bfloat16 if fp8 else cdt  # dtype of the latents' PE operands (the TensorE has no FP8 transpose)
    # LNC: program p takes the batch rows [b0, b1) (contiguous halves; the last program may get one row fewer, or
    # none at B = 1). Every row is decoded by the same instructions on either core, so the split changes no bit.
    n_prog, prog = nl.num_programs(0), nl.program_id(0)
    per = -(-B // n_prog)
    b0, b1 = min(B, prog * per), min(B, (prog + 1) * per)
    out = nl.ndarray((B, H, hd), dtype=f32, buffer=nl.shared_hbm)  # one tensor, each program writes its rows
    row_tiles = rows.reshape((B * NT, P))  # tile n of the flat table: keys 128 (n % NT) + p of row n // NT

    # ---- once per call ----
    gam = nl.ndarray((hd, 1), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=gam, src=gamma.ap([[1, hd], [1, 1]]))
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
    part_idx = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)  # p: a key's place in its tile
    nisa.iota(dst=part_idx, pattern=[[0, 1]], offset=0, channel_multiplier=1)
    zero_col = nl.ndarray((H, 1), dtype=f32, buffer=nl.sbuf)
    nisa.memset(dst=zero_col, value=0.0)
    # first / end tile number (in row_tiles) of the running row: b * NT and b * NT + ceil(L_b / 128)
    tile_lo = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.memset(dst=tile_lo, value=b0 * NT)
    tile_hi = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    lo_reg = nisa.register_alloc(0)
    hi_reg = nisa.register_alloc(0)

    def sequence(b: Any) -> None:
        # ---- this row's length, its first key's row, its tile range ----
        # rem = L_b - 128 t on every partition (fp32, exact): the keys of tile t with p < rem are real
        rem = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rem, src=seq_lens.ap([[0, P], [1, 1]], offset=0, scalar_offset=b, indirect_dim=0))
        # masked keys of the last tile are pointed at the row's key 0 (real: L_b >= 1), never past L_b
        first = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=first, src=rows.ap([[0, P], [1, 1]], offset=0, scalar_offset=b, indirect_dim=0))
        n_tiles = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)  # ceil(L_b / 128) = (L_b + 127) >> 7
        nisa.tensor_scalar(dst=n_tiles, data=rem[0:1, 0:1], op0=nl.add, operand0=float(P - 1))
        nisa.tensor_scalar(dst=n_tiles, data=n_tiles, op0=nl.right_shift, operand0=7)
        nisa.tensor_tensor(dst=tile_hi, data1=tile_lo, data2=n_tiles, op=nl.add)
        nisa.register_load(lo_reg, tile_lo)
        nisa.register_load(hi_reg, tile_hi)

        # ---- q~^T [r, H] = W_k,g^T (gamma * scale * q_h) ----
        q_sb = nl.ndarray((H, hd), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=q_sb, src=q.ap([[hd, H], [1, hd]], offset=0, scalar_offset=b, indirect_dim=0))
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
        # -running max; it starts at FP32_MIN, not -inf, so no softmax state is ever infinite (m_old - m_new =
        # -inf - -inf cannot occur)
        neg_m = nl.ndarray((H, 1), dtype=f32, buffer=nl.sbuf)
        nisa.memset(dst=neg_m, value=FLT_MAX)

        def tile(t: Any) -> None:
            # the tile's row indices; keys p >= rem (past L_b) take the row of key 0 instead
            idx_t = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.dma_copy(dst=idx_t, src=row_tiles.ap([[1, P], [1, 1]], offset=0, scalar_offset=t, indirect_dim=0))
            valid = nl.ndarray((P, 1), dtype=nl.uint8, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=valid, data=part_idx, op0=nl.less, operand0=rem)
            idx = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=idx, src=first)
            nisa.tensor_copy_predicated(dst=idx, src=idx_t, predicate=valid)
            # every index is a row of this sequence: no access out of bounds, no reliance on oob_mode.skip
            c_t = nl.ndarray((P, r), dtype=cdt, buffer=nl.sbuf)
            nisa.dma_copy(dst=c_t, src=cache.ap([[r, P], [1, r]], offset=0, vector_offset=idx, indirect_dim=0))
            s_t = nl.ndarray((P, Hkv), dtype=f32, buffer=nl.sbuf)
            nisa.dma_copy(dst=s_t, src=key_scales.ap([[Hkv, P], [1, Hkv]], offset=0, vector_offset=idx, indirect_dim=0))
            if fp8:
                d_t = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
                nisa.dma_copy(
                    dst=d_t, src=latent_scales.ap([[1, P], [1, 1]], offset=0, vector_offset=idx, indirect_dim=0)
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

            # keys j >= rem (past L_b) -> FP32_MIN by selection; the tile's row max comes out of the same
            # instruction (finite: every row keeps FP32_MIN at worst)
            s_m = nl.ndarray((H, P), dtype=f32, buffer=nl.sbuf)
            t_max = nl.ndarray((H, 1), dtype=f32, buffer=nl.sbuf)
            nisa.range_select(
                dst=s_m,
                on_true_tile=scT_ps,
                comp_op0=nl.less,
                comp_op1=nl.greater_equal,
                bound0=rem[0:H, :],
                bound1=zero_col,
                reduce_cmd=nisa.reduce_cmd.reset_reduce,
                reduce_res=t_max,
                reduce_op=nl.maximum,
                range_start=0,
            )
            nm_new = nl.ndarray((H, 1), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=nm_new, data=t_max, op0=nl.multiply, operand0=-1.0, op1=nl.minimum, operand1=neg_m)
            alpha = nl.ndarray((H, 1), dtype=f32, buffer=nl.sbuf)  # exp(m_old - m_new)
            nisa.activation(dst=alpha, op=nl.exp, data=neg_m, bias=nm_new, scale=-1.0)
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
            nisa.tensor_copy(dst=neg_m, src=nm_new)  # the state for the next tile (no ping-pong by tile parity)
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
            nisa.tensor_scalar(dst=rem, data=rem, op0=nl.subtract, operand0=float(P))

        nl.fori_loop(lo_reg, hi_reg, tile)

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
        nisa.dma_copy(
            dst=out.ap([[hd, G], [G * hd, Hkv], [1, hd]], offset=0, scalar_offset=b, indirect_dim=0), src=o_sb
        )
        nisa.tensor_scalar(dst=tile_lo, data=tile_lo, op0=nl.add, operand0=float(NT))  # the next row's tiles

    nl.fori_loop(b0, b1, sequence)
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
    lnc: int = 1,
) -> dict[str, Any]:
    """Per-call cost of `latent_decode_kernel` for a batch with these context lengths, launched at LNC `lnc`.

    `cache_bytes` is the latent cache's element size; `fp8=True` is an FP8 cache (1 byte per latent element whatever
    `cache_bytes` says, plus its 4-byte dequantization scale per key, one more gather per tile). Each sequence runs
    ceil(L_b / 128) tiles of 128 gathered keys (the last tile's keys past L_b gather the sequence's key 0). Returns the
    emulator's counters (kernels/kernel_cost.py: DMA bytes HBM->SBUF and SBUF->HBM and their sum `dma_bytes`,
    DMA instructions and descriptors, `dma_transfer_ns` / `dma_time_ns`, matmul and PE-transpose instructions,
    multiply-accumulates, emitted and executed instructions) summed over the programs, each program's under
    `programs` (program p decodes the p-th contiguous half of the rows), the slowest core's DMA times, and the
    analytic minimum: `dma_bytes_min` (every valid latent, key scale and dequantization scale once, q, out, weights,
    gamma) and `dma_time_min_ns`, that minimum split evenly over the cores at their full DMA rate. `latent_bytes` is
    the latent elements of the valid keys, the part FP8 halves against bf16.
    """
    from vllm_trn_plugin.kernels.kernel_cost import Tally, busiest, combine, min_time_ns

    B, n_keys = len(seq_lens), sum(seq_lens)
    bucket = pick_bucket(max(seq_lens)) if bucket is None else bucket
    RC, G = r // P, H // Hkv
    latent_bytes = r * (1 if fp8 else cache_bytes)
    per_key = latent_bytes + Hkv * 4 + (4 if fp8 else 0)
    weights = 2 * Hkv * hd * r * w_bytes
    # instructions of the program text (docs/kernels.md, latent decode kernel design): once, per sequence, per tile
    once = 8 + 2 * Hkv * RC
    per_row = 20 + 2 * RC * Hkv + RC
    per_tile = 20 + 2 * RC + (2 if fp8 else 0)
    per = -(-B // lnc)
    programs = []
    for prog in range(lnc):
        rows = seq_lens[min(B, prog * per) : min(B, (prog + 1) * per)]
        tiles = sum(-(-L // P) for L in rows)
        n = len(rows)
        t = Tally()
        t.dma(1, hd, gamma_bytes, busiest(0, hd))  # gamma: one element per partition
        t.dma(2, hd * Hkv, r * w_bytes, busiest(0, hd, Hkv))  # W_k, W_v: a row of r per (partition, group)
        t.dma(2 * n, P, 4, busiest(0, P))  # L_b and the row of key 0, broadcast to the partitions
        t.dma(n, H, hd * q_bytes, busiest(0, H))  # q_b
        t.dma(n, G * Hkv, hd * 4, busiest(0, G, Hkv), to_hbm=True)  # out_b: one head row per (partition, group)
        t.dma(tiles, P, 4, busiest(0, P))  # the tile's row indices
        t.dma(tiles, P, latent_bytes, busiest(0, P))  # latents: one row per key
        t.dma(tiles, P, Hkv * 4, busiest(0, P))  # key scales
        t.dma(tiles if fp8 else 0, P, 4, busiest(0, P))  # dequantization scales
        t.add(
            matmul_instructions=n * 2 * RC * Hkv + tiles * (RC + 1),
            transpose_instructions=Hkv * RC + n * (1 + RC) + tiles * (RC + 2),
            matmul_macs=n * 2 * H * hd * r + tiles * 2 * P * H * r,
            emitted_instructions=once + 1 + per_row + 1 + per_tile,
            executed_instructions=once + 1 + n * (per_row + 1) + tiles * per_tile,
        )
        programs.append(t.result())
    dma_min = n_keys * per_key + B * H * hd * (q_bytes + 4) + weights + hd * gamma_bytes
    return combine(
        programs,
        dma_bytes_min=dma_min,
        dma_time_min_ns=min_time_ns(dma_min / lnc),
        latent_bytes=n_keys * latent_bytes,
    )
