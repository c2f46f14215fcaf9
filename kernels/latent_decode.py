"""Absorbed latent decode attention (MLA-Trinity's global layers): the op's definition and its torch path.

Math, per sequence b (one query token), query head h of KV group g = h // G (G = H / Hkv)::

    q~_h    = W_k,g^T (gamma * q_h)                              r-wide   (W_k [Hkv, hd, r])
    score_i = scale * (q~_h . c_i) * s_g,i    for keys i < L_b   (s = key_scales[row_i, g])
    u_h     = sum_i softmax_i(score) c_i                         latent space
    out_h   = W_v,g u_h                                          (W_v [Hkv, hd, r])

row_i = block_table[b, i // bs] * bs + i % bs. K and V are never formed: every cached latent is
read once and used by both products; s_g,i = 1 / rms(W_k,g c_i) is the exact per-key norm scale
the model computes once at cache-write time (model_executors/latent_attention.py).

An FP8 latent cache (Trainium2 E4M3, |x| <= 240, `fp8.quantize_per_token`: the activations' rounding, one
scale per token from its absolute maximum, so no finite latent saturates or becomes NaN) stores each latent as codes
c8_i with one float32 dequantization scale d_i per token (`latent_scales`): c_i = d_i * fp32(c8_i), and s_g,i is
computed from that c_i (the latent as stored). d_i is per token like s_g,i, so the decode folds it into the two
per-key factors instead of scaling the r-wide tile: score_i = scale * (q~_h . c8_i) * (d_i s_g,i) and
u_h = sum_i (p_i d_i) c8_i.

Where each form lives:
- `latent_decode_reference` (here): the definition in plain fp32 torch, each sequence's rows gathered
  and a full softmax. It is the reference the tests compare the torch path and the NKI kernel against
  (beside the unabsorbed float64 attention written in tests/test_latent_decode_nki.py).
- `latent_decode_torch` (here): what the model runs off device, one sequence at a time, the history
  read in tiles of about DECODE_TILE keys with an online softmax (running max m, normaliser l, latent
  accumulator u), so each tile is used by both products while it is still in cache.
- `latent_decode_nki.py`: the NKI kernel, its host wrapper and its cost formula.
`dispatch.latent_decode` picks the torch path or the kernel. All three take the same arguments, the queries
q [B, H, hd] (after q_norm), the layer's `AbsorbedWeights` and the batch's `PagedLatents` (checked by
`PagedLatents.lengths`), and return [B, H, hd] fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_trn_plugin.kernels.fp8 import FP8_DTYPE, fp8_to_float32

DECODE_TILE = 2048  # keys per tile of the torch path (rounded to whole cache blocks)
_workspace: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}


class AbsorbedWeights(NamedTuple):
    """A latent layer's decode weights: gamma [hd] (k_norm weight), w_k / w_v [Hkv, hd, r] (rows of kv_b_proj), and
    the softmax scale."""

    gamma: torch.Tensor
    w_k: torch.Tensor
    w_v: torch.Tensor
    scale: float


class PagedLatents(NamedTuple):
    """A batch's latent history in vLLM's paged cache: cache [N, r] or [num_blocks, bs, r], key_scales [N, Hkv] fp32
    (paged alike), block_table [B, max_blocks], seq_lens [B]; key i of sequence b is row
    block_table[b, i // block_size] * block_size + i % block_size. An FP8 cache (float8_e4m3fn codes) comes with
    latent_scales [N] fp32 (paged alike), its per-token dequantization scales; a cache in a float dtype with None."""

    cache: torch.Tensor
    key_scales: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int
    latent_scales: torch.Tensor | None = None

    def lengths(self, num_queries: int) -> list[int]:
        """L_b of every sequence as host ints, checked: one per query, 1 <= L_b <= the blocks block_table holds."""
        lens = self.seq_lens.tolist()
        if len(lens) != num_queries or min(lens, default=1) < 1:
            raise ValueError(
                f"every sequence needs 1 <= seq_len (one per query): {num_queries} queries, seq_lens {lens}"
            )
        if max(lens, default=0) > self.block_table.shape[1] * self.block_size:
            raise ValueError(
                f"seq_len {max(lens)} needs more blocks than block_table has ({self.block_table.shape[1]})"
            )
        return lens


def _scratch(name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused flat buffer of n elements for one use (`name`) of the torch path: a fresh tensor per tile would page-
    fault its pages in on every step (docs/kernels.md has the measurement). Its contents live until the next call
    with the same name, so only a value consumed before then may sit in it."""
    # One buffer per inference-mode state: a buffer made under vLLM's inference_mode is an inference tensor, which
    # a later no_grad caller (or vice versa) may not write in place.
    key = (name, dtype, device, torch.is_inference_mode_enabled())
    buf = _workspace.get(key)
    if buf is None or buf.numel() < n:
        buf = _workspace[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n]


def dequantize_latents(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """c_i = d_i * fp32(code_i): [T, r] fp32 (the codes converted by `fp8_to_float32`, equal to torch's conversion)."""
    if codes.dtype != FP8_DTYPE:
        return codes.float() * scales.float()[:, None]
    work = _scratch("fp8 half bits", codes.numel(), torch.int16, codes.device)
    return fp8_to_float32(codes, work=work).mul_(scales.float()[:, None])


def check_latent_scales(h: PagedLatents) -> None:
    """An FP8 cache needs its dequantization scales, one per row; a float cache has none."""
    fp8 = h.cache.dtype == FP8_DTYPE
    if fp8 != (h.latent_scales is not None):
        raise ValueError(
            f"latent cache of dtype {h.cache.dtype} with{'' if h.latent_scales is not None else 'out'} latent_scales: "
            "an FP8 cache needs its per-token dequantization scales, a float cache has none"
        )
    if fp8 and h.latent_scales.numel() * h.cache.shape[-1] != h.cache.numel():
        raise ValueError(
            f"latent_scales holds {h.latent_scales.numel()} rows, the cache {h.cache.numel() // h.cache.shape[-1]}"
        )


def latent_decode_reference(q: torch.Tensor, w: AbsorbedWeights, h: PagedLatents) -> torch.Tensor:
    """The op's definition: gather each sequence's rows (an FP8 cache dequantized), full softmax, all in fp32."""
    B, H, hd = q.shape
    Hkv, _, r = w.w_k.shape
    check_latent_scales(h)
    cache, key_scales, bs = h.cache.reshape(-1, r), h.key_scales.reshape(-1, Hkv), h.block_size
    out = torch.empty(B, H, hd, dtype=torch.float32, device=q.device)
    for b, L in enumerate(h.lengths(B)):
        i = torch.arange(L, device=q.device)
        rows = h.block_table[b].long()[i // bs] * bs + i % bs
        # torch's own FP8 conversion here, not fp8_to_float32: the definition stays independent of the fast path.
        c = cache[rows].float()  # [L, r]
        if h.latent_scales is not None:
            c = c * h.latent_scales.reshape(-1)[rows].float()[:, None]
        qg = (q[b].float() * w.gamma.float()).view(Hkv, H // Hkv, hd)
        q_lat = torch.einsum("gjd,gdr->gjr", qg, w.w_k.float())
        score = w.scale * torch.einsum("gjr,lr->gjl", q_lat, c) * key_scales[rows].float().t()[:, None, :]
        u = torch.softmax(score, dim=-1) @ c  # [Hkv, G, r]
        out[b] = torch.einsum("gjr,gdr->gjd", u, w.w_v.float()).reshape(H, hd)
    return out


def gather_blocks(blocks: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Rows [0, length) of one request's paged history: `blocks` is [num_blocks, block_size, w].

    Copied block by block into a reused workspace: a fresh tensor per call would page-fault its pages in
    on every step (docs/kernels.md has the measurement).
    """
    w = blocks.shape[-1]
    n = block_ids.numel() * blocks.shape[1] * w
    out = _scratch("gather", n, blocks.dtype, blocks.device).view(block_ids.numel(), blocks.shape[1], w)
    if blocks.dtype == FP8_DTYPE:  # copied as bytes: index_select's float8 copy is about 2x slower than uint8's
        torch.index_select(blocks.view(torch.uint8), 0, block_ids, out=out.view(torch.uint8))
    else:
        torch.index_select(blocks, 0, block_ids, out=out)
    return out.view(-1, w)[:length]


def _absorbed_decode(
    q: torch.Tensor,
    w: AbsorbedWeights,
    cache_blocks: torch.Tensor,
    scale_blocks: torch.Tensor,
    latent_scale_blocks: torch.Tensor | None,
    block_ids: torch.Tensor,
    length: int,
) -> torch.Tensor:
    """One query q [H, hd] over the first `length` cached latents, in tiles with an online softmax (an FP8 tile's
    dequantization scales folded into the per-key factors, module docstring)."""
    H, hd = q.shape
    Hkv, _, r = w.w_k.shape
    group, bs = H // Hkv, cache_blocks.shape[1]
    qg = (q.float() * w.gamma.float()).view(Hkv, group, hd)
    q_lat = torch.einsum("gjd,gdr->gjr", qg, w.w_k).reshape(H, r)  # W_k,g^T (gamma * q_h)
    m = q_lat.new_full((H, 1), float("-inf"))
    l = q_lat.new_zeros(H, 1)
    u = q_lat.new_zeros(H, r)
    per_tile = max(1, DECODE_TILE // bs)
    for start in range(0, block_ids.numel(), per_tile):
        ids = block_ids[start : start + per_tile]
        n = min(length - start * bs, ids.numel() * bs)
        c = gather_blocks(cache_blocks, ids, n)
        if c.dtype == FP8_DTYPE:  # into a reused buffer: the tile is consumed within this iteration
            tile = _scratch("fp8 tile", c.numel(), torch.float32, c.device).view(c.shape)
            c = fp8_to_float32(c, tile, work=_scratch("fp8 half bits", c.numel(), torch.int16, c.device))
        else:
            c = c.float()
        key_scale = scale_blocks[ids].view(-1, Hkv)[:n].t() * w.scale  # [Hkv, n]
        d = None if latent_scale_blocks is None else latent_scale_blocks[ids].reshape(-1)[:n].float()
        if d is not None:
            key_scale = key_scale * d
        scores = ((q_lat @ c.t()).view(Hkv, group, n) * key_scale[:, None, :]).view(H, n)
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        alpha, p = torch.exp(m - m_new), torch.exp(scores - m_new)
        l = l * alpha + p.sum(-1, keepdim=True)
        u = u * alpha + (p if d is None else p * d) @ c  # the weighted sum stays in latent space
        m = m_new
    u = (u / l).view(Hkv, group, r)
    return torch.einsum("gjr,gdr->gjd", u, w.w_v).reshape(H, hd)


def latent_decode_torch(q: torch.Tensor, w: AbsorbedWeights, h: PagedLatents) -> torch.Tensor:
    """MLA-Trinity's absorbed latent decode on the torch path: `latent_decode_reference`'s arguments (w_k, w_v
    fp32) and result, one sequence at a time in DECODE_TILE-key tiles."""
    B, H, hd = q.shape
    Hkv, _, r = w.w_k.shape
    bs = h.block_size
    check_latent_scales(h)
    cache_blocks, scale_blocks = h.cache.view(-1, bs, r), h.key_scales.view(-1, bs, Hkv)
    latent_scale_blocks = None if h.latent_scales is None else h.latent_scales.view(-1, bs)
    out = torch.empty(B, H, hd, dtype=torch.float32, device=q.device)
    for b, L in enumerate(h.lengths(B)):
        ids = h.block_table[b, : -(-L // bs)].long()
        out[b] = _absorbed_decode(q[b], w, cache_blocks, scale_blocks, latent_scale_blocks, ids, L)
    return out
