"""Simple Gated Linear Attention (Laplace's mixer core): chunked prefill and the decode step.

Per head h with a fixed decay lambda_h, key width d_k and value width d_v, the state
S (d_k x d_v, fp32) evolves token by token::

    S_t = lambda_h * S_{t-1} + k_t v_t^T
    o_t = scale * q_t^T S_t + sigmoid(sum_c q_c * a_h,c * k_c) * v_t      (self-augmentation)

Chunked prefill (chunks of C = 128 tokens, O(T)). Inside a chunk starting from state S_0,
for positions i = 0..L-1 of a chunk of length L::

    o_i   = scale * (lambda^(i+1) q_i^T S_0 + sum_{j<=i} lambda^(i-j) (q_i . k_j) v_j) + aug_i
    S_end = lambda^L S_0 + sum_j lambda^(L-1-j) k_j v_j^T

Varlen: only the real chunks are computed (chunk c of a sequence exists if it has tokens; a
sequence's last chunk may be partial), packed as [num_real_chunks, H, C, d], so a step's work
and memory follow its tokens, not N x its longest sequence. The intra-chunk part is one masked
(C x C) attention per real chunk, all at once; only the state hand-over between chunks is
sequential, over the chunk index, each step batched over the sequences that have that chunk
(O(T) in all). Decay powers are formed as exp((i-j) log lambda) on the causal triangle only, never
as lambda^i * lambda^-j (which overflows fp32 for lambda = 0.5 at i = 128).

C = 128 matches Trainium's 128 SBUF partitions: a chunk's (C x C) score tile and its (d_k x d_v)
state update are single TensorE matmuls.

All math runs in fp32 whatever the activation dtype; outputs are cast back to q's dtype.

Where each form lives: this module is the op's definition and its torch path at once.
`simple_gla_decode_step` is the per-token recurrence above (the reference the NKI decode kernel,
simple_gla_nki.py, is compared against) and what the model runs off device (`dispatch.gla_decode_step`
picks it or the kernel); the chunked prefill has no kernel. The tests compare both against a float64
per-token recurrence of their own and fla's naive GLA (tests/test_simple_gla.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 128


def geometric_log_decay(num_heads: int, t_min: float, t_max: float) -> torch.Tensor:
    """log(lambda_h) for half-lives geometric between t_min and t_max: lambda_h = 2^(-1/T_h)."""
    h = torch.arange(num_heads, dtype=torch.float64)
    denom = max(num_heads - 1, 1)
    half_life = t_min * (t_max / t_min) ** (h / denom)
    return (-torch.log(torch.tensor(2.0, dtype=torch.float64)) / half_life).to(torch.float32)


def _self_augmentation(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aug: torch.Tensor) -> torch.Tensor:
    """sigmoid(sum_c q_c a_c k_c) * v, per head. q, k [..., H, dk]; v [..., H, dv]; aug [H, dk]."""
    gate = torch.sigmoid((q * aug * k).sum(-1, keepdim=True))
    return gate * v


def check_packed(num_tokens: int, cu_seqlens: torch.Tensor, state: torch.Tensor, what: str) -> None:
    """cu_seqlens must describe num_tokens packed tokens, and state hold one entry per sequence."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{what}: cu_seqlens must be 1-D with N+1 >= 1 entries, got shape {tuple(cu_seqlens.shape)}")
    if state.shape[0] != cu_seqlens.numel() - 1:
        raise ValueError(f"{what}: the state holds {state.shape[0]} sequences, cu_seqlens {cu_seqlens.numel() - 1}")
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens or bool((lens < 0).any()):
        raise ValueError(
            f"{what}: cu_seqlens must rise from 0 to the {num_tokens} packed tokens, got {cu_seqlens.tolist()}"
        )


def simple_gla_chunked_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    aug: torch.Tensor,
    log_decay: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked Simple GLA over a packed batch of variable-length sequences.

    q, k: [T, H, dk]; v: [T, H, dv]; aug: [H, dk]; log_decay: [H];
    cu_seqlens: [N+1] int (cumulative lengths, cu_seqlens[0] = 0, cu_seqlens[N] = T; a length-0
    sequence hands its state on unchanged); initial_state: [N, H, dk, dv] fp32.
    Returns (o [T, H, dv] in q's dtype, final_state [N, H, dk, dv] fp32).
    """
    out_dtype = q.dtype
    T, H, dk = q.shape
    dv = v.shape[-1]
    N = cu_seqlens.numel() - 1
    C = chunk_size
    dev = q.device
    check_packed(T, cu_seqlens, initial_state, "simple_gla_chunked_prefill")
    qf, kf, vf = q.float(), k.float(), v.float()
    ld = log_decay.to(dev, torch.float32)

    # The chunk layout is planned on the host, from host offsets (vLLM's query_start_loc_cpu),
    # so no device value is read back. Sequences are ordered by chunk count, most first (stable),
    # so that the sequences that still have a chunk c are a prefix of that order. Real chunks are
    # numbered c-major in it: chunk c of the sequence of rank r is chunk starts[c] + r, and the
    # chunks with index c are the contiguous range [starts[c], starts[c] + counts[c]).
    cu_h = cu_seqlens.cpu().long()
    lens_h = cu_h[1:] - cu_h[:-1]
    n_chunks = (lens_h + C - 1) // C  # real chunks of each sequence
    max_chunks = int(n_chunks.max()) if N else 0
    order_h = torch.argsort(n_chunks, descending=True, stable=True)
    counts_h = N - torch.bincount(n_chunks, minlength=max_chunks + 1).cumsum(0)[:max_chunks]
    starts_h = counts_h.cumsum(0) - counts_h
    M = int(counts_h.sum())  # real chunks
    rank_h = torch.empty_like(order_h)
    rank_h[order_h] = torch.arange(N)
    # Real chunk m is chunk c = chunk_idx[m] of the sequence of rank m - starts[c]; its length L[m] is C but for
    # a sequence's last chunk.
    chunk_idx_h = torch.repeat_interleave(torch.arange(max_chunks), counts_h, output_size=M)
    chunk_seq_h = order_h[torch.arange(M) - starts_h[chunk_idx_h]]
    L_h = (lens_h[chunk_seq_h] - chunk_idx_h * C).clamp(max=C)
    seq_id = torch.repeat_interleave(torch.arange(N), lens_h, output_size=T)
    pos = torch.arange(T) - cu_h[seq_id]
    chunk_h, intra_h = starts_h[pos // C] + rank_h[seq_id], pos % C  # token -> its real chunk, row in it
    width_h = _tile_rows(L_h, C)

    idx = torch.arange(C, device=dev, dtype=torch.float32)
    # Intra-chunk decay mask D[h, i, j] = lambda_h^(i-j) for j <= i, else 0.
    diff = idx[:, None] - idx[None, :]
    D = torch.where(diff >= 0, torch.exp(diff.clamp(min=0) * ld[:, None, None]), 0.0)  # [H, C, C]
    L = L_h.to(dev)
    widths = width_h.unique().tolist()
    # U: each chunk's own contribution to the state it hands on (with one tile width, the matmul's own output)
    states = qf.new_empty(M, H, dk, dv) if len(widths) > 1 else None
    tiles = []  # per tile width P: its tokens, their (chunk, row) in the tiles, and the tiles' q and o
    for P in widths:
        # The chunks of one tile width, packed as [M_P, H, P, d] with zeros past a chunk's end: a short chunk
        # (a sequence's last) takes the power of two that holds it, not C rows, so that a step of many short
        # prompts costs what its tokens cost.
        members_h = (width_h == P).nonzero().squeeze(1)
        local_h = torch.full((M,), -1, dtype=torch.long)
        local_h[members_h] = torch.arange(members_h.numel())
        tok_h = (local_h[chunk_h] >= 0).nonzero().squeeze(1)
        tok, members = tok_h.to(dev), members_h.to(dev)
        row, col = local_h[chunk_h[tok_h]].to(dev), intra_h[tok_h].to(dev)

        # [T, H, d] -> [M_P, H, P, d], zeros past a chunk's end
        qp, kp, vp = (_pack(x, tok, row, col, members_h.numel(), P) for x in (qf, kf, vf))
        o = (qp @ kp.transpose(-1, -2)).mul_(D[:, :P, :P]) @ vp  # [M_P, H, P, dv]
        # Contribution of each chunk to the state it hands on: sum_j lambda^(L-1-j) k_j v_j^T.
        # Past the chunk's end k is zero; the where keeps exp of a negative step count out of it.
        Lp, ip = L[members], idx[:P]
        steps_to_end = (Lp[:, None] - 1 - ip).clamp(min=0)  # [M_P, P]
        w = torch.where((ip < Lp[:, None])[:, None, :], torch.exp(steps_to_end[:, None, :] * ld[:, None]), 0.0)
        U = kp.mul_(w[..., None]).transpose(-1, -2) @ vp
        states = U if states is None else states.index_copy_(0, members, U)
        del kp, vp
        tiles.append((tok, members, row, col, qp, o))
    chunk_decay = torch.exp(L[:, None].float() * ld)[..., None, None]  # lambda^L, [M, H, 1, 1]

    S_init = initial_state.to(dev, torch.float32)
    if max_chunks == 1 and M == N:
        # Every sequence one chunk (a burst of short prompts): chunk m is sequence m; it starts from its initial
        # state and hands on lambda^L S_0 + U, formed in U's place: no state beyond the one each sequence hands on.
        starts_from, final = S_init, states.addcmul_(chunk_decay, S_init)
    else:
        # Sequential hand-off over the chunk index, each step touching only the sequences that
        # have that chunk (a prefix of `order`): total work is proportional to M. On the way,
        # `states` is overwritten with the state each chunk starts from.
        S = S_init[order_h.to(dev)]
        for s0, n in zip(starts_h.tolist(), counts_h.tolist(), strict=True):
            S_next = torch.addcmul(states[s0 : s0 + n], chunk_decay[s0 : s0 + n], S[:n])
            states[s0 : s0 + n] = S[:n]
            S[:n] = S_next
            del S_next
        starts_from, final = states, torch.empty_like(S)
        final[order_h.to(dev)] = S
        del S

    # o_i += lambda^(i+1) q_i^T S_0, with S_0 the state the chunk starts from.
    o_tok = qf.new_empty(T, H, dv)
    while tiles:
        tok, members, row, col, qp, o = tiles.pop()
        P, Mp = qp.shape[2], qp.shape[0]
        qp.mul_(torch.exp((idx[:P] + 1)[:, None] * ld).t()[..., None])  # lambda^(i+1), [H, P, 1]
        S0 = starts_from if Mp == M else starts_from.index_select(0, members)  # one width: every chunk, in order
        o.view(Mp * H, P, dv).baddbmm_(qp.view(Mp * H, P, dk), S0.view(Mp * H, dk, dv))
        o_tok[tok] = o[row, :, col]
        del qp, o, S0  # each width's tiles go as soon as its tokens are out
    del states, starts_from
    o_tok.mul_(scale).add_(_self_augmentation(qf, kf, vf, aug.float()))
    return o_tok.to(out_dtype), final


def _pack(
    x: torch.Tensor, tok: torch.Tensor, row: torch.Tensor, col: torch.Tensor, chunks: int, P: int
) -> torch.Tensor:
    buf = x.new_zeros(chunks, x.shape[1], P, x.shape[-1])
    buf[row, :, col] = x[tok]
    return buf


def _tile_rows(L: torch.Tensor, C: int) -> torch.Tensor:
    """Rows of the tile each chunk is packed in: C for a full chunk, else the power of two that holds its L tokens,
    at least 16 (the widths a step uses number at most log2(C / 16) + 2, so its loop stays short)."""
    pow2 = torch.ones_like(L) << torch.ceil(torch.log2(L.clamp(min=16).double())).long()
    return torch.where(L >= C, C, pow2.clamp(max=C))


def simple_gla_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    aug: torch.Tensor,
    log_decay: torch.Tensor,
    scale: float,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One recurrent step for a batch of sequences, state read and written in place.

    q, k: [B, H, dk]; v: [B, H, dv]; state_pool: [num_slots, H, dk, dv] fp32; slots: [B] int,
    -1 marks a padding row: its state is never read or written and its output is zero.
    Returns o [B, H, dv] in q's dtype.
    """
    valid = slots >= 0
    idx = torch.where(valid, slots, 0).long()
    qf, kf, vf = q.float(), k.float(), v.float()
    lam = torch.exp(log_decay.to(q.device, torch.float32))[None, :, None, None]
    S = lam * state_pool[idx] + kf[..., :, None] * vf[..., None, :]
    o = scale * torch.einsum("bhd,bhde->bhe", qf, S) + _self_augmentation(qf, kf, vf, aug.float())
    o = torch.where(valid[:, None, None], o, 0.0)
    keep = valid.nonzero().squeeze(1)
    state_pool.index_copy_(0, idx[keep], S[keep])
    return o.to(q.dtype)


def simple_gla_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    aug: torch.Tensor,
    log_decay: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to P tokens per sequence from its state: a speculative verification step, whose tokens after the first
    vLLM accepts or rejects afterwards. The first token as the decode step computes it (op for op: the state after
    it is bit for bit the decode step's); the others from that state in the chunked form (one read of it, however
    many drafts), their decay mask lambda^(i-j) on the causal triangle.

    q, k: [B, P, H, dk]; v: [B, P, H, dv]; state: [B, H, dk, dv] fp32 (not modified); lengths: [B] int, the real
    tokens of each row (1..P; q, k, v past them must be finite: they are masked out). Returns (o [B, P, H, dv] in q's
    dtype, zero past a row's length; the state after each row's first token [B, H, dk, dv] fp32)."""
    B, P, H, _ = q.shape
    if B and int(lengths.min()) < 1:
        raise ValueError(f"simple_gla_verify: every row needs a token, lengths {lengths.tolist()}")
    ld = log_decay.to(q.device, torch.float32)
    qf, kf, vf = q.float(), k.float(), v.float()
    q0, k0, v0 = qf[:, 0], kf[:, 0], vf[:, 0]
    first = torch.exp(ld)[None, :, None, None] * state + k0[..., :, None] * v0[..., None, :]
    o = qf.new_zeros(B, P, H, v.shape[-1])
    o[:, 0] = scale * torch.einsum("bhd,bhde->bhe", q0, first)
    if P > 1:
        qd, kd, vd = qf[:, 1:], kf[:, 1:], vf[:, 1:]
        i = torch.arange(1, P, device=q.device, dtype=torch.float32)
        inter = torch.einsum("bphd,bhde->bphe", qd, first) * torch.exp(i[:, None] * ld)[None, :, :, None]
        diff = i[:, None] - i[None, :]  # [P-1, P-1]
        D = torch.where(diff >= 0, torch.exp(diff.clamp(min=0) * ld[:, None, None]), 0.0)  # [H, P-1, P-1]
        intra = torch.einsum("bhij,bjhe->bihe", torch.einsum("bihd,bjhd->bhij", qd, kd) * D, vd)
        o[:, 1:] = scale * (inter + intra)
    o = o + _self_augmentation(qf, kf, vf, aug.float())
    o = torch.where((torch.arange(P, device=q.device) < lengths[:, None])[..., None, None], o, 0.0)
    return o.to(q.dtype), first


def simple_gla_advance(
    k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, state: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The state after each row's first counts[b] tokens, one token at a time as the decode step advances it:
    S <- lambda * S + k v^T. k: [B, P, H, dk]; v: [B, P, H, dv]; state: [B, H, dk, dv] fp32 (not modified)."""
    lam = torch.exp(log_decay.to(k.device, torch.float32))[None, :, None, None]
    S = state
    for i in range(int(counts.max()) if counts.numel() else 0):
        kf, vf = k[:, i].float(), v[:, i].float()
        S = torch.where((i < counts)[:, None, None, None], lam * S + kf[..., :, None] * vf[..., None, :], S)
    return S


# --- one padded sequence, static shapes ---
# A compiled graph (one per input bucket) sees a sequence padded to the bucket's length T with its real length as a
# 0-d tensor: these forms mask on device what depends on it and read nothing back to the host.


def simple_gla_prefill_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    aug: torch.Tensor,
    log_decay: torch.Tensor,
    scale: float,
    length: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked Simple GLA over one sequence whose first `length` of T tokens are real (0-d integer tensor).

    q, k: [T, H, dk]; v: [T, H, dv]; initial_state: [H, dk, dv] fp32. Returns (o [T, H, dv] in q's dtype, the
    state after the real tokens [H, dk, dv] fp32); rows of o at padded positions are not meaningful. The math of
    `simple_gla_chunked_prefill` with the chunk count fixed by T: padded tokens' keys and values are zero and each
    chunk hands on the state after its last real token (chunk length L = clamp(length - c * C, 0, C); a chunk of
    padding hands its state on unchanged).
    """
    out_dtype = q.dtype
    T, H, dk = q.shape
    dv = v.shape[-1]
    C = chunk_size
    NC = -(-T // C)
    dev = q.device
    ld = log_decay.to(dev, torch.float32)
    real = torch.arange(T, device=dev) < length
    qf = q.float()
    kf = torch.where(real[:, None, None], k.float(), 0.0)
    vf = torch.where(real[:, None, None], v.float(), 0.0)

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T, H, d] -> [NC, H, C, d], zeros past T
        return F.pad(x, (0, 0, 0, 0, 0, NC * C - T)).view(NC, C, H, x.shape[-1]).transpose(1, 2)

    qp, kp, vp = chunks(qf), chunks(kf), chunks(vf)
    idx = torch.arange(C, device=dev, dtype=torch.float32)
    diff = idx[:, None] - idx[None, :]
    D = torch.where(diff >= 0, torch.exp(diff.clamp(min=0) * ld[:, None, None]), 0.0)  # [H, C, C]
    o = (qp @ kp.transpose(-1, -2)).mul_(D) @ vp  # [NC, H, C, dv]

    L = (length - torch.arange(NC, device=dev) * C).clamp(0, C)  # real tokens per chunk
    steps_to_end = (L[:, None] - 1 - idx).clamp(min=0)  # [NC, C]
    w = torch.where((idx < L[:, None])[:, None, :], torch.exp(steps_to_end[:, None, :] * ld[:, None]), 0.0)
    states = (kp * w[..., None]).transpose(-1, -2) @ vp  # each chunk's own contribution, [NC, H, dk, dv]
    chunk_decay = torch.exp(L[:, None].float() * ld)[..., None, None]  # lambda^L, [NC, H, 1, 1]
    S = initial_state.to(dev, torch.float32)
    starts = []
    for c in range(NC):  # the chunk count is part of the graph's shape
        starts.append(S)
        S = chunk_decay[c] * S + states[c]
    S0 = torch.stack(starts)  # the state each chunk starts from
    qd = qp * torch.exp((idx + 1)[:, None] * ld).t()[..., None]  # lambda^(i+1) q_i
    o = o + qd @ S0
    o_tok = o.transpose(1, 2).reshape(NC * C, H, dv)[:T]
    o_tok = o_tok * scale + _self_augmentation(qf, kf, vf, aug.float())
    return o_tok.to(out_dtype), S
