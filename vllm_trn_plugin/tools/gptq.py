"""MXFP4 GPTQ: error feedback, activation order and Hessian-weighted block exponents, batched over experts.

A weight matrix W [out, in] whose inputs x have the (uncentred) second moment H = sum_n x_n x_n^T
is quantized to Q minimising the layer output error sum_n ||(W - Q) x_n||^2 = tr((W - Q) H (W - Q)^T).

MXFP4 values are c * 2^E: c an E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), one
exponent E per block of 32 consecutive inputs of a row. The rounding, the round-to-nearest exponents and the
spread rule are `loaders/mxfp4.py`'s, shared with `quantize_rtn`.

1. Block exponents (fixed before the error feedback, since a block's columns are spread over the
   activation order). Round-to-nearest takes E0 = floor(log2(amax)) - 2 (the block's largest value
   lands in [4, 8), values over 6 saturate). Hessian-weighted: each block tries E0 - 1, E0, E0 + 1
   and keeps the one whose RTN error e (32 values) minimises e^T H_bb e, H_bb the block's 32 x 32
   diagonal block of H: a smaller exponent trades clipping of the largest values for finer steps
   everywhere else, a larger one the reverse, and which wins depends on how much the inputs of
   those columns matter.
2. Loadability: the exact MXFP4 -> FP8 expansion needs every row's nonzero block exponents within
   13 octaves (`MAX_ROW_SPREAD`), so every exponent (`limit_spread`) is raised to at least the row's largest minus
   13 (such a far block then rounds most of its tiny values to 0; a block that is all zero adds no
   spread). All-zero blocks take the row's largest exponent, as `quantize_rtn` does.
3. GPTQ (Frantar et al. 2022): H is damped (H + damp * mean(diag H) * I; inputs never seen get
   H_ii = 1 and their weights are zeroed), columns are permuted to descending diag(H) (activation
   order: the inputs that matter most are rounded first, while many columns remain to absorb
   their error), U = the upper Cholesky factor of H^-1; column j is rounded at its fixed exponent and
   its error (w_j - q_j) / U_jj is fed into the columns not yet rounded through row j of U, lazily
   in blocks of `block` columns (one matmul per block for the columns after it).

Every function takes a batch of matrices [E, out, in] with their Hessians [E, in, in] (all experts
of a layer, or a chunk of them) and runs one column loop for the whole batch.
"""

from __future__ import annotations

import torch

from vllm_trn_plugin.loaders.mxfp4 import (
    BLOCK_SIZE,
    exact_pow2,
    limit_spread,
    round_scaled,
    rtn_exponents,
)

__all__ = ["gptq", "hessian_exponents"]

_E_MIN, _E_MAX = -127, 127  # E8M0 byte 0..254 (255 is NaN)
_CHUNK_ELEMS = 1 << 18  # weights per chunk of the exponent search


def hessian_exponents(w: torch.Tensor, h: torch.Tensor, offsets: tuple[int, ...] = (-1, 0, 1)) -> torch.Tensor:
    """Per block, E0 + offset minimising the RTN error e^T H_bb e (w [E, out, in], h [E, in, in]); marks zero blocks."""
    e0 = rtn_exponents(w)
    nb = w.shape[-1] // BLOCK_SIZE
    best = e0.clone()
    rows = max(1, _CHUNK_ELEMS // w.shape[-1])
    for x in range(w.shape[0]):
        hb = torch.stack(
            [h[x, b * BLOCK_SIZE : (b + 1) * BLOCK_SIZE, b * BLOCK_SIZE : (b + 1) * BLOCK_SIZE] for b in range(nb)]
        )
        for r0 in range(0, w.shape[1], rows):  # row chunks that stay in cache across the candidates
            wb = w[x, r0 : r0 + rows].reshape(-1, nb, BLOCK_SIZE)
            base = e0[x, r0 : r0 + rows]
            cost_best = None
            for off in offsets:
                cand = (base + off).clamp(_E_MIN, _E_MAX)
                err = wb - round_scaled(wb, exact_pow2(cand, w.dtype).unsqueeze(-1))  # [rows, nb, 32]
                cost = (torch.einsum("obi,bij->obj", err, hb) * err).sum(-1)  # [rows, nb]
                if cost_best is None:
                    cost_best, pick = cost, cand
                else:
                    better = cost < cost_best
                    cost_best, pick = torch.where(better, cost, cost_best), torch.where(better, cand, pick)
            best[x, r0 : r0 + rows] = pick
    return torch.where(e0 < _E_MIN, e0, best)  # all-zero blocks keep rtn_exponents' mark


def gptq(
    w: torch.Tensor,
    h: torch.Tensor,
    *,
    block: int = 128,
    damp: float = 0.01,
    act_order: bool = True,
    hessian_scales: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ to MXFP4 of a batch w [E, out, in] with input Hessians h [E, in, in] (module docstring).

    A float32 `h` is damped in place (pass a copy to keep it). Returns (q [E, out, in] float32, the
    dequantized MXFP4 values; exponents [E, out, in/32] int16).
    """
    E, n_out, n_in = w.shape
    H = h if h.dtype == torch.float32 else h.float()
    diag = torch.diagonal(H, dim1=-2, dim2=-1)
    dead = diag == 0
    diag[dead] = 1.0
    W = w.float().masked_fill(dead[:, None, :], 0.0)
    diag.add_(damp * diag.mean(-1, keepdim=True))
    exp = limit_spread(hessian_exponents(W, H) if hessian_scales else rtn_exponents(W))

    # Columns as rows ([E, in, out]): each step reads and updates contiguous memory.
    Wt = W.transpose(1, 2).contiguous()
    del W
    col_exp = exp.transpose(1, 2).repeat_interleave(BLOCK_SIZE, 1)
    # The factorisation wants H in processing order, reversed (see _inverse_cholesky_upper): one gather does both.
    order = torch.argsort(diag, dim=-1, descending=True) if act_order else torch.arange(n_in).expand(E, n_in)
    rows = order[:, :, None].expand(E, n_in, n_out)
    if act_order:
        Wt, col_exp = Wt.gather(1, rows), col_exp.gather(1, rows)
    rev = order.flip(-1)
    H = H.gather(-1, rev[:, None, :].expand(E, n_in, n_in)).gather(-2, rev[:, :, None].expand(E, n_in, n_in))
    U = _inverse_cholesky_upper(H)
    del H
    Q = torch.empty_like(Wt)
    for b0 in range(0, n_in, block):
        b1 = min(b0 + block, n_in)
        W1, U1 = Wt[:, b0:b1], U[:, b0:b1, b0:b1]
        scale = exact_pow2(col_exp[:, b0:b1], Wt.dtype)
        Err = torch.empty_like(W1)
        for j in range(b1 - b0):
            q = round_scaled(W1[:, j], scale[:, j])
            Q[:, b0 + j] = q
            err = torch.sub(W1[:, j], q, out=Err[:, j]).div_(U1[:, j, j, None])
            if j + 1 < b1 - b0:
                W1[:, j + 1 :].baddbmm_(U1[:, j, j + 1 :, None], err[:, None, :], alpha=-1)
        if b1 < n_in:
            Wt[:, b1:].baddbmm_(U[:, b0:b1, b1:].transpose(1, 2), Err, alpha=-1)
    if act_order:
        Q = torch.empty_like(Q).scatter_(1, rows, Q)
    return Q.transpose(1, 2).contiguous(), exp


def _inverse_cholesky_upper(flipped: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor U of H^-1 (H^-1 = U^T U) from `flipped` = J H J (J the reversal permutation), batched;
    more damping if H is numerically not positive definite.

    With J H J = L L^T (lower Cholesky), H = R R^T for the upper triangular R = J L J, so H^-1 = (R^-1)^T R^-1
    and U = R^-1 = J L^-1 J: one factorisation and one triangular inverse.
    """
    eye = torch.eye(flipped.shape[-1], dtype=flipped.dtype)
    extra = 0.0
    for _ in range(6):
        L, info = torch.linalg.cholesky_ex(flipped if extra == 0 else flipped + extra * eye)
        if not bool(info.any()):
            return torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False).flip(-1, -2)
        extra = max(extra * 10, 1e-4 * float(torch.diagonal(flipped, dim1=-2, dim2=-1).mean()))
    raise ValueError("GPTQ: the input Hessian is not positive definite even after extra damping")
