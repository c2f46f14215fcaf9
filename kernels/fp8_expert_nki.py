"""FP8 x FP8 routed-expert MLP (MLA-Trinity's experts) as an NKI kernel for Trainium2 (NKI 0.7/0.8, LNC=1 or 2).

Entry points: the kernel `fp8_experts_kernel`, its host wrapper `fp8_experts_nki` (routing laid out by
`expert_blocks`) and its cost formula `fp8_experts_cost`; `load_quantized_x` and `expert_mlp` are its building blocks.
The op's definition and torch path (`fp8_expert`, `fp8_experts`, `quantize_per_token`) are in fp8_expert.py.
Features sit on the partitions; the active expert blocks are one `nl.fori_loop`, the weights read in the layout of
`fp8_expert.to_kernel_layout` (row-major stacks still accepted). LNC=2: each core computes the gate/up rows of its
half of I, the cores swap their halves of h (`nisa.sendrecv`), and each computes the down rows of its half of Hd.
Numerics: x and h are quantized per token to E4M3 inside the kernel with the torch path's formula (`240 * (1 / a)`:
the ISA has no divide), so their FP8 codes and scales are bit-exact against `quantize_per_token`; every matmul is
FP8 x FP8 with fp32 accumulation, and out is bit-identical at LNC=1 and LNC=2.

Design (math, layout, weight layout, routing, LNC=2, DMA traffic, numerics): docs/kernels.md, section
'FP8 expert kernel (`kernels/fp8_expert_nki.py`): design'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from vllm_trn_plugin.kernels.fp8 import AMAX_FLOOR, FP8_MAX, INV_FP8_MAX
from vllm_trn_plugin.kernels.fp8_expert import ExpertWeights
from vllm_trn_plugin.kernels.nki_shim import nisa, nki, nl

P = 128  # partitions
LNC_DEGREES = (1, 2)  # the LNC degrees the kernel runs at (kernels/nki_ops.py refuses a deployment at another)
MAX_TOKENS = 128  # tokens per kernel call: the amax transpose puts tokens on partitions
PSUM_BANK_F32 = 512


# ---------------------------------------------------------------------------------------------
# routing layout and torch-facing entry
# ---------------------------------------------------------------------------------------------
class ExpertBlocks(NamedTuple):
    """fp8_experts_kernel's routing inputs (docs/kernels.md, FP8 expert kernel design: "Routing layout")."""

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
        outs.append(runner(fp8_experts_kernel)(x[sl].contiguous(), *blk[:3], *experts))
    if not outs:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    return torch.cat(outs).to(x.dtype)


def fp8_experts_cost(
    tokens: int,
    hidden: int,
    inter: int,
    active_experts: int,
    num_blocks: int,
    x_itemsize: int = 2,
    lnc: int = 1,
    layout: str = "tiled",
) -> dict[str, Any]:
    """Counters of one fp8_experts_kernel call (T = tokens <= 128) with ``active_experts`` blocks run, launched at LNC
    ``lnc``, the weights in ``layout`` "tiled" (fp8_expert.to_kernel_layout, as the loader stores them) or "row-major"
    (the layout before), as the emulator reports them (kernels/kernel_cost.py): DMA bytes, instructions, descriptors
    and times, matmul and transpose instructions, MACs, emitted and executed instructions, summed over the programs,
    each program's under ``programs`` (each reads half of every active expert's weights), the slowest core's DMA
    times, and the analytic minimum: ``min_dma_bytes`` (each active expert's weights, scales and biases once, x once,
    the routing weights once, out once) and ``dma_time_min_ns``, that minimum split evenly over the cores at their
    full DMA rate. ``weight_bytes``: the active experts' FP8 weights alone."""
    from vllm_trn_plugin.kernels.kernel_cost import Tally, busiest, combine, min_time_ns

    if layout not in ("tiled", "row-major"):
        raise ValueError(f"layout {layout!r}: 'tiled' or 'row-major'")
    ni, nd = inter // P, hidden // P
    ni_c, nd_c = ni // lnc, nd // lnc
    nk13, nk2 = hidden // P, inter // P
    up = -(-nd // GROUP) + -(-nd_c // GROUP)  # PSUM-evacuating copies of the x and out transposes
    once = 4 + 1 + nd + 11 + 1 + 1 + nd_c + 1 + up
    wdma13 = 1 if layout == "tiled" else 2
    body = (
        2 + wdma13 + 4 + 3 * -(-2 * ni_c // GROUP) + ni_c * nk13 + 2 + (lnc == 2) + 11
        + 1 + 4 + 3 * -(-nd_c // GROUP) + nd_c * nk2 // 2 + 2
    )  # fmt: skip
    programs = []
    a = active_experts
    for _ in range(lnc):
        t = Tally()
        t.dma(1, 1, num_blocks * 4, 1)  # block_active
        t.dma(1, tokens, hidden * x_itemsize, busiest(0, tokens))  # x, one token row per partition
        t.dma(1, tokens, nd_c * P * 4, busiest(0, tokens), to_hbm=True)  # out: this core's features of each token
        t.dma(a, 1, 4, 1)  # the block's expert id
        t.dma(a, P, tokens * 4, busiest(0, P))  # its routing weights, broadcast to the partitions
        if layout == "tiled":  # one contiguous run per partition and range (one range when they touch, at LNC=1)
            runs = 1 if lnc == 1 else 2
            t.dma(a, P * runs, (2 * ni_c // runs) * hidden, busiest(0, P, runs))  # w13: gate and up rows
            t.dma(a, P, nd_c * inter, busiest(0, P))  # w2
        else:  # one byte per descriptor
            t.dma(2 * a, P * ni_c * nk13 * P, 1, busiest(0, P, ni_c * nk13 * P))
            t.dma(a, P * nd_c * nk2 * P, 1, busiest(0, P, nd_c * nk2 * P))
        for n in (2 * ni_c, nd_c):  # row scales then biases, one 512-byte run per row tile and partition
            t.dma(a, n, P * 4, busiest(0, n))
            t.dma(a, n, P * 4, busiest(n, n))
        t.add(
            dma_sbuf_to_sbuf_bytes=a * ni_c * tokens * 4 * P if lnc == 2 else 0,  # the swapped halves of h
            matmul_instructions=a * (ni_c * nk13 + nd_c * nk2 // 2),
            matmul_macs=a * (2 * ni_c * P * hidden + nd_c * P * inter) * tokens,
            transpose_instructions=nd + 2 + nd_c + 4 * a,
            emitted_instructions=once + body,
            executed_instructions=once + a * body,
        )
        programs.append(t.result())
    per_block = 3 * inter * hidden + (4 * inter + 2 * hidden) * 4
    dma_min = a * per_block + a * tokens * 4 + tokens * hidden * (x_itemsize + 4)
    return combine(
        programs,
        min_dma_bytes=dma_min,
        dma_time_min_ns=min_time_ns(dma_min / lnc),
        weight_bytes=a * 3 * inter * hidden,
    )


# ---------------------------------------------------------------------------------------------
# kernel building blocks (inlined at specialization; the tests run one expert through them)
# ---------------------------------------------------------------------------------------------
GROUP = 4  # row tiles per PSUM accumulation tile ([128, 4, T <= 128] fp32: one 2 KiB bank whatever T)


def _bcast_tokens(s: Any, n: int, t: int) -> Any:
    """[128, t] tile viewed as [128, n, t] (repeated over the middle axis, stride 0)."""
    return s.ap([[t, P], [0, n], [1, t]])


def _core_split(n_tiles: int) -> tuple[int, int]:
    """(first, count) of this program's share of n_tiles 128-row tiles: all of them at LNC=1, half at LNC=2."""
    n, c = nl.num_programs(0), nl.program_id(0)
    assert n_tiles % n == 0, f"{n_tiles} row tiles do not split over LNC={n}"
    return c * (n_tiles // n), n_tiles // n


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


def _hbm(t: Any, pattern: list[list[int]], offset: int, expert: Any) -> Any:
    """An access pattern on an HBM tensor; with ``expert`` (a register or a (1, 1) SBUF tile), into that expert's
    slice (the leading dimension); without, on one expert's tensor."""
    if expert is None:
        return t.ap(pattern, offset=offset)
    return t.ap(pattern, offset=offset, scalar_offset=expert, indirect_dim=0)


def _tiled(w: Any) -> bool:
    """Whether a weight (a stack, or one expert without its leading dimension) is in the kernel layout."""
    return w.ndim in (4, 5)


def _ranges_ap(ranges: list[tuple[int, int]]) -> tuple[int, int, int]:
    """(first tile, count per range, tile spacing between ranges) of one or two equal row-tile ranges."""
    (a, n), *rest = ranges
    assert len(ranges) <= 2 and all(m == n for _, m in rest), f"row-tile ranges {ranges}"
    return a, n, (rest[0][0] - a if rest else n)


def _weight_tiles(dst: Any, w: Any, ranges: list[tuple[int, int]], expert: Any) -> None:
    """dst [128, ntiles, K/128, 128] FP8 = the W^T tiles of `ranges` (one or two equal runs of row tiles) of expert
    `expert`: dst[p, j, kt, i] = W[rt_j*128 + i, kt*128 + p].

    W in the kernel layout [E, 128, R/128, K/128, 128] (fp8_expert.to_kernel_layout): one DMA, partition p reading
    one contiguous run of n*K bytes per range (n*K*ranges when the ranges touch, as at LNC=1). W row-major [E, R, K]
    (the layout before): a transposing access pattern, one DMA per range, one byte per descriptor run.
    `expert` None: W is one expert's, without the leading dimension."""
    a, n, gap = _ranges_ap(ranges)
    if _tiled(w):
        nr, nk = w.shape[-3], w.shape[-2]
        run = nk * P
        pattern = [[nr * run, P], [gap * run, len(ranges)], [run, n], [1, run]]
        nisa.dma_copy(dst=dst, src=_hbm(w, pattern, a * run, expert))
        return
    k = w.shape[-1]
    for j, (rt0, m) in enumerate(ranges):
        pattern = [[1, P], [k * P, m], [P, k // P], [k, P]]
        nisa.dma_copy(dst=dst[:, j * n : (j + 1) * n, :, :], src=_hbm(w, pattern, rt0 * P * k, expert))


def _row_params(vecs: list[Any], ranges: list[tuple[int, int]], expert: Any, scratch: Any) -> Any:
    """[128, len(vecs) * ntiles] fp32 whose column v * ntiles + r holds vector v (a per-row scale or bias, [E, R]
    row-major) of the r-th row tile of `ranges`, rows on partitions. Each vector comes in with rows on the free axis:
    tile r's 128 values (512 contiguous bytes) on one partition, one DMA per vector, one descriptor per tile (read
    with rows on partitions instead, every 4-byte element would be a descriptor of its own). One PE transpose puts the
    rows on the partitions (exact: it moves fp32 bits [ISA nc_transpose])."""
    a, n, gap = _ranges_ap(ranges)
    ntiles = n * len(ranges)
    cols = len(vecs) * ntiles
    rows = nl.ndarray((cols, P), dtype=nl.float32, buffer=nl.sbuf)
    for v, vec in enumerate(vecs):
        src = _hbm(vec, [[gap * P, len(ranges)], [P, n], [1, P]], a * P, expert)
        nisa.dma_copy(dst=rows[v * ntiles : (v + 1) * ntiles, :], src=src)
    nisa.nc_transpose(dst=scratch[:, 0:cols], data=rows)
    out = nl.ndarray((P, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=scratch[:, 0:cols])
    return out


def _bcast_params(s: Any, col: int, n: int, t: int) -> Any:
    """Columns col .. col + n of a `_row_params` tile viewed as [128, n, t] (repeated over tokens, stride 0)."""
    return s.ap([[s.shape[1], P], [1, n], [0, t]], offset=col)


def _projection(
    dst: Any, q: Any, s_tok: Any, t: int, w: Any, s_row: Any, b: Any, expert: Any, ranges: list[tuple[int, int]],
    scratch: Any,
) -> None:  # fmt: skip
    """dst [128, ntiles, t] = ((W q^T) * s_tok) * s_row + b for W's row tiles `ranges` (of expert `expert`)."""
    ntiles = sum(n for _, n in ranges)
    nk = q.shape[1]
    w_t = nl.ndarray((P, ntiles, nk, P), dtype=nl.float8_e4m3, buffer=nl.sbuf)
    _weight_tiles(w_t, w, ranges, expert)
    sb = _row_params([s_row, b], ranges, expert, scratch)  # column r: s of tile r, ntiles + r: b of tile r
    for r0 in range(0, ntiles, GROUP):
        n = min(GROUP, ntiles - r0)
        acc = nl.ndarray((P, GROUP, t), dtype=nl.float32, buffer=nl.psum)
        for j in range(n):
            for kk in range(nk // 2):
                nisa.nc_matmul(
                    dst=acc[:, j, :],
                    stationary=w_t[:, r0 + j, 2 * kk : 2 * kk + 2, :],
                    moving=q[:, 2 * kk : 2 * kk + 2, :],
                    accumulate=kk > 0,
                    perf_mode=nisa.matmul_perf_mode.double_row,
                )
        out = dst[:, r0 : r0 + n, :]
        nisa.tensor_tensor(dst=out, data1=acc[:, 0:n, :], data2=_bcast_tokens(s_tok, n, t), op=nl.multiply)
        nisa.tensor_tensor(dst=out, data1=out, data2=_bcast_params(sb, r0, n, t), op=nl.multiply)
        nisa.tensor_tensor(dst=out, data1=out, data2=_bcast_params(sb, ntiles + r0, n, t), op=nl.add)


def load_quantized_x(x: Any, t: int, hd: int, scratch: Any = None) -> tuple[Any, Any]:
    """x [T, Hd] (HBM, any float dtype) -> quantized xq^T [128, Hd/128, T] FP8 and s_tok [128, T].

    x comes in with tokens on the partitions (one contiguous row of Hd elements each) and PE transposes (fp32, exact)
    put its features on the partitions, GROUP tiles per PSUM bank."""
    nd = hd // P
    if scratch is None:
        scratch = nl.ndarray((P, GROUP * P), dtype=nl.float32, buffer=nl.psum)
    x_rows = nl.ndarray((t, hd), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_rows, src=x)
    x_t = nl.ndarray((P, nd, t), dtype=nl.float32, buffer=nl.sbuf)
    for g0 in range(0, nd, GROUP):
        n = min(GROUP, nd - g0)
        ps = scratch.ap([[GROUP * P, P], [t, n], [1, t]])  # [128, n, t] in one bank
        for j in range(n):
            nisa.nc_transpose(dst=ps[:, j, :], data=x_rows[:, (g0 + j) * P : (g0 + j + 1) * P])
        nisa.tensor_copy(dst=x_t[:, g0 : g0 + n, :], src=ps)
    return _quantize_cols(x_t, nd, t)


def expert_mlp(
    xq: Any, sx: Any, t: int, w13: Any, s13: Any, b13: Any, w2: Any, s2: Any, b2: Any, expert: Any,
    scratch: Any = None,
) -> tuple[Any, Any, Any, Any]:  # fmt: skip
    """One expert on all t token columns -> (y^T [128, Hd_c/128, t] fp32, h^T [128, I/128, t], hq^T, s_h).

    Either weight layout (`_weight_tiles`). At LNC=1 the program computes everything (Hd_c = Hd). At LNC=2 program c
    computes the gate and up rows of its half of I and, after the two programs swap their halves of h (`sendrecv`),
    the down rows of its half of Hd: y is its half of the output's features, h and its quantization are the whole
    (the same on both cores). Each core reads half of every weight matrix, and every element is formed by the same
    instructions as at LNC=1: the split changes no bit."""
    if _tiled(w13):
        two_i, hd = w13.shape[-3] * P, w13.shape[-2] * P
    else:
        two_i, hd = w13.shape[-2], w13.shape[-1]
    ni = two_i // 2 // P
    if scratch is None:
        scratch = nl.ndarray((P, GROUP * P), dtype=nl.float32, buffer=nl.psum)
    i0, ni_c = _core_split(ni)
    gu = nl.ndarray((P, 2 * ni_c, t), dtype=nl.float32, buffer=nl.sbuf)  # [gate tiles | up tiles] of this core
    _projection(gu, xq, sx, t, w13, s13, b13, expert, [(i0, ni_c), (ni + i0, ni_c)], scratch)
    h = nl.ndarray((P, ni, t), dtype=nl.float32, buffer=nl.sbuf)
    mine = h[:, i0 : i0 + ni_c, :]
    nisa.activation(dst=mine, op=nl.silu, data=gu[:, 0:ni_c, :])
    nisa.tensor_tensor(dst=mine, data1=mine, data2=gu[:, ni_c : 2 * ni_c, :], op=nl.multiply)
    if nl.num_programs(0) == 2:  # the other core's half of h: both need all of it (amax, down projection)
        other = 1 - nl.program_id(0)
        theirs = other * ni_c
        nisa.sendrecv(
            src=mine, dst=h[:, theirs : theirs + ni_c, :], send_to_rank=other, recv_from_rank=other, pipe_id=0
        )
    hq, sh = _quantize_cols(h, ni, t)
    d0, nd_c = _core_split(hd // P)
    y = nl.ndarray((P, nd_c, t), dtype=nl.float32, buffer=nl.sbuf)
    _projection(y, hq, sh, t, w2, s2, b2, expert, [(d0, nd_c)], scratch)
    return y, h, hq, sh


def check_shapes(t: int, hd: int, two_i: int) -> None:
    """The kernel's size contract: 1..128 tokens per call, Hd and I multiples of 256 (double-row tiles)."""
    assert 1 <= t <= MAX_TOKENS, f"tokens per call must be 1..{MAX_TOKENS}, got {t}"
    assert hd % 256 == 0 and two_i % 512 == 0, f"Hd and I must be multiples of 256, got Hd={hd}, 2I={two_i}"


def store_tokens(dst: Any, src: Any, t: int, c0: int, scratch: Any) -> None:
    """src [128, n, t] fp32 (features on partitions) -> columns c0 .. c0 + 128 n of dst [t, cols] (HBM): PE transposes
    (fp32, exact) put the tokens on the partitions, so each token's row leaves in one contiguous run."""
    n = src.shape[1]
    rows = nl.ndarray((t, n * P), dtype=nl.float32, buffer=nl.sbuf)
    for g0 in range(0, n, GROUP):
        m = min(GROUP, n - g0)
        for j in range(m):
            nisa.nc_transpose(dst=scratch[0:t, j * P : (j + 1) * P], data=src[:, g0 + j, :])
        nisa.tensor_copy(dst=rows[:, g0 * P : (g0 + m) * P], src=scratch[0:t, 0 : m * P])
    cols = dst.shape[1]
    nisa.dma_copy(dst=dst.ap([[cols, t], [1, n * P]], offset=c0), src=rows)


def store_transposed(dst: Any, src: Any, t: int, cols: int) -> None:
    """src [128, cols/128, t] -> dst [t, cols] (HBM) through a transposing access pattern (one element per descriptor
    run: for the tests' FP8 intermediates, which the PE cannot transpose; not on the decode path)."""
    nisa.dma_copy(dst=dst.ap([[1, P], [P, cols // P], [cols, t]], offset=0), src=src)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@nki.jit
def fp8_experts_kernel(x, block_expert, block_active, block_weight, w13, s13, b13, w2, s2, b2):
    """All routed experts of a layer: out [T, Hd] fp32 = sum over active blocks b of block_weight[b] * y_e.

    x [T, Hd]; block_expert/block_active [NB] int32, block_weight [NB, T] fp32 (``expert_blocks``: active blocks
    first); w13 FP8 [E, 2I, Hd] or in the kernel layout [E, 128, 2I/128, Hd/128, 128], s13/b13 [E, 2I], w2 FP8
    [E, Hd, I] or [E, 128, Hd/128, I/128, 128], s2/b2 [E, Hd]. The blocks are one `nl.fori_loop` whose trip count,
    the number of active blocks, is summed from block_active at run time: neither E nor NB nor which experts are
    routed sizes the program, and an empty block is never entered. At LNC=2 each program computes half of every
    expert's gate/up rows and of its down rows (`expert_mlp`) and stores its half of out's features.
    """
    t, hd = x.shape
    nb = block_weight.shape[0]
    two_i = w13.shape[2] * P if _tiled(w13) else w13.shape[1]
    check_shapes(t, hd, two_i)
    out = nl.ndarray((t, hd), dtype=nl.float32, buffer=nl.shared_hbm)  # one tensor, each program its features
    scratch = nl.ndarray((P, GROUP * P), dtype=nl.float32, buffer=nl.psum)  # transposes, in program order
    act = nl.ndarray((1, nb), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=act, src=block_active)
    n_active = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=n_active, op=nl.add, data=act, axis=1, keepdims=True)
    trips = nisa.register_alloc(0)
    nisa.register_load(trips, n_active)
    xq, sx = load_quantized_x(x, t, hd, scratch)
    d0, nd_c = _core_split(hd // P)
    acc = nl.ndarray((P, nd_c, t), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)

    def block(i: Any) -> None:
        expert = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)  # the scalar offset of the expert's weights
        nisa.dma_copy(dst=expert, src=block_expert.ap([[1, 1], [1, 1]], offset=0, scalar_offset=i, indirect_dim=0))
        wt = nl.ndarray((P, t), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=wt, src=block_weight.ap([[0, P], [1, t]], offset=0, scalar_offset=i, indirect_dim=0))
        y, _, _, _ = expert_mlp(xq, sx, t, w13, s13, b13, w2, s2, b2, expert, scratch)
        nisa.tensor_tensor(dst=y, data1=y, data2=_bcast_tokens(wt, nd_c, t), op=nl.multiply)
        nisa.tensor_tensor(dst=acc, data1=acc, data2=y, op=nl.add)

    nl.fori_loop(0, trips, block)  # blocks in ascending expert order: the torch path's summation order
    store_tokens(out, acc, t, d0 * P, scratch)
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
    "store_tokens",
    "store_transposed",
]
