"""The arithmetic the three kernels' cost formulas share: their DMA transfers tallied per physical core the way the NKI
emulator's DMA model counts them (kernels/nki_emu/cost.py, which cites its sources), so a formula can be checked
against the emulator's counters number for number, and then evaluated at shapes too large to emulate.

A transfer is described by its descriptors (runs contiguous on both sides: one per SBUF partition and per contiguous
HBM run of that partition), the bytes of one run (counted on the HBM side, as the emulator does) and how many of its
descriptors the busiest DMA engine serves (engine = SBUF partition // 8). Its time is the emulator's: the busiest
engine's sum of (per-descriptor cost + bytes at the engine rate); `dma_time_ns` adds the fixed per-transfer latency,
as if no two transfers overlapped (an upper bound), `dma_transfer_ns` leaves it out (queued transfers overlapping it).
The analytic minimum time of a byte count is those bytes at the full rate of all 16 engines (368 B/ns per core).

Host-side only (deploy/kernel_costs.py, the kernel tests): it imports the emulator's constants.
"""

from __future__ import annotations

from typing import Any

from vllm_trn_plugin.kernels.nki_emu import cost as _model

PARTITIONS_PER_ENGINE = _model.DMA_PARTITIONS_PER_ENGINE
PEAK_BYTES_PER_NS = _model.DMA_ENGINES * _model.DMA_ENGINE_BYTES_PER_NS  # one core, every engine busy


def busiest(first: int, count: int, per_partition: int = 1) -> int:
    """Descriptors the busiest engine serves for a transfer over SBUF partitions [first, first + count), each with
    `per_partition` descriptors."""
    best = 0
    p = first
    while p < first + count:
        end = min(first + count, (p // PARTITIONS_PER_ENGINE + 1) * PARTITIONS_PER_ENGINE)
        best = max(best, end - p)
        p = end
    return best * per_partition


def min_time_ns(nbytes: float) -> float:
    """The analytic minimum DMA time of `nbytes` on one core: every engine streaming at its full rate."""
    return nbytes / PEAK_BYTES_PER_NS


class Tally:
    """One program's (one physical core's) counters as the emulator reports them, built transfer by transfer."""

    def __init__(self) -> None:
        self.c: dict[str, Any] = {
            "dma_hbm_to_sbuf_bytes": 0,
            "dma_sbuf_to_hbm_bytes": 0,
            "dma_sbuf_to_sbuf_bytes": 0,
            "dma_instructions": 0,
            "dma_descriptors": 0,
            "dma_transfer_ns": 0.0,
            "dma_time_ns": 0.0,
            "matmul_instructions": 0,
            "transpose_instructions": 0,
            "matmul_macs": 0,
            "emitted_instructions": 0,
            "executed_instructions": 0,
        }

    def dma(self, count: int, descriptors: int, run_bytes: int, most: int, to_hbm: bool = False) -> None:
        """`count` transfers, each of `descriptors` runs of `run_bytes` bytes, `most` of them on the busiest engine."""
        if count <= 0:
            return
        c = self.c
        c["dma_sbuf_to_hbm_bytes" if to_hbm else "dma_hbm_to_sbuf_bytes"] += count * descriptors * run_bytes
        c["dma_instructions"] += count
        c["dma_descriptors"] += count * descriptors
        t = most * (_model.DMA_DESCRIPTOR_NS + run_bytes / _model.DMA_ENGINE_BYTES_PER_NS)
        c["dma_transfer_ns"] += count * t
        c["dma_time_ns"] += count * (_model.DMA_FIXED_NS + t)

    def add(self, **counts: int) -> None:
        for k, v in counts.items():
            self.c[k] += v

    def result(self) -> dict[str, Any]:
        c = dict(self.c)
        c["dma_bytes"] = c["dma_hbm_to_sbuf_bytes"] + c["dma_sbuf_to_hbm_bytes"]
        return c


def combine(programs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A launch's figures from its programs': sums (as the emulator's totals), the programs' own under `programs`, and
    `dma_transfer_ns_core` / `dma_time_ns_core`: the slowest core's, what the launch waits for."""
    out: dict[str, Any] = {k: sum(p[k] for p in programs) for k in programs[0]}
    out["programs"] = programs
    out["lnc"] = len(programs)
    out["dma_transfer_ns_core"] = max(p["dma_transfer_ns"] for p in programs)
    out["dma_time_ns_core"] = max(p["dma_time_ns"] for p in programs)
    out.update(extra)
    return out
