"""FP8 x FP8 routed-expert MLP as an NKI 0.6 kernel for Trainium2 (MLA-Trinity's experts): the kernel
`fp8_experts_kernel`, its host wrapper `fp8_experts_nki` and its cost formula `fp8_experts_cost`.

The op (fp8_expert.py: `fp8_expert` for one expert, `fp8_experts` for the routed sum, both the definition
and the torch path; every product FP8, fp32 accumulation):

    out[t] = sum_k topk_weights[t, k] * y_e(x[t]),   e = topk_ids[t, k]
    y_e(x) = L(Q(h), w2[e], s2[e], b2[e]),   h = SiLU(gate) * up,   [gate | up] = L(Q(x), w13[e], s13[e], b13[e])
    L(q, w, s_row, b)[t, n] = ((sum_k q[t, k] * w[n, k]) * s_tok[t]) * s_row[n] + b[n]

with w13 [E, 2I, Hd] FP8 (gate rows, then up rows), w2 [E, Hd, I] FP8, s*/b* float32 per row, and Q the
per-token quantization to Trainium2 E4M3 (one scale per token, computed here inside the kernel):

    a = max(max_k |v[t, k]|, 2^-100)     inv = 240 * RN(1 / a)     s_tok = a * RN(1 / 240)
    q[t, k] = RNE_e4m3(clamp(v[t, k] * inv, -240, 240))

The ISA has no divide (docs/nki-0.6.md sections 5.6 and 6: the ALU ops list reciprocal, not divide, and
``nl.divide`` is unsupported on hardware though it works in simulation), so ``240 / a`` and ``a / 240``
become ``240 * (1 / a)`` and ``a * fp32(1 / 240)``; ``quantize_per_token`` (fp8_expert.py) computes
exactly this, so the torch path and the kernel produce the same FP8 codes and scales, bit for bit. The
floor 2^-100 keeps 240 / a finite and s_tok a normal fp32 number (a zero row: codes 0, product 0).
The clamp catches v * inv rounding one ulp past 240 (a common case, docs/kernels.md): round-to-nearest-even
brings 240 + ulp back to 240 (ml_dtypes, the emulator), but what the engines do with an fp32 value
beyond E4M3's 240 on an FP8 write is not documented (saturate, inf or NaN), so the kernel never
hands them one.

Layout ("transposed": features on the 128 partitions, tokens on the free axis, T <= 128 per call):

- x^T [128, Hd/128, T] (k = 128 * kt + p) is read once per call; its per-token amax is a free-axis
  max over the k-tiles, one PE transpose to [T, 128], a free-axis max, and one PE transpose of the
  stride-0 broadcast column back to [128, T] (every partition holds every token's scale).
- gate/up: for each 128-row tile r of w13[e], W^T tile [128 p, Hd/128, 128 rows] (one DMA), then
  Hd/256 double-row matmuls ``stationary = W^T[:, 2kk:2kk+2, :]`` ([128, 2, 128] FP8, contraction 256),
  ``moving = xq^T[:, 2kk:2kk+2, :]`` ([128, 2, T] FP8) accumulate [128 rows, T] in fp32 PSUM. Row
  tiles share a PSUM tile [128, G, T] with G = min(tiles, 512 // T) (one 2 KiB bank).
- leaving PSUM: ``* s_tok`` (a [128, T] tile broadcast over the row tiles), ``* s_row`` and ``+ b``
  ((rows on partitions) broadcast over tokens), in that order: the per-row scale is a per-partition
  value; then SiLU (ScalarE) and ``* up`` give h^T [128, I/128, T] (I on partitions).
- h is quantized per token the same way (its amax runs over the partitions: one transpose, one
  reduce, one broadcast transpose), and the down projection runs the same way (``stationary`` =
  w2^T tile [128 i, I/128, 128 d], ``moving`` = hq^T), so s2 lands on the output's partition axis.
- each block's y^T is weighted by the routing weights and added into an fp32 accumulator
  [128, Hd/128, T] resident in SBUF, stored once at the end through a transposing access pattern.

Resident in SBUF per expert: its whole FP8 weights as tiles (2 KiB + 1 KiB per partition per row tile
at Trinity-Mini's Hd = 2048, I = 1024: 48 KiB in all if the compiler keeps every tile in flight);
xq^T, h^T, scales (a few KiB). PSUM: the gate/up bank, the down bank, two transposes (4 banks).

Routing layout of fp8_experts_kernel (``expert_blocks``, built in torch with fixed shapes, no host
sync): NB = min(E, T * K) blocks, block b = one expert holding all T tokens as columns:

    block_expert [NB] int32   the experts that received tokens, ascending, then the others
    block_active [NB] int32   1 if the block's expert received a token, else 0
    block_weight [NB, T] fp32 topk weight of token t for that expert, 0 if t did not pick it

The block loop has NB trips fixed at compile time. The first ``n_always`` = min(K, E) blocks always hold
tokens (every token picks K distinct experts) and run unguarded; every later block b runs inside
``nl.fori_loop(0, r, body)`` with r = block_active[b] loaded into a register at run time: a zero-trip
loop for an empty block, so it costs no weight DMA. The expert's weights are addressed with
``scalar_offset`` = a register holding block_expert[b]. Computing all T tokens per block (instead of
gathering each expert's few tokens) costs no extra DMA; at decode sizes (T <= 32, a handful of
tokens per expert) a matmul streams T <= 32 columns, which is noise beside the 128-column stationary
load, and it saves the gathers and the per-expert re-quantization of x. Blocks run in ascending
expert order and add ``y * w`` into the accumulator, the order of ``fp8_experts``'s ``index_add_``.
Calls with T > 128 are split by the wrapper (each split re-reads its experts' weights: a prefill
kernel would gather per-expert token blocks instead).

DMA per call (``fp8_experts_cost``): per active block 3 * I * Hd bytes of FP8 weights +
(4 I + 2 Hd) * 4 bytes of scales and biases + 128 * T * 4 bytes of routing weights (broadcast to the
partitions by the DMA); per call T * Hd * (itemsize(x) + 4) for x and the fp32 output + 8 * NB bytes
of routing metadata. The analytic minimum is the same without the broadcast (128 T * 4 -> T * 4, 0.3%
of an expert at T = 32). Matmuls per active block: (2I / 128)(Hd / 256) + (Hd / 128)(I / 256) double-row
(192 at Trinity-Mini), plus 2 PE transposes; 2 more transposes per call for x.

Not yet tuned for the device: the weight tiles are read through an access pattern that walks the
row-major [rows, K] weights K-major (partition p takes column p of every row), which is 1-byte
granular on the DMA engines. Stored K-major once at load time (a process_weights_after_loading
copy), each partition would read contiguous 128-byte runs with the same kernel and different strides.

Numerics contract (tests/test_fp8_expert_nki.py): FP8 codes and scales of x and of h are bit-exact
against ``quantize_per_token`` applied to the same fp32 input; the matmuls are exact products
with fp32 accumulation whose order is the device's (only accumulation order and the ScalarE SiLU
differ from the fp32 torch reference); so y agrees with ``fp8_expert`` to fp32 rounding,
except that h, being re-quantized, can land on the other side of an FP8 rounding midpoint, which moves
y by at most one FP8 step of h times the w2 row (see the tests for the bound).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from vllm_trn_plugin.kernels.fp8_expert import AMAX_FLOOR, FP8_MAX, INV_FP8_MAX, ExpertWeights
from vllm_trn_plugin.kernels.nki_shim import nisa, nki, nl

P = 128  # partitions
LNC_DEGREES = (1,)  # the LNC degrees the kernel runs at (kernels/nki_ops.py refuses a deployment at another)
MAX_TOKENS = 128  # tokens per kernel call: the amax transpose puts tokens on partitions
PSUM_BANK_F32 = 512


# ---------------------------------------------------------------------------------------------
# routing layout and torch-facing entry
# ---------------------------------------------------------------------------------------------
class ExpertBlocks(NamedTuple):
    """fp8_experts_kernel's routing inputs (see the module docstring)."""

    expert: torch.Tensor  # [NB] int32
    active: torch.Tensor  # [NB] int32
    weight: torch.Tensor  # [NB, T] float32
    n_always: int


def expert_blocks(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, all_local: bool = True
) -> ExpertBlocks:
    """Blocks for T tokens' top-K routing (fixed shapes: NB = min(E, T*K); rows of topk_ids distinct). With
    `all_local` False some ids may be < 0 (experts another rank holds): they hit no block, and no block is
    guaranteed active (n_always 0)."""
    t, k = topk_ids.shape
    e = num_experts
    local = topk_ids >= 0
    ids = topk_ids.long().clamp_min(0)
    dense = torch.zeros(e * t, dtype=torch.float32, device=ids.device)
    dense.scatter_add_(
        0,
        (ids * t + torch.arange(t, device=ids.device)[:, None]).reshape(-1),
        (topk_weights.float() * local).reshape(-1),
    )
    hits = torch.zeros(e, dtype=torch.int32, device=ids.device)
    hits.scatter_add_(0, ids.reshape(-1), local.int().reshape(-1))
    active = hits > 0
    rank = torch.arange(e, device=ids.device)
    order = torch.argsort(torch.where(active, rank, rank + e))[: min(e, t * k)]
    return ExpertBlocks(
        order.to(torch.int32),
        active[order].to(torch.int32),
        dense.view(e, t)[order].contiguous(),
        min(k, e) if all_local else 0,
    )


def fp8_experts_nki(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: ExpertWeights,
    runner: Callable[[Any], Callable[..., torch.Tensor]],
    all_local: bool = True,
) -> torch.Tensor:
    """``fp8_experts``'s arguments and result (x.dtype [T, Hd]), computed by fp8_experts_kernel via runner
    (``all_local`` False: ids < 0 are other ranks' experts, see ``expert_blocks``).

    Prepares only the routing layout (``expert_blocks``, O(T K + E T) torch ops); the weights go to the
    kernel as the model holds them. T is split into calls of at most 128 tokens.
    """
    if not experts.fp8:
        raise ValueError(f"fp8_experts_nki: FP8 expert weights required, got {experts.w13.dtype} / {experts.w2.dtype}")
    outs = []
    for t0 in range(0, x.shape[0], MAX_TOKENS):
        sl = slice(t0, t0 + MAX_TOKENS)
        blk = expert_blocks(topk_weights[sl], topk_ids[sl], experts.w13.shape[0], all_local)
        outs.append(runner(fp8_experts_kernel)(x[sl].contiguous(), *blk[:3], *experts, blk.n_always))
    if not outs:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    return torch.cat(outs).to(x.dtype)


def fp8_experts_cost(
    tokens: int, hidden: int, inter: int, active_experts: int, num_blocks: int, x_itemsize: int = 2
) -> dict[str, int]:
    """Counters of one fp8_experts_kernel call (T = tokens <= 128) with ``active_experts`` blocks run."""
    per_block_dma = 3 * inter * hidden + (4 * inter + 2 * hidden) * 4 + P * tokens * 4
    hbm_to_sbuf = tokens * hidden * x_itemsize + 2 * num_blocks * 4 + active_experts * per_block_dma
    sbuf_to_hbm = tokens * hidden * 4
    per_block_mm = (2 * inter // P) * (hidden // 256) + (hidden // P) * (inter // 256)
    return {
        "dma_hbm_to_sbuf_bytes": hbm_to_sbuf,
        "dma_sbuf_to_hbm_bytes": sbuf_to_hbm,
        "dma_bytes": hbm_to_sbuf + sbuf_to_hbm,
        # the same traffic without the routing-weight broadcast and the block metadata
        "min_dma_bytes": hbm_to_sbuf + sbuf_to_hbm - active_experts * (P - 1) * tokens * 4 - 2 * num_blocks * 4,
        "weight_bytes": active_experts * 3 * inter * hidden,
        "dma_instructions": 4 + active_experts * (2 * inter // P + hidden // P + 5),
        "matmul_instructions": active_experts * per_block_mm,
        "matmul_macs": active_experts * 3 * inter * hidden * tokens,
        "transpose_instructions": 2 + 2 * active_experts,
    }


# ---------------------------------------------------------------------------------------------
# kernel building blocks (inlined at specialization; the tests run one expert through them)
# ---------------------------------------------------------------------------------------------
def _hbm(t: Any, pattern: list[list[int]], offset: int, expert: Any) -> Any:
    """An access pattern on an HBM tensor; with a register ``expert``, into that expert's slice."""
    if expert is None:
        return t.ap(pattern, offset=offset)
    return t.ap(pattern, offset=offset, scalar_offset=expert, indirect_dim=0)


def _bcast_tokens(s: Any, n: int, t: int) -> Any:
    """[128, t] tile viewed as [128, n, t] (repeated over the middle axis, stride 0)."""
    return s.ap([[t, P], [0, n], [1, t]])


def _bcast_rows(s: Any, ncols: int, c0: int, n: int, t: int) -> Any:
    """Columns c0..c0+n of a [128, ncols] tile viewed as [128, n, t] (repeated over tokens, stride 0)."""
    return s.ap([[ncols, P], [1, n], [0, t]], offset=c0)


def _quantize_cols(v: Any, nc: int, t: int) -> tuple[Any, Any]:
    """v [128, nc, t] fp32 (column t = token t) -> (q FP8 [128, nc, t], s_tok [128, t] on every partition)."""
    a = nl.ndarray((P, nc, t), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=a, op=nl.abs, data=v)
    m = nl.ndarray((P, t), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=m, op=nl.maximum, data=a.ap([[nc * t, P], [1, t], [t, nc]]), axis=2)
    ps = nl.ndarray((P, P + t), dtype=nl.float32, buffer=nl.psum)  # both transposes share one bank
    nisa.nc_transpose(dst=ps[0:t, 0:P], data=m)
    amax = nl.ndarray((t, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=amax, op=nl.maximum, data=ps[0:t, 0:P], axis=1, keepdims=True)
    amax_b = ps[:, P : P + t]
    nisa.nc_transpose(dst=amax_b, data=amax.ap([[1, t], [0, P]]))
    s = nl.ndarray((P, t), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=s, data=amax_b, op0=nl.maximum, operand0=AMAX_FLOOR)
    inv = nl.ndarray((P, t), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv, data=s)
    nisa.tensor_scalar(dst=inv, data=inv, op0=nl.multiply, operand0=FP8_MAX)
    nisa.tensor_scalar(dst=s, data=s, op0=nl.multiply, operand0=INV_FP8_MAX)
    scaled = nl.ndarray((P, nc, t), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=scaled, data1=v, data2=_bcast_tokens(inv, nc, t), op=nl.multiply)
    q = nl.ndarray((P, nc, t), dtype=nl.float8_e4m3, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=q, data=scaled, op0=nl.minimum, operand0=FP8_MAX, op1=nl.maximum, operand1=-FP8_MAX)
    return q, s


def _projection(
    dst: Any, q: Any, s_tok: Any, t: int, w: Any, s_row: Any, b: Any, expert: Any, rows: int, k: int
) -> None:
    """dst [128, rows/128, t] = ((W q^T) * s_tok) * s_row + b for W [rows, k] (of expert ``expert``)."""
    nr, nk = rows // P, k // P
    s_t = nl.ndarray((P, nr), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=s_t, src=_hbm(s_row, [[1, P], [P, nr]], 0, expert))
    b_t = nl.ndarray((P, nr), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=b_t, src=_hbm(b, [[1, P], [P, nr]], 0, expert))
    group = max(1, min(nr, PSUM_BANK_F32 // t))
    for r0 in range(0, nr, group):
        n = min(group, nr - r0)
        acc = nl.ndarray((P, n, t), dtype=nl.float32, buffer=nl.psum)
        for j in range(n):
            w_t = nl.ndarray((P, nk, P), dtype=nl.float8_e4m3, buffer=nl.sbuf)
            nisa.dma_copy(dst=w_t, src=_hbm(w, [[1, P], [P, nk], [k, P]], (r0 + j) * P * k, expert))
            for kk in range(nk // 2):
                nisa.nc_matmul(
                    dst=acc[:, j, :],
                    stationary=w_t[:, 2 * kk : 2 * kk + 2, :],
                    moving=q[:, 2 * kk : 2 * kk + 2, :],
                    accumulate=kk > 0,
                    perf_mode=nisa.matmul_perf_mode.double_row,
                )
        out = dst[:, r0 : r0 + n, :]
        nisa.tensor_tensor(dst=out, data1=acc, data2=_bcast_tokens(s_tok, n, t), op=nl.multiply)
        nisa.tensor_tensor(dst=out, data1=out, data2=_bcast_rows(s_t, nr, r0, n, t), op=nl.multiply)
        nisa.tensor_tensor(dst=out, data1=out, data2=_bcast_rows(b_t, nr, r0, n, t), op=nl.add)


def load_quantized_x(x: Any, t: int, hd: int) -> tuple[Any, Any]:
    """x [T, Hd] (HBM, any float dtype) -> quantized xq^T [128, Hd/128, T] FP8 and s_tok [128, T]."""
    x_t = nl.ndarray((P, hd // P, t), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_t, src=x.ap([[1, P], [P, hd // P], [hd, t]], offset=0))
    return _quantize_cols(x_t, hd // P, t)


def expert_mlp(
    xq: Any, sx: Any, t: int, w13: Any, s13: Any, b13: Any, w2: Any, s2: Any, b2: Any, expert: Any
) -> tuple[Any, Any, Any, Any]:
    """One expert on all t token columns -> (y^T [128, Hd/128, t] fp32, h^T, hq^T, s_h)."""
    two_i, hd = w13.shape[-2], w13.shape[-1]
    ni = two_i // 2 // P
    gu = nl.ndarray((P, 2 * ni, t), dtype=nl.float32, buffer=nl.sbuf)
    _projection(gu, xq, sx, t, w13, s13, b13, expert, two_i, hd)
    h = nl.ndarray((P, ni, t), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=h, op=nl.silu, data=gu[:, 0:ni, :])
    nisa.tensor_tensor(dst=h, data1=h, data2=gu[:, ni : 2 * ni, :], op=nl.multiply)
    hq, sh = _quantize_cols(h, ni, t)
    y = nl.ndarray((P, hd // P, t), dtype=nl.float32, buffer=nl.sbuf)
    _projection(y, hq, sh, t, w2, s2, b2, expert, hd, two_i // 2)
    return y, h, hq, sh


def check_shapes(t: int, hd: int, two_i: int) -> None:
    """The kernel's size contract: 1..128 tokens per call, Hd and I multiples of 256 (double-row tiles)."""
    assert 1 <= t <= MAX_TOKENS, f"tokens per call must be 1..{MAX_TOKENS}, got {t}"
    assert hd % 256 == 0 and two_i % 512 == 0, f"Hd and I must be multiples of 256, got Hd={hd}, 2I={two_i}"


def store_transposed(dst: Any, src: Any, t: int, cols: int) -> None:
    """src [128, cols/128, t] -> dst [t, cols] (HBM) through a transposing access pattern."""
    nisa.dma_copy(dst=dst.ap([[1, P], [P, cols // P], [cols, t]], offset=0), src=src)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@nki.jit
def fp8_experts_kernel(x, block_expert, block_active, block_weight, w13, s13, b13, w2, s2, b2, n_always):
    """All routed experts of a layer: out [T, Hd] fp32 = sum over active blocks b of block_weight[b] * y_e.

    x [T, Hd]; block_expert/block_active [NB] int32, block_weight [NB, T] fp32 (``expert_blocks``);
    w13 [E, 2I, Hd] FP8, s13/b13 [E, 2I], w2 [E, Hd, I] FP8, s2/b2 [E, Hd]; n_always (compile time):
    blocks 0..n_always-1 run unguarded, the rest under a zero-or-one-trip fori_loop.
    """
    t, hd = x.shape
    nb = block_weight.shape[0]
    two_i = w13.shape[1]
    check_shapes(t, hd, two_i)
    nd = hd // P
    eid = nl.ndarray((1, nb), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=eid, src=block_expert)
    act = nl.ndarray((1, nb), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=act, src=block_active)
    xq, sx = load_quantized_x(x, t, hd)
    acc = nl.ndarray((P, nd, t), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)
    expert = nisa.register_alloc(0)
    trips = nisa.register_alloc(0)

    def block(b: int) -> Callable[[Any], None]:
        def body(_i: Any) -> None:
            nisa.register_load(expert, eid[0:1, b : b + 1])
            wt = nl.ndarray((P, t), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=wt, src=block_weight.ap([[0, P], [1, t]], offset=b * t))
            y, _, _, _ = expert_mlp(xq, sx, t, w13, s13, b13, w2, s2, b2, expert)
            nisa.tensor_tensor(dst=y, data1=y, data2=_bcast_tokens(wt, nd, t), op=nl.multiply)
            nisa.tensor_tensor(dst=acc, data1=acc, data2=y, op=nl.add)

        return body

    for b in range(nb):
        if b < n_always:
            block(b)(0)
        else:
            nisa.register_load(trips, act[0:1, b : b + 1])
            nl.fori_loop(0, trips, block(b))
    out = nl.ndarray((t, hd), dtype=nl.float32, buffer=nl.shared_hbm)
    store_transposed(out, acc, t, hd)
    return out


__all__ = [
    "ExpertBlocks",
    "check_shapes",
    "expert_blocks",
    "expert_mlp",
    "fp8_experts_cost",
    "fp8_experts_kernel",
    "fp8_experts_nki",
    "load_quantized_x",
    "store_transposed",
]
