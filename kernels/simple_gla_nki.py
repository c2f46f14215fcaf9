"""Simple GLA decode step (Laplace's mixer, one token per sequence) as an NKI kernel for trn2 (NKI 0.7/0.8, LNC=1 or 2).

Entry points: the kernel `gla_decode_kernel`, its host wrapper `gla_decode_nki` (the op's signature plus `runner`;
`state_rows` views vLLM's state pool as the kernel's rows) and its cost formula `gla_decode_cost`. The op
(S_h <- lambda_h S_h + k_h v_h^T, o_h = scale q_h^T S_h + sigmoid(sum_c q_h,c aug_h,c k_h,c) v_h, the state of
sequence b updated in place in `state_pool[slots[b]]`, slot -1 a padding row whose state is never addressed and whose
output is zero) is defined by `simple_gla_decode_step` in simple_gla.py, also the model's torch path. The rows are an
`nl.fori_loop`, the heads worked in groups (`head_groups`). LNC=2: program p takes heads [p H/2, (p+1) H/2) of every
row (one head group). Numerics: all math is fp32, only a bf16 output being rounded below it; the new states are
bit-exact against the torch path (UNCONFIRMED on hardware), o agrees to fp32 roundoff, and outputs and states are
bit-identical at LNC=1 and 2.

Design (math, kernel arguments, layout, tiling, loops and padding, DMA traffic, numerics): docs/kernels.md, section
'GLA decode kernel (`kernels/simple_gla_nki.py`): design'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_trn_plugin.kernels.nki_shim import nisa, nki, nl

LNC_DEGREES = (1, 2)  # the LNC degrees the kernel runs at (kernels/nki_ops.py refuses a deployment at another)

PMAX = 128  # SBUF/PSUM partitions; also the stationary free size limit of nc_matmul
MOVING_FMAX = 512  # nc_matmul moving free size limit on trn2 (one PSUM bank of fp32)


def head_groups(H: int, dk: int) -> tuple[int, int, int]:
    """(HG, M, J): heads per group, partitions per head, state rows per partition. A group of HG heads fills HG * M
    <= 128 partitions, partition (h, m) holding rows m J .. m J + J - 1 of head h's [dk, dv] state (one contiguous
    run of J dv fp32 in the slot's row). HG is H / 2 for an even H whatever the LNC degree, so one program at LNC=2
    does exactly the work of one of the two groups a program does at LNC=1 (bit-identical results); M is the largest
    divisor of dk that fits."""
    HG = H // 2 if H % 2 == 0 else H
    M = max(m for m in range(1, dk + 1) if dk % m == 0 and HG * m <= PMAX)
    return HG, M, dk // M


@nki.jit
def gla_decode_kernel(q, k, v, aug, lam, state, slots, scale):  # noqa: ANN001, ANN201
    """One GLA decode step for B sequences; returns (o [B, H, dv] in q's dtype, `state`), updating `state`.

    q, k [B, H, dk], v [B, H, dv] (bf16 or fp32); aug [H, dk]; lam [H] fp32; state [num_slots, E]
    fp32 with slot s's [H, dk, dv] state at state[s, :H*dk*dv]; slots [B] int32 (-1 = padding);
    scale a compile-time float. The heads are worked in groups (`head_groups`); at LNC=2 program p takes heads
    [p H/2, (p+1) H/2) of every row, one group. The batch is a `nl.fori_loop` (B sizes no code); a padding row's state
    work sits in a zero-trip loop. Math, tiling and numerics: docs/kernels.md, section
    'GLA decode kernel (`kernels/simple_gla_nki.py`): design'.
    """
    B, H, dk = q.shape
    dv = v.shape[2]
    E = state.shape[1]
    assert k.shape == (B, H, dk) and v.shape[:2] == (B, H) and aug.shape == (H, dk)
    assert H <= PMAX and dk <= PMAX and dv <= MOVING_FMAX and H * dk * dv <= E
    n_prog, prog = nl.num_programs(0), nl.program_id(0)
    HG, M, J = head_groups(H, dk)
    NP = HG * M  # partitions of a group's state tile
    assert (H // HG) % n_prog == 0, f"{H} heads in groups of {HG} do not split over LNC={n_prog}"
    groups = [prog * (H // n_prog) + g * HG for g in range(H // n_prog // HG)]  # first head of each of my groups
    f32 = nl.float32

    o = nl.ndarray((B, H, dv), dtype=q.dtype, buffer=nl.shared_hbm)  # one tensor, each program writes its heads

    # onehot[p, h] = 1 if partition p belongs to head h of the group (p // M == h): masks the q^T S stationaries and
    # sums a head's partitions; spread[h, p], its transpose in v's dtype, copies v_h onto head h's partitions
    diff = nl.ndarray((NP, HG), dtype=f32, buffer=nl.sbuf)  # p - M h
    nisa.iota(dst=diff, pattern=[[-M, HG]], offset=0, channel_multiplier=1)
    lo = nl.ndarray((NP, HG), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=lo, data=diff, op0=nl.greater_equal, operand0=0.0)
    onehot = nl.ndarray((NP, HG), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=onehot, data=diff, op0=nl.less, operand0=float(M))
    nisa.tensor_tensor(dst=onehot, data1=onehot, data2=lo, op=nl.multiply)
    diff_t = nl.ndarray((HG, NP), dtype=f32, buffer=nl.sbuf)  # p - M h, heads on partitions
    nisa.iota(dst=diff_t, pattern=[[1, NP]], offset=0, channel_multiplier=-M)
    lo_t = nl.ndarray((HG, NP), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=lo_t, data=diff_t, op0=nl.greater_equal, operand0=0.0)
    hi_t = nl.ndarray((HG, NP), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=hi_t, data=diff_t, op0=nl.less, operand0=float(M))
    spread = nl.ndarray((HG, NP), dtype=v.dtype, buffer=nl.sbuf)  # pairs with v as a matmul operand
    nisa.tensor_tensor(dst=spread, data1=hi_t, data2=lo_t, op=nl.multiply)
    # per group: lambda and aug in the state's layout (partition (h, m): lambda_h, aug_h[m J .. m J + J - 1])
    lam_g, aug_g = [], []
    for h0 in groups:
        t = nl.ndarray((NP, 1), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=lam.ap([[1, HG], [0, M]], offset=h0))
        lam_g.append(t)
        a = nl.ndarray((NP, J), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=aug.ap([[J, NP], [1, J]], offset=h0 * dk))
        aug_g.append(a)
    live = nisa.register_alloc(0)

    def sequence(b: Any) -> None:
        slot = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=slot, src=slots.ap([[1, 1], [1, 1]], offset=0, scalar_offset=b, indirect_dim=0))
        is_real = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)  # 1 for a real row, 0 for padding (-1)
        nisa.tensor_scalar(dst=is_real, data=slot, op0=nl.greater_equal, operand0=0.0)
        nisa.register_load(live, is_real)
        outs = []
        for _ in groups:
            o_sb = nl.ndarray((HG, dv), dtype=q.dtype, buffer=nl.sbuf)
            nisa.memset(dst=o_sb, value=0.0)  # a padding row's output; a real row overwrites it
            outs.append(o_sb)

        def real_row(_i: Any) -> None:
            for g, h0 in enumerate(groups):
                # the group's state: partition (h, m) <- rows m J .. m J + J - 1 of head h0 + h, one contiguous run;
                # addressed only when the slot is real (no out-of-bounds skip needed)
                st = state.ap([[J * dv, NP], [1, J * dv]], offset=h0 * dk * dv, scalar_offset=slot, indirect_dim=0)
                S = nl.ndarray((NP, J, dv), dtype=f32, buffer=nl.sbuf)
                nisa.dma_copy(dst=S, src=st)
                qq = nl.ndarray((NP, J), dtype=q.dtype, buffer=nl.sbuf)  # q in the state's layout
                nisa.dma_copy(dst=qq, src=q.ap([[J, NP], [1, J]], offset=h0 * dk, scalar_offset=b, indirect_dim=0))
                kk = nl.ndarray((NP, J), dtype=k.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=kk, src=k.ap([[J, NP], [1, J]], offset=h0 * dk, scalar_offset=b, indirect_dim=0))
                v_h = nl.ndarray((HG, dv), dtype=v.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=v_h, src=v.ap([[dv, HG], [1, dv]], offset=h0 * dv, scalar_offset=b, indirect_dim=0))
                vv = nl.ndarray((NP, dv), dtype=f32, buffer=nl.psum)  # v_h on each of head h's partitions (exact)
                nisa.nc_matmul(dst=vv, stationary=spread, moving=v_h, accumulate=False)
                # S = lam S + k v^T: the product and the update each one fp32 rounding, torch's two ops
                kv = nl.ndarray((NP, J, dv), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_tensor(
                    dst=kv, data1=kk.ap([[J, NP], [1, J], [0, dv]]), data2=vv.ap([[dv, NP], [0, J], [1, dv]]),
                    op=nl.multiply,
                )  # fmt: skip
                nisa.scalar_tensor_tensor(dst=S, data=S, op0=nl.multiply, operand0=lam_g[g], op1=nl.add, operand1=kv)
                nisa.dma_copy(dst=st, src=S)
                # q^T S: stationary j = q's rows j of every head, masked to the head's own partitions
                qm = nl.ndarray((NP, J, HG), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_tensor(
                    dst=qm, data1=qq.ap([[J, NP], [1, J], [0, HG]]), data2=onehot.ap([[HG, NP], [0, J], [1, HG]]),
                    op=nl.multiply,
                )  # fmt: skip
                o_ps = nl.ndarray((HG, dv), dtype=f32, buffer=nl.psum)
                for j in range(J):
                    nisa.nc_matmul(dst=o_ps, stationary=qm[:, j, :], moving=S[:, j, :], accumulate=j > 0)
                # gate g[h] = sigmoid(sum_c (q*aug)*k): per partition over its J rows, then over the head's M
                # partitions by a matmul with onehot (heads land on partitions)
                qa = nl.ndarray((NP, J), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=qa, data1=qq, data2=aug_g[g], op=nl.multiply)
                nisa.tensor_tensor(dst=qa, data1=qa, data2=kk, op=nl.multiply)
                part = nl.ndarray((NP, 1), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_reduce(dst=part, op=nl.add, data=qa, axis=(1,))
                logit = nl.ndarray((HG, 1), dtype=f32, buffer=nl.psum)  # heads on partitions
                nisa.nc_matmul(dst=logit, stationary=onehot, moving=part, accumulate=False)
                gate = nl.ndarray((HG, 1), dtype=f32, buffer=nl.sbuf)
                nisa.activation(dst=gate, op=nl.sigmoid, data=logit)
                gv = nl.ndarray((HG, dv), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_scalar(dst=gv, data=v_h, op0=nl.multiply, operand0=gate)
                nisa.scalar_tensor_tensor(
                    dst=outs[g], data=o_ps, op0=nl.multiply, operand0=float(scale), op1=nl.add, operand1=gv
                )

        nl.fori_loop(0, live, real_row)  # one trip for a real row, none for padding
        for g, h0 in enumerate(groups):
            nisa.dma_copy(dst=o.ap([[dv, HG], [1, dv]], offset=h0 * dv, scalar_offset=b, indirect_dim=0), src=outs[g])

    nl.fori_loop(0, B, sequence)
    # the state is returned as well: an in-place write is an output alias of the kernel for a graph compiler
    return o, state


def state_rows(state_pool: torch.Tensor) -> torch.Tensor:
    """The pool [num_slots, H, dk, dv] as rows [num_slots, E] aliasing the same memory (no copy).

    A contiguous pool gives E = H*dk*dv. A vLLM state-page view (slot stride = page size, the
    GLA state at the start of each page) gives E = the page stride: row s spans page s, of which
    the kernel touches only the first H*dk*dv elements.
    """
    N, H, dk, dv = state_pool.shape
    if state_pool.dtype != torch.float32:
        raise TypeError(f"GLA state pool must be float32, got {state_pool.dtype}")
    if state_pool.is_contiguous():
        return state_pool.view(N, H * dk * dv)
    E = state_pool.stride(0)
    if state_pool.stride()[1:] != (dk * dv, dv, 1) or E < H * dk * dv:
        raise ValueError(f"GLA state pool layout not supported: strides {state_pool.stride()}")
    end = state_pool.storage_offset() + N * E
    if end * 4 > state_pool.untyped_storage().nbytes():
        raise ValueError("GLA state pool: the last slot's page does not fit in its storage")
    return state_pool.as_strided((N, E), (E, 1))


def gla_decode_nki(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    aug: torch.Tensor,
    log_decay: torch.Tensor,
    scale: float,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    runner: Callable,
) -> torch.Tensor:
    """`simple_gla_decode_step` through the NKI kernel: same arguments, same result.

    runner: `simulate` from the NKI shim, or the device call; `runner(gla_decode_kernel)` is
    called once. Preparation (torch ops only, none touching the state nor reading a value back: a compiled graph
    holds them): lam = exp(log_decay) (torch, as the reference computes it), the pool viewed as rows
    (`state_rows`, no copy), slots as int32, and q, k, v made contiguous (in the model they are column slices of
    the fused qkvg projection: a B*H*(2dk+dv) copy). The state pool is updated in place (the kernel also returns
    it, as a graph compiler's in-place aliasing needs). slots must lie in [-1, num_slots) (unchecked here: the
    reference raises on a larger slot; the kernel would skip its state as out of bounds but still write an output
    row).
    """
    if q.shape[0] == 0:
        return q.new_empty(0, q.shape[1], v.shape[2])
    lam = torch.exp(log_decay.to(q.device, torch.float32))
    o, _ = runner(gla_decode_kernel)(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        aug.contiguous(),
        lam,
        state_rows(state_pool),
        slots.to(torch.int32),
        float(scale),
    )
    return o


def gla_decode_cost(
    B: int,
    H: int = 16,
    dk: int = 96,
    dv: int = 192,
    in_bytes: int = 2,
    out_bytes: int | None = None,
    aug_bytes: int = 4,
    num_padding: int = 0,
    lnc: int = 1,
) -> dict[str, Any]:
    """One kernel call's counters at LNC `lnc`, as the emulator reports them (kernels/kernel_cost.py): DMA bytes (HBM
    side), instructions, descriptors and times, TensorE instructions and MACs, emitted and executed instructions,
    summed over the programs, each program's under `programs` (every program sees every row, and its half of the heads),
    the slowest core's DMA times, and the analytic minimum.

    in_bytes: itemsize of q, k, v; out_bytes: of o (default in_bytes); num_padding: rows with slot -1 (their state,
    q, k and v are never read). `dma_min_bytes` is the analytic minimum: each real state read and written once, q, k, v
    of the real rows read once, o written once, aug/lam/slots once; `dma_time_min_ns` that minimum split evenly over
    the cores at their full DMA rate. `dma_state_bytes`: the state traffic alone.
    """
    from vllm_trn_plugin.kernels.kernel_cost import Tally, busiest, combine, min_time_ns

    out_bytes = in_bytes if out_bytes is None else out_bytes
    R = B - num_padding
    HG, M, J = head_groups(H, dk)
    NP = HG * M
    ng = H // lnc // HG  # groups per program
    programs = []
    for _ in range(lnc):
        t = Tally()
        t.dma(ng, NP, 4, busiest(0, NP))  # lambda, one element per partition
        t.dma(ng, NP, J * aug_bytes, busiest(0, NP))  # aug in the state's layout
        t.dma(B, 1, 4, 1)  # the row's slot
        t.dma(B * ng, HG, dv * out_bytes, busiest(0, HG), to_hbm=True)  # o, one head row per partition
        t.dma(R * ng, NP, J * dv * 4, busiest(0, NP))  # state in: one run of J rows per partition
        t.dma(R * ng, NP, J * dv * 4, busiest(0, NP), to_hbm=True)  # state out
        t.dma(2 * R * ng, NP, J * in_bytes, busiest(0, NP))  # q, k in the state's layout
        t.dma(R * ng, HG, dv * in_bytes, busiest(0, HG))  # v, one head row per partition (the PE spreads it)
        body = 16 + J  # instructions per group of a real row
        t.add(
            matmul_instructions=R * ng * (J + 2),
            matmul_macs=R * ng * (J * NP * HG * dv + NP * HG + NP * HG * dv),
            emitted_instructions=14 + 4 * ng + ng * body,
            executed_instructions=9 + 2 * ng + 1 + B * (4 + 2 * ng) + R * ng * body,
        )
        programs.append(t.result())
    state = 2 * R * H * dk * dv * 4
    dma_min = state + R * H * (2 * dk + dv) * in_bytes + B * H * dv * out_bytes + H * dk * aug_bytes + H * 4 + B * 4
    return combine(
        programs,
        dma_state_bytes=state,
        dma_min_bytes=dma_min,
        dma_time_min_ns=min_time_ns(dma_min / lnc),
    )
