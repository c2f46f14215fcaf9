"""Laplace's short convolution: a depthwise causal conv of width W over each sequence's channels, then SiLU, with a
window of each sequence's last W-1 inputs carried between steps (vLLM's and fla's `causal_conv1d`).

Forms: packed sequences continuing from their windows (`causal_conv1d_prefill`), one decode step per row
(`causal_conv1d_window_step`, and `causal_conv1d_step` reading and writing a pool of windows in place), and one padded
sequence with static shapes for a compiled graph per bucket (`causal_conv1d_prefill_padded`). Every form runs in the
activations' dtype. Oracle: a per-token loop over the window (tests/test_simple_gla.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_trn_plugin.kernels.simple_gla import check_packed


def causal_conv1d_prefill(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (width W) + SiLU over packed sequences, continuing from conv_state.

    x: [T, D]; weight: [D, W] (weight[:, -1] multiplies the current token); conv_state:
    [N, W-1, D], the last W-1 inputs before each sequence (zeros for a new one).
    Returns (y [T, D], new conv_state [N, W-1, D]).
    """
    check_packed(x.shape[0], cu_seqlens, conv_state, "causal_conv1d_prefill")
    (D, W), N = weight.shape, conv_state.shape[0]
    dev = x.device
    w = weight[:, None, :].to(x.dtype)
    b = None if bias is None else bias.to(x.dtype)
    cu = cu_seqlens.to(dev, torch.long)
    lens = cu[1:] - cu[:-1]
    # One conv over the whole packed stream: right for every token but a sequence's first W-1,
    # whose window reaches back past the sequence's start (into the previous sequence).
    y = F.conv1d(F.pad(x.t()[None], (W - 1, 0)), w, b, groups=D)[0].t().contiguous()
    # Those are redone from their true windows. Row n*(W-1) + i of `src` is conv_state[n, i],
    # row N*(W-1) + t is token t; position p of sequence n (p < 0: its conv state) is row(n, p).
    src = torch.cat([conv_state.to(x.dtype).reshape(N * (W - 1), D), x])

    def row(n: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return torch.where(p >= 0, N * (W - 1) + cu[n] + p, n * (W - 1) + (W - 1) + p)

    # (sequence, position) of those tokens; a sequence shorter than W-1 has fewer.
    head_seq, head_pos = (torch.arange(W - 1, device=dev) < lens[:, None]).nonzero(as_tuple=True)
    window = src[row(head_seq[:, None], head_pos[:, None] - (W - 1) + torch.arange(W, device=dev))]  # [n, W, D]
    y[cu[head_seq] + head_pos] = F.conv1d(window.transpose(1, 2), w, b, groups=D)[..., 0]
    # The new state: the last W-1 inputs of each sequence, reaching into the old state when short.
    tail = lens[:, None] - (W - 1) + torch.arange(W - 1, device=dev)  # [N, W-1] positions
    return F.silu(y), src[row(torch.arange(N, device=dev)[:, None], tail)].to(conv_state.dtype)


def causal_conv1d_window_step(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, window: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One conv step per row from its window of earlier inputs: x [B, D], window [B, W-1, D].
    Returns (SiLU(conv) [B, D] in x's dtype, the next window [B, W-1, D] in window's dtype)."""
    full = torch.cat([window.to(x.dtype), x[:, None, :]], 1)  # [B, W, D]
    y = torch.einsum("bwd,dw->bd", full, weight.to(x.dtype))
    if bias is not None:
        y = y + bias.to(x.dtype)
    return F.silu(y), full[:, 1:].to(window.dtype)


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One conv step per sequence, conv state read and written in place; -1 rows: state untouched,
    output zero.

    x: [B, D]; conv_pool: [num_slots, W-1, D].
    """
    valid = slots >= 0
    idx = torch.where(valid, slots, 0).long()
    y, window = causal_conv1d_window_step(x, weight, bias, conv_pool[idx])
    keep = valid.nonzero().squeeze(1)
    conv_pool.index_copy_(0, idx[keep], window[keep])
    return torch.where(valid[:, None], y, 0.0)


def causal_conv1d_prefill_padded(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, length: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over one sequence whose first `length` of T tokens are real, continuing from
    conv_state [W-1, D] (zeros for a new sequence): (y [T, D], the window after the real tokens [W-1, D]).
    Padded tokens come after the real ones, so no real output sees them; the new window is gathered at positions
    computed from `length`, reaching into the old window when the sequence is shorter than W-1."""
    D, W = weight.shape
    src = torch.cat([conv_state.to(x.dtype), x])  # row W-1+t is token t
    y = F.conv1d(src.t()[None], weight[:, None, :].to(x.dtype), None if bias is None else bias.to(x.dtype), groups=D)
    tail = src.index_select(0, length + torch.arange(W - 1, device=x.device))
    return F.silu(y[0].t()), tail.to(conv_state.dtype)
