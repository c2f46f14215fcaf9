"""Simple GLA decode step (Laplace's mixer, one token per sequence) as an NKI 0.6 kernel for trn2: the kernel
`gla_decode_kernel`, its host wrapper `gla_decode_nki` and its cost formula `gla_decode_cost`.

Math, per sequence b of the batch and head h (lambda_h = exp(log_decay[h]), S_h in fp32)::

    S_h <- lambda_h * S_h + k_h v_h^T                                   [dk, dv]
    o_h  = scale * q_h^T S_h + sigmoid(sum_c q_h,c aug_h,c k_h,c) * v_h   [dv]

The state of sequence b lives in `state_pool[slots[b]]`, read and written in place; slot -1 is
a padding row: its state is neither read nor written and its output is zero. The definition of
the op is `simple_gla_decode_step` (simple_gla.py, also the model's torch path);
`gla_decode_nki` has the same signature plus `runner`.

Kernel arguments (prepared by `gla_decode_nki`, no data copies): q, k [B, H, dk] and v [B, H, dv]
as the model holds them (bf16 or fp32); aug [H, dk]; lam [H] fp32 = torch.exp(log_decay), the
reference's own expression, so lambda is bit-identical (ScalarE's exp is a polynomial and would
not be); the pool as rows [num_slots, E], E >= H*dk*dv, slot s's state at row s, elements
[h*dk*dv + c*dv + e] (vLLM 0.32's layer pool is a strided view whose slot stride is the state page,
the GLA state first, then the conv window, so E = page size / 4 and the rows alias the pool, see
`state_rows`); slots [B] int32; scale (compile-time float).

Tiling (H <= 128, dk <= 128, dv <= 512; Laplace: H = 16, dk = 96, dv = 192):
- Per sequence the whole state sits in SBUF as S [dk, H, dv] fp32: dk on partitions, (head,
  dv) on the free axis, 12 KiB per partition at the Laplace shape. One DMA brings it in and one
  writes it back, each addressing the pool through `.ap(scalar_offset=<1x1 SBUF tile holding
  slots[b]>)` with `oob_mode.skip`: a slot of -1 is out of bounds, so the padding row's state is
  never read and never written. Every partition moves H runs of dv*4 contiguous bytes (768 B).
- k v^T per head: `nc_matmul` with a one-partition contraction, stationary = k row [1, dk],
  moving = v row [1, dv] (both on partition 0, in the input dtype) -> PSUM [dk, dv] fp32 (one
  bank). Then S_h = (S_h * lambda_h) + kv in one `scalar_tensor_tensor` (VectorE, lambda_h from a
  [dk, H] SBUF tile broadcast from lam by DMA).
- q^T S per head, with the H outputs of a sequence landing on H partitions: stationary = Qmask_h
  [dk, H], whose column h is q_h and all other columns are 0; moving = S_h [dk, dv]; the H matmuls
  of a sequence accumulate into one PSUM tile O [H, dv] (one bank), row h = q_h^T S_h (the other
  heads add exact zeros). Qmask for a group of G = 128 // H sequences is built once: q rows
  [G*H, dk] -> `nc_transpose` (PE) -> copied onto the diagonal of a zeroed [dk, G, H, H] fp32
  tile (8 KiB per partition for H = 16; zeroed once per call, only the diagonal is rewritten).
- Self-augmentation per group, heads on partitions: q, k as [H, G, dk] (DMA runs of dk
  elements), (q * aug) * k on VectorE, sum over dk (`tensor_reduce`), sigmoid (ScalarE) ->
  g [H, G]. Per sequence: g*v on v [H, dv] (`tensor_scalar`), then
  o = (O * scale) + g*v (`scalar_tensor_tensor`, PSUM -> SBUF, cast to the output dtype on write).
- Output rows go out with the same skip trick: o[b] is written from o_sb through a 1x1 offset
  that is b for a real row and -1 for padding, and a zero tile is written through the
  complementary offset, so each row is written exactly once. These offsets come from slots in
  SBUF (`tensor_scalar`/`iota`, exact small integers in fp32).
- Loops are Python loops (unrolled; B, H compile-time): groups of G sequences, sequences, heads.
- PSUM: 3 allocation sites of one bank each (q transpose [dk, G*H], kv [dk, dv], O [H, dv]).
  SBUF per partition at the Laplace shape: S 12 KiB, Qmask 8 KiB, a few KiB of rows and gates.

Instruction counts per call (n_groups = ceil(B / G)): 2*B*H matmuls (kv and q^T S) plus n_groups
PE transposes; per head one VectorE op; per sequence 7 DMAs (2 state, 3 k/v rows, 2 output of
which one is skipped) and 2 VectorE ops; per group 3 DMAs and 6 on-chip ops.

DMA traffic per call (bytes, HBM side; R = B - #padding rows, isz = q/k/v itemsize,
osz = output itemsize): state 2*R*H*dk*dv*4 + q 2*B*H*dk*isz (rows for the transpose, head layout
for the gate) + k 2*B*H*dk*isz + v 2*B*H*dv*isz + o B*H*dv*osz + aug, lam, slots. The analytic
minimum is the state traffic (2*R*H*dk*dv*4, the op must read and write each real state once) +
one read of q, k, v + one write of o; the extra reads of q, k and v cost B*H*(2dk+dv)*isz: the
total is 0.5 % above the minimum at the Laplace shape in bf16 (B = 8 or 32; 0.8 % at B = 1, where
the [dk, H] broadcast of lam counts). See `gla_decode_cost`. TensorE does 2*B*H small matmuls
(the one-partition k v^T uses 1/128 of the array) but the state DMA dominates: 72 KiB per head
each way against two matmuls of dv = 192 columns.

Numerics contract (all math fp32):
- S: bit-exact vs the reference. k v^T is a single product per PSUM element (exact for bf16
  inputs; correctly rounded fp32 for fp32 inputs, like torch's k*v), and
  `scalar_tensor_tensor` rounds (S * lambda) to fp32 and then the sum, exactly torch's
  `lam * S + kv` (two separately rounded fp32 ops; no fused multiply-add on either side).
  UNCONFIRMED on hardware: that VectorE rounds between op0 and op1 (the emulator and the NKI docs'
  "compute in fp32" say so) and that an fp32 PE product is correctly rounded for fp32 inputs.
- o: q^T S and the gate's sum over dk are fp32 sums in another order than torch's (PSUM
  accumulation, VectorE reduction), so o agrees with the reference to fp32 roundoff (tests:
  1e-6 of max|o|), and bf16 outputs to within one bf16 ulp
  (a different fp32 value can round to the neighbouring bf16). Padding rows are +0.0 exactly.
  The emulator sums each matmul exactly and rounds once; hardware PE accumulation of fp32
  operands may round differently (UNCONFIRMED), which this tolerance may need to absorb.
- A head whose state holds inf/NaN spreads NaN to the other heads of its sequence's output
  (the masked matmul adds 0 * inf); the reference keeps it to that head. States of a real model
  are finite (lambda < 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_trn_plugin.kernels.nki_shim import nisa, nki, nl

LNC_DEGREES = (1,)  # the LNC degrees the kernel runs at (kernels/nki_ops.py refuses a deployment at another)

PMAX = 128  # SBUF/PSUM partitions; also the stationary free size limit of nc_matmul
MOVING_FMAX = 512  # nc_matmul moving free size limit on trn2 (one PSUM bank of fp32)


@nki.jit
def gla_decode_kernel(q, k, v, aug, lam, state, slots, scale):  # noqa: ANN001, ANN201
    """One GLA decode step for B sequences; returns (o [B, H, dv] in q's dtype, `state`), updating `state`.

    q, k [B, H, dk], v [B, H, dv] (bf16 or fp32); aug [H, dk]; lam [H] fp32; state [num_slots, E]
    fp32 with slot s's [H, dk, dv] state at state[s, :H*dk*dv]; slots [B] int32 (-1 = padding);
    scale a compile-time float. Math, tiling and numerics: see the module docstring.
    """
    B, H, dk = q.shape
    dv = v.shape[2]
    E = state.shape[1]
    assert k.shape == (B, H, dk) and v.shape[:2] == (B, H) and aug.shape == (H, dk)
    assert H <= PMAX and dk <= PMAX and dv <= MOVING_FMAX and H * dk * dv <= E
    G = max(1, PMAX // H)  # sequences per group: G*H rows of q fit the partitions
    f32 = nl.float32

    o = nl.ndarray((B, H, dv), dtype=q.dtype, buffer=nl.shared_hbm)

    # Constants: lambda broadcast to every partition of S, aug with heads on partitions.
    lam_sb = nl.ndarray((dk, H), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=lam_sb, src=lam.ap([[0, dk], [1, H]], offset=0))
    aug_sb = nl.ndarray((H, dk), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=aug_sb, src=aug)
    zero_sb = nl.ndarray((H, dv), dtype=q.dtype, buffer=nl.sbuf)
    nisa.memset(dst=zero_sb, value=0.0)
    qmask = nl.ndarray((dk, G, H, H), dtype=f32, buffer=nl.sbuf)
    nisa.memset(dst=qmask, value=0.0)

    # Row offsets for the output writes: o_row[b] = b for a real row, -1 for padding;
    # zero_row[b] the other way round. (b+1)*valid is an exact small integer in fp32.
    slots_sb = nl.ndarray((1, B), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=slots_sb, src=slots)
    valid = nl.ndarray((1, B), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=valid, data=slots_sb, op0=nl.greater_equal, operand0=0.0)
    b_plus_1 = nl.ndarray((1, B), dtype=f32, buffer=nl.sbuf)
    nisa.iota(dst=b_plus_1, pattern=[[1, B]], offset=1)
    kept = nl.ndarray((1, B), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=kept, data1=valid, data2=b_plus_1, op=nl.multiply)
    o_row = nl.ndarray((1, B), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=o_row, data=kept, op0=nl.subtract, operand0=1.0)
    zero_row = nl.ndarray((1, B), dtype=nl.int32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(
        dst=zero_row, data=b_plus_1, op0=nl.subtract, operand0=1.0, op1=nl.subtract, operand1=kept
    )

    state_ap = [[dv, dk], [dk * dv, H], [1, dv]]  # [c, h, e] -> h*dk*dv + c*dv + e within a row
    o_ap = [[dv, H], [1, dv]]

    for b0 in range(0, B, G):
        nb = min(G, B - b0)
        R = nb * H
        # Qmask: q_{b,h} on the diagonal of a [dk, G, H, H] tile (PE transpose of the q rows).
        q_rows = nl.ndarray((R, dk), dtype=q.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=q_rows, src=q.ap([[dk, R], [1, dk]], offset=b0 * H * dk))
        q_t = nl.ndarray((dk, R), dtype=q.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=q_t, data=q_rows)
        diag = qmask.ap([[G * H * H, dk], [H * H, nb], [H + 1, H]], offset=0)
        nisa.tensor_copy(dst=diag, src=q_t)

        # Gates g[h, b] = sigmoid(sum_c (q*aug)*k), heads on partitions.
        qh = nl.ndarray((H, G, dk), dtype=q.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=qh[:, 0:nb, :], src=q.ap([[dk, H], [H * dk, nb], [1, dk]], offset=b0 * H * dk))
        kh = nl.ndarray((H, G, dk), dtype=k.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=kh[:, 0:nb, :], src=k.ap([[dk, H], [H * dk, nb], [1, dk]], offset=b0 * H * dk))
        qa = nl.ndarray((H, G, dk), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(
            dst=qa[:, 0:nb, :], data1=qh[:, 0:nb, :], data2=aug_sb.ap([[dk, H], [0, nb], [1, dk]]), op=nl.multiply
        )
        nisa.tensor_tensor(dst=qa[:, 0:nb, :], data1=qa[:, 0:nb, :], data2=kh[:, 0:nb, :], op=nl.multiply)
        logit = nl.ndarray((H, G), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=logit[:, 0:nb], op=nl.add, data=qa[:, 0:nb, :], axis=(2,))
        gate = nl.ndarray((H, G), dtype=f32, buffer=nl.sbuf)
        nisa.activation(dst=gate[:, 0:nb], op=nl.sigmoid, data=logit[:, 0:nb])

        for j in range(nb):
            b = b0 + j
            slot = slots_sb[0:1, b : b + 1]
            S = nl.ndarray((dk, H, dv), dtype=f32, buffer=nl.sbuf)
            nisa.dma_copy(
                dst=S,
                src=state.ap(state_ap, offset=0, scalar_offset=slot, indirect_dim=0),
                oob_mode=nisa.oob_mode.skip,
            )
            k_row = nl.ndarray((1, H * dk), dtype=k.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=k_row, src=k[b])
            v_row = nl.ndarray((1, H * dv), dtype=v.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=v_row, src=v[b])
            v_h = nl.ndarray((H, dv), dtype=v.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=v_h, src=v[b])

            o_ps = nl.ndarray((H, dv), dtype=f32, buffer=nl.psum)
            for h in range(H):
                kv = nl.ndarray((dk, dv), dtype=f32, buffer=nl.psum)
                nisa.nc_matmul(
                    dst=kv,
                    stationary=k_row[0:1, h * dk : (h + 1) * dk],
                    moving=v_row[0:1, h * dv : (h + 1) * dv],
                    accumulate=False,
                )
                nisa.scalar_tensor_tensor(
                    dst=S[:, h, :],
                    data=S[:, h, :],
                    op0=nl.multiply,
                    operand0=lam_sb[:, h : h + 1],
                    op1=nl.add,
                    operand1=kv,
                )
                nisa.nc_matmul(dst=o_ps, stationary=qmask[:, j, h, :], moving=S[:, h, :], accumulate=h > 0)
            nisa.dma_copy(
                dst=state.ap(state_ap, offset=0, scalar_offset=slot, indirect_dim=0),
                src=S,
                oob_mode=nisa.oob_mode.skip,
            )

            gv = nl.ndarray((H, dv), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=gv, data=v_h, op0=nl.multiply, operand0=gate[:, j : j + 1])
            o_sb = nl.ndarray((H, dv), dtype=q.dtype, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(
                dst=o_sb, data=o_ps, op0=nl.multiply, operand0=float(scale), op1=nl.add, operand1=gv
            )
            nisa.dma_copy(
                dst=o.ap(o_ap, offset=0, scalar_offset=o_row[0:1, b : b + 1], indirect_dim=0),
                src=o_sb,
                oob_mode=nisa.oob_mode.skip,
            )
            nisa.dma_copy(
                dst=o.ap(o_ap, offset=0, scalar_offset=zero_row[0:1, b : b + 1], indirect_dim=0),
                src=zero_sb,
                oob_mode=nisa.oob_mode.skip,
            )
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
) -> dict[str, int]:
    """DMA bytes (HBM side) and TensorE instruction counts of one kernel call.

    in_bytes: itemsize of q, k, v; out_bytes: of o (default in_bytes); num_padding: rows with
    slot -1 (their state DMAs are skipped). `dma_min_bytes` is the analytic minimum: each real
    state read and written once, q, k, v read once, o written once, aug/lam/slots once.
    """
    out_bytes = in_bytes if out_bytes is None else out_bytes
    R = B - num_padding
    G = max(1, PMAX // H)
    n_groups = -(-B // G)
    state = 2 * R * H * dk * dv * 4
    qkv = 2 * B * H * (2 * dk + dv) * in_bytes
    small = H * dk * aug_bytes + dk * H * 4 + B * 4
    out = B * H * dv * out_bytes
    return {
        "dma_bytes": state + qkv + small + out,
        "dma_state_bytes": state,
        "dma_min_bytes": state + B * H * (2 * dk + dv) * in_bytes + out + H * dk * aug_bytes + H * 4 + B * 4,
        "dma_instructions": 3 + 3 * n_groups + 7 * B,
        "matmuls": 2 * B * H,
        "transposes": n_groups,
    }
