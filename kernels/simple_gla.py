"""Simple Gated Linear Attention (Laplace's mixer core): chunked prefill and the decode step.

Per head h with a fixed decay lambda_h, key width d_k and value width d_v, the state
S (d_k x d_v, fp32) evolves token by token::

    S_t = lambda_h * S_{t-1} + k_t v_t^T
    o_t = scale * q_t^T S_t + sigmoid(sum_c q_c * a_h,c * k_c) * v_t      (self-augmentation)

Chunked prefill (chunks of C = 128 tokens, O(T)). Inside a chunk starting from state S_0,
for positions i = 0..L-1 of a chunk of length L::

    o_i   = scale * (lambda^(i+1) q_i^T S_0 + sum_{j<=i} lambda^(i-j) (q_i . k_j) v_j) + aug_i
    S_end = lambda^L S_0 + sum_j lambda^(L-1-j) k_j v_j^T

The intra-chunk part is one masked (C x C) attention per chunk, computed for every chunk of
every sequence at once; only the state hand-over between chunks is sequential, batched over
sequences. Decay powers are formed as exp((i-j) log lambda) on the causal triangle only, never
as lambda^i * lambda^-j (which overflows fp32 for lambda = 0.5 at i = 128).

Tiling on Trainium: C = 128 matches the 128 SBUF partitions; a chunk's (C x C) score tile and
its (d_k x d_v) state update are single TensorE matmuls (issue: NKI kernels).

All math runs in fp32 whatever the activation dtype; outputs are cast back to q's dtype.
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
    cu_seqlens: [N+1] int (cumulative lengths, cu_seqlens[0] = 0, each length >= 1);
    initial_state: [N, H, dk, dv] fp32.
    Returns (o [T, H, dv] in q's dtype, final_state [N, H, dk, dv] fp32).
    """
    out_dtype = q.dtype
    T, H, _ = q.shape
    N = cu_seqlens.numel() - 1
    C = chunk_size
    dev = q.device
    qf, kf, vf = q.float(), k.float(), v.float()
    ld = log_decay.to(dev, torch.float32)

    cu = cu_seqlens.to(dev, torch.long)
    lens = cu[1:] - cu[:-1]
    seq_id = torch.repeat_interleave(torch.arange(N, device=dev), lens, output_size=T)
    pos = torch.arange(T, device=dev) - cu[seq_id]
    chunk_id, intra = pos // C, pos % C
    n_chunks = int((lens.max().item() + C - 1) // C) if N else 0

    def pad(x: torch.Tensor) -> torch.Tensor:  # [T, H, d] -> [N, n_chunks, C, H, d]
        buf = x.new_zeros(N, n_chunks, C, H, x.shape[-1])
        buf[seq_id, chunk_id, intra] = x
        return buf

    qp, kp, vp = pad(qf), pad(kf), pad(vf)
    # Chunk lengths L [N, n_chunks]; chunks past a sequence's end have L = 0.
    chunk_start = torch.arange(n_chunks, device=dev) * C
    L = (lens[:, None] - chunk_start[None, :]).clamp(0, C)

    idx = torch.arange(C, device=dev, dtype=torch.float32)
    # Intra-chunk decay mask D[h, i, j] = lambda_h^(i-j) for j <= i, else 0.
    diff = idx[:, None] - idx[None, :]
    causal = diff >= 0
    D = torch.where(causal, torch.exp(diff.clamp(min=0) * ld[:, None, None]), 0.0)  # [H, C, C]
    scores = torch.einsum("ncihd,ncjhd->nchij", qp, kp) * D
    o = torch.einsum("nchij,ncjhe->ncihe", scores, vp)

    # Contribution of each chunk to the state it hands on: sum_j lambda^(L-1-j) k_j v_j^T.
    steps_to_end = (L[..., None] - 1 - idx).clamp(min=0)  # [N, n_chunks, C]
    in_chunk = idx < L[..., None]
    w = torch.where(in_chunk[..., None], torch.exp(steps_to_end[..., None] * ld), 0.0)  # [N,c,C,H]
    U = torch.einsum("ncjh,ncjhd,ncjhe->nchde", w, kp, vp)
    chunk_decay = torch.exp(L[..., None].float() * ld)  # lambda^L, [N, n_chunks, H]
    q_decay = torch.exp((idx + 1)[:, None] * ld)  # lambda^(i+1), [C, H]

    S = initial_state.to(dev, torch.float32).clone()
    for c in range(n_chunks):
        o[:, c] += torch.einsum("nihd,nhde->nihe", qp[:, c] * q_decay[:, :, None], S)
        S = chunk_decay[:, c, :, None, None] * S + U[:, c]

    o_tok = o[seq_id, chunk_id, intra] * scale + _self_augmentation(qf, kf, vf, aug.float())
    return o_tok.to(out_dtype), S


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


def causal_conv1d_prefill(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (width W) + SiLU over packed sequences, continuing from conv_state.

    x: [T, D]; weight: [D, W] (weight[:, -1] multiplies the current token); conv_state:
    [N, W-1, D], the last W-1 inputs before each sequence (zeros for a new one).
    Returns (y [T, D], new conv_state [N, W-1, D]).
    """
    W = weight.shape[-1]
    outs, states = [], []
    for n in range(cu_seqlens.numel() - 1):
        s, e = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        seq = torch.cat([conv_state[n].to(x.dtype), x[s:e]], 0)  # [W-1+L, D]
        b = None if bias is None else bias.to(x.dtype)
        y = F.conv1d(seq.t()[None], weight[:, None, :].to(x.dtype), b, groups=weight.shape[0])[0].t()
        outs.append(y)
        states.append(seq[seq.shape[0] - (W - 1) :])
    return F.silu(torch.cat(outs, 0)), torch.stack(states).to(conv_state.dtype)


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One conv step per sequence, conv state read and written in place; -1 rows: state untouched,
    output zero.

    x: [B, D]; conv_pool: [num_slots, W-1, D].
    """
    valid = slots >= 0
    idx = torch.where(valid, slots, 0).long()
    window = torch.cat([conv_pool[idx].to(x.dtype), x[:, None, :]], 1)  # [B, W, D]
    y = torch.einsum("bwd,dw->bd", window, weight.to(x.dtype))
    if bias is not None:
        y = y + bias.to(x.dtype)
    keep = valid.nonzero().squeeze(1)
    conv_pool.index_copy_(0, idx[keep], window[keep, 1:].to(conv_pool.dtype))
    return torch.where(valid[:, None], F.silu(y), 0.0)
