"""DMA cost model of the emulator: descriptors (contiguous runs) per ``dma_copy`` and an estimated time.

What the docs state (docs/nki.md section 3.6, tags there):
- "Each DMA transfer can gather a list of source DMA buffers and then scatter the data into another list of
  destination DMA buffers. Data within a DMA buffer must be continuous in the memory address map"; there is overhead
  per DMA buffer and per transfer [TRN1]. An SBUF side needs at least one buffer per partition (partitions are not
  contiguous in the address map), more when a partition's slice is not contiguous [TRN1].
- 16 DMA engines per NeuronCore; for SBUF transfers each engine serves 8 of the 128 partitions [DMAOV]; 23 B/ns per
  engine on Trn2 (368 GB/s per core) [DMABW, DMAOV]; DMAOV's profile shows one engine moving 32 KiB in 1416 ns
  (23.1 B/ns).
- "every DMA transfer incurs descriptor setup, synchronization, and semaphore-to-start latency (~1300 ns
  cross-engine)" [DMABW]; payloads per partition: < 256 B "severely overhead-bound", 256 B - 2 KiB "improving but
  still below peak", >= 2 KiB "approaches peak", >= 4 KiB "fully amortizes per-packet overhead" [DMABW].

The model (our choices where the docs give no number):
- A descriptor moves one run that is contiguous on BOTH sides: the elements of a transfer pair up in row-major order
  of the two views (as ``dma_copy`` moves them) and a run ends where the next element is not the next address on the
  source or on the destination, where an on-chip side changes partition, or (indirect ``vector_offset`` access) where
  the gathered/scattered row changes: each indexed row is its own descriptor. So a transposing or element-strided
  pattern costs one descriptor per element (1-4 B each). The source-only and destination-only run counts are
  reported too (``Counters.dma_src_runs`` / ``dma_dst_runs``). A run's bytes are counted on the HBM side (the source
  for SBUF->SBUF), like the byte counters. Skipped (out-of-bounds) rows have no descriptor.
- Time of one ``dma_copy``: ``DMA_FIXED_NS`` + the busiest engine's sum over its descriptors of
  (``DMA_DESCRIPTOR_NS`` + bytes / ``DMA_ENGINE_BYTES_PER_NS``). A run is served by the engine of its on-chip
  partition (partition // 8; the destination's for SBUF->SBUF); HBM->HBM runs are dealt round-robin to 16 engines.
- ``DMA_DESCRIPTOR_NS`` = 22.3 ns is a fit, UNCONFIRMED: the time of 512 B at 23 B/ns, so that a descriptor of b
  bytes runs at b / (b + 512) of peak: 33 % at 256 B ("a small fraction"), 80 % at 2 KiB ("approaches peak"), 89 % at
  4 KiB ("fully amortizes") [DMABW's curve]. ``DMA_FIXED_NS`` counts once per instruction as if DMAs never overlapped;
  on the device queued transfers overlap their fixed latency, so ``Counters.dma_transfer_ns`` (engines busy, no fixed
  part) is the throughput-side estimate and ``Counters.dma_time_ns`` the serial, latency-side one.
"""

from __future__ import annotations

import numpy as np

DMA_ENGINES = 16  # per NeuronCore [DMAOV, DMABW]
DMA_PARTITIONS_PER_ENGINE = 8  # 128 partitions / 16 engines [DMAOV]
DMA_ENGINE_BYTES_PER_NS = 23.0  # Trn2 [DMABW, DMAOV]
DMA_FIXED_NS = 1300.0  # per transfer: descriptor setup, synchronization, semaphore-to-start [DMABW]
DMA_DESCRIPTOR_NS = 512.0 / DMA_ENGINE_BYTES_PER_NS  # fit to [DMABW]'s curve, UNCONFIRMED (module docstring)


def efficiency(run_bytes: float) -> float:
    """Fraction of an engine's peak rate a stream of ``run_bytes``-byte descriptors reaches in this model."""
    t_data = run_bytes / DMA_ENGINE_BYTES_PER_NS
    return t_data / (t_data + DMA_DESCRIPTOR_NS)


class DmaRuns:
    """The descriptors of one transfer: ``lengths`` (elements per run), ``run_bytes``, ``engine`` per run, and the
    source-only / destination-only run counts."""

    def __init__(self, lengths: np.ndarray, run_bytes: np.ndarray, engine: np.ndarray, src_runs: int, dst_runs: int):
        self.lengths = lengths
        self.run_bytes = run_bytes
        self.engine = engine
        self.src_runs = src_runs
        self.dst_runs = dst_runs

    @property
    def descriptors(self) -> int:
        return int(self.lengths.size)

    def transfer_ns(self) -> float:
        """The busiest engine's time: sum over its descriptors of fixed descriptor cost + bytes at the engine rate."""
        if not self.lengths.size:
            return 0.0
        per = DMA_DESCRIPTOR_NS + self.run_bytes / DMA_ENGINE_BYTES_PER_NS
        return float(np.bincount(self.engine, weights=per, minlength=DMA_ENGINES).max())


def _breaks(addr: np.ndarray, step: int, part_bytes: int | None) -> np.ndarray:
    """brk[k] (k >= 1): element k does not continue element k-1's run on this side."""
    brk = np.diff(addr) != step
    if part_bytes is not None:
        part = addr // part_bytes
        brk |= part[1:] != part[:-1]
    return brk


def dma_runs(
    s_addr: np.ndarray,
    d_addr: np.ndarray,
    s_isz: int,
    d_isz: int,
    s_part_bytes: int | None,
    d_part_bytes: int | None,
    rows: np.ndarray | None,
    side_isz: int,
) -> DmaRuns:
    """Runs of a transfer whose k-th moved element goes from byte ``s_addr[k]`` of the source storage to byte
    ``d_addr[k]`` of the destination's; ``*_part_bytes`` is the partition size of an on-chip side (None for HBM);
    ``rows`` the indirect row of each element (None without ``vector_offset``); ``side_isz`` the element size the run
    bytes are counted in."""
    n = int(s_addr.size)
    if n == 0:
        empty = np.zeros(0, np.int64)
        return DmaRuns(empty, empty.astype(np.float64), empty, 0, 0)
    s_brk = _breaks(s_addr, s_isz, s_part_bytes)
    d_brk = _breaks(d_addr, d_isz, d_part_bytes)
    row_brk = rows[1:] != rows[:-1] if rows is not None else np.zeros(n - 1, bool)
    joint = s_brk | d_brk | row_brk
    starts = np.concatenate(([0], np.flatnonzero(joint) + 1))
    lengths = np.diff(np.append(starts, n))
    if d_part_bytes is not None:
        engine = (d_addr[starts] // d_part_bytes) // DMA_PARTITIONS_PER_ENGINE
    elif s_part_bytes is not None:
        engine = (s_addr[starts] // s_part_bytes) // DMA_PARTITIONS_PER_ENGINE
    else:
        engine = np.arange(starts.size) % DMA_ENGINES
    return DmaRuns(
        lengths,
        (lengths * side_isz).astype(np.float64),
        engine.astype(np.int64),
        int(np.count_nonzero(s_brk | row_brk)) + 1,
        int(np.count_nonzero(d_brk | row_brk)) + 1,
    )


def run_bucket(nbytes: int) -> int:
    """Histogram bucket of a run: the largest power of two <= nbytes."""
    return 1 << (int(nbytes).bit_length() - 1)
