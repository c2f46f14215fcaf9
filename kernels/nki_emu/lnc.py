"""Cross-core operations of an LNC=2 launch: ``core_barrier`` and ``sendrecv`` (``nki.lnc`` in SDK 2.34, the
deprecated ``nki.isa`` entry points before; ``isa`` re-exports both) [LNC-API, LNC-CB, LNC-SR].

The emulator runs the programs of a launch one at a time (``runtime.Launch``); these operations are where one
program waits for the other. Their semantics are the documented ones, which sequential programs can give exactly:

- ``core_barrier(data, cores)``: every listed core reaches the barrier before any continues [LNC-CB]. The n-th
  barrier of program 0 pairs with the n-th of program 1; the first to arrive waits, the other program runs until
  it arrives, so every write either program made before the barrier is visible to both after it. ``cores`` with
  one core is a barrier with itself (nki-library passes ``(0)`` when it runs unsharded [L-BWMM]) and waits for
  nothing. ``data`` must be in shared HBM [LNC-CB]. At LNC=1 a two-core barrier waits for the other physical
  core's own launch, which the emulator does not run: an error.
- ``sendrecv(src, dst, send_to_rank, recv_from_rank, ...)``: each core sends its ``src`` tile to the ``dst`` tile of
  ``send_to_rank`` and receives ``recv_from_rank``'s ``src`` into its own ``dst``; the n-th sendrecv of one core
  pairs with the n-th of the other (program order) [LNC-SR]. LNC=2 only; ``src``/``dst`` in SBUF, same dtype, same
  partition count and elements per partition [ISA-SR]; ``dma_engine.gpsimd_dma`` moves at most 256 elements per
  partition (1024 B of 32-bit, 512 B of 16-bit, 256 B of 8-bit types) [ISA-SR]. ``pipe_id`` is accepted and ignored
  (removed in ``nki.lnc.sendrecv``; the pairing is positional) [LNC-API]. Counters: one ``sendrecv`` instruction
  per program and the received bytes as SBUF->SBUF DMA bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import dtypes as dt
from . import errors
from .memory import MemoryRegion, NkiTensor, ctx

_GPSIMD_DMA_MAX_ELEMENTS = 256  # per partition [ISA-SR]


def _cores(cores: Any) -> tuple[int, ...]:
    if isinstance(cores, (int, np.integer)):
        return (int(cores),)
    out = tuple(int(c) for c in cores)
    if not out or any(c not in (0, 1) for c in out) or len(set(out)) != len(out):
        raise errors.LncError(f"core_barrier: cores must be (0, 1) or one core, got {cores!r} [LNC-CB]")
    return out


def core_barrier(data: NkiTensor, cores: Any, engine: Any = None, name: str | None = None) -> None:
    """Wait until every core in ``cores`` has reached its matching barrier [LNC-CB] (module docstring)."""
    op = "core_barrier"
    if not isinstance(data, NkiTensor) or data.buffer is not MemoryRegion.shared_hbm:
        where = data.buffer.value if isinstance(data, NkiTensor) else type(data).__name__
        raise errors.MemorySpaceError(f"{op}: data must be a tensor in shared HBM, got {where} [LNC-CB]")
    kctx = ctx()
    group = _cores(cores)
    kctx.counters.count(op)
    if len(group) == 1:
        return  # a barrier with itself: nothing to wait for
    launch = kctx.launch
    if launch is None or kctx.num_programs == 1:
        raise errors.LncError(
            f"{op}(cores={group}): at LNC=1 the other physical core runs its own launch, which the emulator does "
            "not run; barriers between cores are emulated at LNC=2 only"
        )
    launch.rendezvous(op, None, lambda posts: None)


def _check_tile(t: Any, what: str) -> NkiTensor:
    if not isinstance(t, NkiTensor) or t.buffer is not MemoryRegion.sbuf:
        where = t.buffer.value if isinstance(t, NkiTensor) else type(t).__name__
        raise errors.MemorySpaceError(f"sendrecv: {what} must be an SBUF tile, got {where} [ISA-SR]")
    return t


def _per_partition(t: NkiTensor) -> int:
    return t.size // t.shape[0]


def sendrecv(
    src: NkiTensor,
    dst: NkiTensor,
    send_to_rank: int,
    recv_from_rank: int,
    pipe_id: Any = None,
    dma_engine: Any = None,
    name: str | None = None,
    priority: Any = None,
) -> None:
    """Exchange tiles with the other core of the LNC [LNC-SR, ISA-SR] (module docstring)."""
    op = "sendrecv"
    src, dst = _check_tile(src, "src"), _check_tile(dst, "dst")
    if src.dtype != dst.dtype:
        raise errors.DtypeError(f"{op}: src ({src.dtype}) and dst ({dst.dtype}) must have the same dtype [ISA-SR]")
    if src.shape[0] != dst.shape[0] or _per_partition(src) != _per_partition(dst):
        raise errors.ShapeError(
            f"{op}: src {src.shape} and dst {dst.shape} must have the same partition count and elements per "
            "partition [ISA-SR]"
        )
    if getattr(dma_engine, "name", dma_engine) == "gpsimd_dma" and _per_partition(src) > _GPSIMD_DMA_MAX_ELEMENTS:
        raise errors.ShapeError(
            f"{op}: dma_engine.gpsimd_dma moves at most {_GPSIMD_DMA_MAX_ELEMENTS} elements per partition "
            f"({_GPSIMD_DMA_MAX_ELEMENTS * dt.itemsize(src.dtype)} B of {src.dtype}), got {_per_partition(src)} "
            "[ISA-SR]"
        )
    kctx = ctx()
    if kctx.launch is None or kctx.num_programs != 2:
        raise errors.LncError(f"{op}: needs an LNC=2 launch (this one runs LNC={kctx.num_programs}) [LNC-API]")
    me = kctx.program_id
    for rank, what in ((send_to_rank, "send_to_rank"), (recv_from_rank, "recv_from_rank")):
        if rank not in (0, 1):
            raise errors.LncError(f"{op}: {what} must be 0 or 1, got {rank!r} [ISA-SR]")
        if rank == me:
            raise errors.LncError(
                f"{op}: program {me} names itself as {what}; the exchange is with the other core "
                "(a self-send is not described by the docs, UNCONFIRMED)"
            )
    kctx.counters.count(op)
    payload = {"src": np.array(src.read_raw(op)), "dst": dst, "to": send_to_rank, "from": recv_from_rank, "ctx": kctx}

    def exchange(posts: dict[int, dict]) -> None:
        for q, post in posts.items():
            sender = posts[post["from"]]
            if sender["to"] != q:
                raise errors.LncError(
                    f"{op}: program {q} receives from {post['from']}, which sends to {sender['to']} [LNC-SR]"
                )
            d: NkiTensor = post["dst"]
            vals = sender["src"]
            if vals.dtype != dt.np_dtype(d.dtype) or vals.size != d.size:
                raise errors.ShapeError(
                    f"{op}: program {q}'s dst {d.shape} {d.dtype} cannot take program {post['from']}'s src "
                    f"{vals.shape} {vals.dtype} [ISA-SR]"
                )
            d.write_raw(vals.reshape(d.shape), op)
            post["ctx"].counters.dma_sbuf_to_sbuf_bytes += int(vals.size) * dt.itemsize(d.dtype)

    kctx.launch.rendezvous(op, payload, exchange)
