"""Simple GLA and its short convolution, the plain way (in the manner of fla's `naive.py`): one token at a time, in
float64, one sequence at a time. What tests/test_simple_gla.py compares the chunked, packed and padded forms of
kernels/simple_gla.py and kernels/causal_conv1d.py against (spec: docs/models.md section 2, Laplace 3B)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

Triple = tuple[Tensor, Tensor, Tensor]  # outputs, outputs without the self-augmentation, final states


def ref_lambda(H: int, t_min: float, t_max: float) -> torch.Tensor:
    """lambda_h = 2^(-1/T_h), T_h = t_min (t_max/t_min)^(h/(H-1)), in Python float64."""
    lams = []
    for h in range(H):
        t_h = t_min * (t_max / t_min) ** (h / (H - 1)) if H > 1 else t_min
        lams.append(2.0 ** (-1.0 / t_h))
    return torch.tensor(lams, dtype=torch.float64)


def ref_recurrence(q: Tensor, k: Tensor, v: Tensor, aug: Tensor, lam: Tensor, scale: float, S0: Tensor) -> Triple:
    """Plain per-token recurrence in float64 for ONE sequence.

    q, k [L, H, dk]; v [L, H, dv]; aug [H, dk]; lam [H] float64; S0 [H, dk, dv].
    Returns (o [L, H, dv], core [L, H, dv] (without the self-augmentation), S_L [H, dk, dv]).
    """
    q, k, v, aug = q.double(), k.double(), v.double(), aug.double()
    S = S0.double().clone()
    lam = lam.double()[:, None, None]
    outs, cores = [], []
    for t in range(q.shape[0]):
        S = lam * S + k[t][:, :, None] * v[t][:, None, :]
        core = scale * (q[t][:, :, None] * S).sum(1)  # q_t^T S_t per head
        gate = torch.sigmoid((q[t] * aug * k[t]).sum(-1))  # [H]
        cores.append(core)
        outs.append(core + gate[:, None] * v[t])
    H, dv = v.shape[1], v.shape[2]
    if not outs:
        return v.new_zeros(0, H, dv), v.new_zeros(0, H, dv), S
    return torch.stack(outs), torch.stack(cores), S


def ref_packed(
    q: Tensor, k: Tensor, v: Tensor, aug: Tensor, lam: Tensor, scale: float, lengths: list[int], S0: Tensor
) -> Triple:
    """float64 recurrence for every sequence of a packed batch."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    outs, cores, states = [], [], []
    for n in range(len(lengths)):
        s, e = cu[n], cu[n + 1]
        o, c, S = ref_recurrence(q[s:e], k[s:e], v[s:e], aug, lam, scale, S0[n])
        outs.append(o)
        cores.append(c)
        states.append(S)
    return torch.cat(outs), torch.cat(cores), torch.stack(states)


def ref_conv_silu(x_full: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal conv of a whole sequence [L, D] (zeros before it), then SiLU, in float64."""
    D, W = weight.shape
    x = F.pad(x_full.double().t()[None], (W - 1, 0))  # [1, D, W-1+L]
    b = None if bias is None else bias.double()
    y = F.conv1d(x, weight.double()[:, None, :], b, groups=D)[0].t()
    return F.silu(y)


def ref_conv_state(x_full: torch.Tensor, W: int) -> torch.Tensor:
    """Last W-1 inputs of a sequence, zero-padded on the left when it is shorter."""
    D = x_full.shape[1]
    padded = torch.cat([x_full.new_zeros(W - 1, D), x_full])
    return padded[padded.shape[0] - (W - 1) :]
