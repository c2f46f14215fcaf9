"""Driving the load: arrivals, concurrency limits, fixed batches, and two endpoints side by side.

Three ways to offer load (one `Load` per point of a sweep):
- `rate`: requests arrive at R per second (Poisson, or Gamma gaps with a burstiness factor), optionally
  capped at `max_concurrency` in flight (late arrivals wait client-side, as in `vllm bench serve`);
- `concurrency`: a closed loop, C requests in flight at all times (each finished request frees a slot);
- `batch`: fixed batches of B sent at once, the next batch when the whole batch has finished.

Side by side (two targets), the same workload goes to both:
- `pairs` (default): every request is sent to both endpoints at the same moment, A first for even
  requests and B first for odd ones (ABBA...), each endpoint with its own concurrency limit; both
  servers run at once, so machine noise hits both alike;
- `blocks`: the workload is cut into blocks that run on one endpoint at a time in the order
  A B B A A B ...; each server has the machine to itself while measured and slow drift cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from vllm_trn_plugin.bench.client import RequestResult, Target, stream_request
from vllm_trn_plugin.bench.workload import RequestSpec, fixed_batches, poisson_arrivals


@dataclass(frozen=True)
class Load:
    kind: str  # "rate" | "concurrency" | "batch"
    value: float
    max_concurrency: int | None = None
    burstiness: float = 1.0
    exact_total: bool = True  # rate: rescale arrivals so the last one is at n/rate (see poisson_arrivals)

    def __post_init__(self) -> None:
        if self.kind not in ("rate", "concurrency", "batch"):
            raise ValueError(f"unknown load kind {self.kind!r}")
        if not self.value > 0:
            raise ValueError(f"load value must be positive, got {self.value}")

    @property
    def label(self) -> str:
        v = "inf" if self.value == float("inf") else f"{self.value:g}"
        extra = f", max {self.max_concurrency} in flight" if self.max_concurrency else ""
        return {"rate": f"{v} req/s{extra}", "concurrency": f"concurrency {v}", "batch": f"batch {v}"}[self.kind]


@dataclass
class PointResult:
    """One load point: every request's result and the wall time each target was under load."""

    load: Load
    results: dict[str, list[RequestResult]]
    durations: dict[str, float]


class _Progress:
    """tqdm on stderr when available and wanted; otherwise nothing."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)
            except ImportError:
                pass

    def update(self, failed: bool) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if failed:
                self.bar.set_postfix_str("errors!", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def make_session(limit: int = 0, timeout_s: float = 600.0) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s))


async def _run_together(
    session: aiohttp.ClientSession,
    targets: Sequence[Target],
    specs: Sequence[RequestSpec],
    load: Load,
    params: dict[str, Any],
    seed: int,
    progress: _Progress,
    keep_text: bool,
) -> PointResult:
    """All targets loaded at once with the same schedule (one target: an ordinary run)."""
    labels = [t.label for t in targets]
    results: dict[str, list[RequestResult]] = {lab: [] for lab in labels}
    finished: dict[str, float] = {lab: 0.0 for lab in labels}
    cap = int(load.value) if load.kind == "concurrency" else load.max_concurrency
    sems = {lab: asyncio.Semaphore(cap) if cap else None for lab in labels}
    t0 = time.perf_counter()

    async def one(target: Target, spec: RequestSpec, at: float) -> None:
        if at > 0:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        sem = sems[target.label]
        async with sem if sem is not None else contextlib.nullcontext():
            res = await stream_request(session, target, spec, params, t0, keep_text)
        results[target.label].append(res)
        finished[target.label] = time.perf_counter() - t0
        progress.update(not res.ok)

    def order(i: int) -> Sequence[Target]:
        return targets if i % 2 == 0 else list(reversed(targets))

    if load.kind == "batch":
        for batch in fixed_batches(len(specs), int(load.value)):
            await asyncio.gather(*(one(t, specs[i], 0.0) for i in batch for t in order(i)))
    else:
        rate = load.value if load.kind == "rate" else float("inf")
        arrivals = poisson_arrivals(len(specs), rate, random.Random(seed), load.burstiness, load.exact_total)
        await asyncio.gather(*(one(t, spec, at) for spec, at in zip(specs, arrivals) for t in order(spec.index)))
    for lab in labels:
        results[lab].sort(key=lambda r: r.index)
    return PointResult(load, results, finished)


async def run_point(
    targets: Sequence[Target],
    specs: Sequence[RequestSpec],
    load: Load,
    params: dict[str, Any],
    seed: int = 0,
    interleave: str = "pairs",
    block_size: int = 8,
    progress: bool = True,
    timeout_s: float = 600.0,
    keep_text: bool = False,
) -> PointResult:
    """Run one load point over `specs` against one target, or two side by side (`interleave`)."""
    bar = _Progress(len(specs) * len(targets), load.label, progress)
    try:
        async with make_session(timeout_s=timeout_s) as session:
            if len(targets) == 1 or interleave == "pairs":
                return await _run_together(session, targets, specs, load, params, seed, bar, keep_text)
            if interleave != "blocks":
                raise ValueError(f"unknown interleave {interleave!r}: pairs or blocks")
            merged = PointResult(load, {t.label: [] for t in targets}, {t.label: 0.0 for t in targets})
            for k, start in enumerate(range(0, len(specs), block_size)):
                block = specs[start : start + block_size]
                for t in targets if k % 2 == 0 else list(reversed(targets)):
                    part = await _run_together(session, [t], block, load, params, seed + k, bar, keep_text)
                    offset = merged.durations[t.label]
                    for r in part.results[t.label]:
                        r.start += offset  # a continuous timeline per target
                    merged.results[t.label] += part.results[t.label]
                    merged.durations[t.label] += part.durations[t.label]
            return merged
    finally:
        bar.close()


async def warm_up(targets: Sequence[Target], spec: RequestSpec, params: dict[str, Any], n: int = 1) -> None:
    """`n` untimed requests per target (first-request compilation and connection set-up); raises if the
    endpoint cannot serve one."""
    async with make_session() as session:
        for t in targets:
            for _ in range(n):
                res = await stream_request(session, t, spec, params, time.perf_counter())
                if not res.ok:
                    raise RuntimeError(f"warm-up request to {t.url} failed: {res.error}")
