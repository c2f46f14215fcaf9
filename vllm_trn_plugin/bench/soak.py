"""Reliability soak of `vllm-trn serve`: waves of concurrent streaming requests with a share of clients
disconnecting mid-stream, on both demo models, then a malformed-input sweep of the HTTP API.

Run (from the repository root)::

    .venv/bin/python deploy/soak.py                                  # both demo models, the defaults below
    .venv/bin/python deploy/soak.py --models laplace --waves 20 --concurrency 512 --output-len 48
    .venv/bin/python deploy/soak.py --dtype bfloat16                 # the demos as `make serve` serves them
    .venv/bin/python deploy/soak.py --base-url http://127.0.0.1:8000 --pid 1234   # a server already running

Each model: `vllm-trn demo MODEL` served by `vllm-trn serve` (eager, 4096-token context, `--dtype`, default
float32 so that "equal" can be tight, a small cache pool (POOL_BYTES, why there), vLLM's CPU defaults of
128 running sequences and 2048 batched tokens: a wave of 256 is half running, half queued in vLLM). Then:

1. *Alone*: each of `--prompts` distinct random token-id prompts (`--prompt-len`, default 8-160 tokens,
   longer than MLA-Trinity's 128-token window) is streamed on its own, one request at a time, greedy
   (temperature 0, `ignore_eos`, `--output-len` tokens) with the top-2 logprobs of every position
   (`logprobs: 2`, `return_tokens_as_token_ids`: tokens are compared as ids, not as detokenized text).
2. *Waves*: `--waves` times, `--concurrency` streams are opened at once (the prompts in turn, shuffled,
   no client-side limit); `--disconnect` of them, chosen at random, close their connection after a random
   number k of streamed tokens, k uniform in 1 .. `--output-len` - 2 (under load vLLM may put several
   tokens in one chunk: the client closes at the first chunk that brings it to k or more). Every other
   stream must end with `[DONE]`, `finish_reason` "length", exactly `--output-len` tokens (also by
   `usage`) and the same token ids as its prompt alone; a disconnected one must have received a prefix of
   them. A divergence counts as a *tie* (reported, not wrong; at most 5% of streams) only where both runs
   have the two tokens within `--tie-tol` nats (the tie rule: `vllm_trn_plugin.gate.ties`).
3. After each wave: wait until `/metrics` shows nothing running or waiting; serve one probe prompt alone,
   which must equal its reference (and makes the engine publish fresh statistics after the last aborts);
   then `/metrics` must show the pool empty (`vllm:kv_cache_usage_perc` 0: Laplace's state pages,
   MLA-Trinity's latent and sliding-window blocks) and nothing running or waiting. Aborts: vLLM counts a
   client-aborted request in no `vllm:request_success_total` series, so the check is that the "length"
   count grew by the complete streams (plus disconnected ones that finished before the server noticed),
   no "error", and `vllm:generation_tokens_total` grew by at least what the clients received and at most
   what the wave would have generated with no disconnect. How many disconnects were cut short (rather than
   finished first) is reported: it depends on how fast the server runs, so it is no pass/fail check. The
   resident memory (VmRSS) of the server process and all its children (API server, engine core, worker) is
   recorded.
4. Stability of resident memory over the waves (`rss_stable`): the first half of the waves is warm-up
   (caches that fill to a bound); from the first wave after it to the last, growth within `--rss-tol`
   (default 2%) and `--rss-kib-per-request` (default 16 KiB per request served). The server's allocator
   (`--malloc`): tcmalloc, which `vllm-trn serve` preloads when it is installed (the default), or glibc,
   as is or told to hand freed memory back (ALLOCATORS). Which processes run tcmalloc is recorded.
5. The malformed-input sweep (`vllm_trn_plugin.bench.malformed`); then `/health` 200 and a request still
   equal to its reference.

Prints a table per model and writes JSON (`--out`, default soak-out/soak.json); exit status 1 when any check
failed. `tests/test_reliability.py` runs a CI-sized version against the test session's servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import requests

from vllm_trn_plugin.bench.client import (
    COUNT,
    DONE,
    BadResponse,
    Target,
    build_payload,
    choices,
    expect,
    json_field,
    model_id,
    sse_messages,
    stream_error,
)
from vllm_trn_plugin.bench.local import serve_new_demo
from vllm_trn_plugin.bench.malformed import Case, malformed_cases, run_sweep
from vllm_trn_plugin.bench.metrics import Metrics, scrape
from vllm_trn_plugin.bench.runner import make_session
from vllm_trn_plugin.bench.workload import LengthDist, RequestSpec, random_requests
from vllm_trn_plugin.compat import cache_budget_given
from vllm_trn_plugin.envs import NO_TCMALLOC
from vllm_trn_plugin.gate.ties import TIE_MARGIN_BY_DTYPE, Agreement, compare_greedy

MODELS = ("laplace", "mla-trinity")
MAX_MODEL_LEN = 4096
# Cache pools small enough that one wave of 256 allocates more than the whole pool (the allocators hand out
# the least recently freed page or block first, so a wave walks through the pool): vLLM's CPU cache
# tensor is untouched memory until written, and with vllm-trn serve's default 1 GiB pool the worker's
# resident memory would grow by the freshly touched pages for many waves, which is not a leak. Laplace:
# ~230 fp32 state pages (128 run at once); MLA-Trinity: ~50k tokens (a wave of 256 peaks at ~40k).
POOL_BYTES = {"laplace": 32 * 2**20, "mla-trinity": 384 * 2**20}
# The server's allocator, as environment for `vllm-trn serve`. vLLM's eager CPU worker frees activations of
# a different size at every step; glibc keeps freed heap memory for reuse, so its resident memory keeps
# growing while the live objects stay flat (allocator retention, not a leak; docs/serving-trn2.md section 4).
# "glibc-return" tells glibc to mmap large blocks and trim the heap top, so resident memory follows what the
# server holds, at a cost in speed.
ALLOCATORS: dict[str, dict[str, str]] = {
    "tcmalloc": {},
    "glibc-return": {NO_TCMALLOC: "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"},
    "glibc": {NO_TCMALLOC: "1"},
}

# Greedy, exact lengths, top-2 logprobs per position, tokens as "token_id:N" so they compare as ids.
SOAK_PARAMS: dict[str, Any] = {
    "temperature": 0.0,
    "ignore_eos": True,
    "logprobs": 2,
    "return_tokens_as_token_ids": True,
}


# ---------------------------------------------------------------------------------------------------
# One stream


@dataclass
class Stream:
    """One streamed completion as the client saw it. `disconnect_after` is the plan (None: read to the end);
    `disconnected` says the client closed the connection before the server finished the request."""

    index: int
    prompt: int
    disconnect_after: int | None = None
    tokens: list[int] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)  # per position: top-2 token id -> logprob
    finish_reason: str | None = None
    done: bool = False
    disconnected: bool = False
    usage_tokens: int | None = None
    error: str = ""
    t_sent: float = 0.0  # perf_counter times: request sent, response headers in, stream ended or closed
    t_headers: float | None = None
    t_end: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.error and self.done and not self.disconnected


def _token_id(tok: Any, path: str) -> int:
    tok = expect(tok, "string", path, null_ok=False)
    digits = tok[len("token_id:") :] if tok.startswith("token_id:") else ""
    if not (digits.isascii() and digits.isdigit()):
        raise BadResponse(f"{path} is {tok[:60]!r}, expected 'token_id:N' (return_tokens_as_token_ids)")
    return int(digits)


def _logprobs(choice: dict[str, Any], path: str) -> tuple[list[int], list[dict[int, float]]]:
    """A chunk's token ids and, per position, its top logprobs (token id -> logprob); BadResponse when the
    `logprobs` object is not {"tokens": ["token_id:N", ...], "top_logprobs": [{"token_id:N": number, ...}, ...]}."""
    lp = json_field(choice, "logprobs", "object", path) or {}
    path += "logprobs."
    tokens = [_token_id(t, f"{path}tokens[{j}]") for j, t in enumerate(json_field(lp, "tokens", "array", path) or [])]
    top = []
    for j, d in enumerate(json_field(lp, "top_logprobs", "array", path) or []):
        where = f"{path}top_logprobs[{j}]"
        d = expect(d, "object", where) or {}
        top.append(
            {_token_id(k, f"{where} key"): expect(v, "number", f"{where}[{k!r}]", null_ok=False) for k, v in d.items()}
        )
    return tokens, top


async def stream_tokens(
    session: aiohttp.ClientSession,
    target: Target,
    spec: RequestSpec,
    params: dict[str, Any],
    disconnect_after: int | None = None,
    prompt: int | None = None,
) -> Stream:
    """Stream `spec` (completions endpoint, body from the bench client's `build_payload`) and collect the
    token ids and top logprobs; with `disconnect_after` = k, close the connection once k tokens have
    arrived (k = 0: as soon as the response headers arrive, before any token). Never raises for a failed
    request: the error is in `Stream.error`."""
    s = Stream(spec.index, spec.index if prompt is None else prompt, disconnect_after)
    body = build_payload(target, spec, params)
    s.t_sent = time.perf_counter()
    try:
        async with session.post(target.url, json=body, headers=target.headers()) as resp:
            s.t_headers = time.perf_counter()
            if resp.status != 200:
                s.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return s
            if disconnect_after == 0:
                resp.close()  # closes the socket: the server sees the client gone
                s.disconnected = True
                return s
            async for msg in sse_messages(resp):
                if msg is DONE:
                    s.done = True
                    break
                if stream_error(msg) is not None:
                    s.error = f"stream error: {json.dumps(msg)[:300]}"
                    return s
                for path, choice in choices(msg):
                    tokens, top = _logprobs(choice, path)
                    s.tokens += tokens
                    s.top += top
                    if finish := json_field(choice, "finish_reason", "string", path):
                        s.finish_reason = finish
                if usage := json_field(msg, "usage", "object"):
                    s.usage_tokens = json_field(usage, "completion_tokens", COUNT, "usage.") or 0
                if disconnect_after is not None and len(s.tokens) >= disconnect_after and not s.finish_reason:
                    resp.close()
                    s.disconnected = True
                    return s
    except BadResponse as e:
        s.error = f"bad response: {e}"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        s.error = f"{type(e).__name__}: {e}"
    finally:
        s.t_end = time.perf_counter()
    if not s.error and not s.done:
        s.error = "stream ended without [DONE]"
    return s


# ---------------------------------------------------------------------------------------------------
# Judging a stream against the same prompt served alone


def agreement(s: Stream, ref: Stream, tie_tol: float) -> Agreement:
    """`s` against its prompt served alone, over the tokens `s` received (the tie rule of `ties`: the alone
    run's top-2 margin, and this run's logprob of its pick minus its logprob of the alone run's pick)."""
    want = ref.tokens[: len(s.tokens)]
    got_margins = [top.get(a, math.inf) - top.get(b, -math.inf) for top, a, b in zip(s.top, s.tokens, want)]
    return compare_greedy(s.tokens, want, [top2_margin(ref, j) for j in range(len(want))], tie_tol, got_margins)


def judge(s: Stream, ref: Stream, max_tokens: int, tie_tol: float) -> str:
    """'correct' (same token ids as alone), 'tie' (diverged between two tokens within `tie_tol` nats in
    both runs), 'wrong', 'incomplete' (no [DONE], or not `max_tokens` tokens by count and by `usage`, or
    not finished by length), 'error'; for a disconnected stream 'prefix' (what arrived is a prefix of the
    alone run), 'prefix-tie' or 'prefix-wrong'."""
    if s.error:
        return "error"
    a = agreement(s, ref, tie_tol)
    verdict = "correct" if a.step is None else "tie" if a.tie else "wrong"
    if s.disconnected:
        return {"correct": "prefix", "tie": "prefix-tie", "wrong": "prefix-wrong"}[verdict]
    if not s.done or s.finish_reason != "length" or len(s.tokens) != max_tokens or s.usage_tokens != max_tokens:
        return "incomplete"
    return verdict


def logprob_gap(s: Stream, ref: Stream) -> float:
    """The largest |logprob| difference of the chosen token over the positions where both runs agree."""
    end = agreement(s, ref, 0.0).step
    gaps = [abs(s.top[j][t] - ref.top[j][t]) for j, t in enumerate(s.tokens[:end]) if j < len(ref.top)]
    return max(gaps, default=0.0)


def top2_margin(ref: Stream, j: int) -> float:
    """The gap between the two largest logprobs at position j of `ref` (inf when unknown)."""
    vals = sorted((ref.top[j] if j < len(ref.top) else {}).values(), reverse=True)
    return vals[0] - vals[1] if len(vals) >= 2 else math.inf


# ---------------------------------------------------------------------------------------------------
# The server's side: Prometheus gauges and counters, resident memory

# Summed over engines: key -> sample name
SERVER_COUNTS = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "preemptions": "vllm:num_preemptions_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
}


def server_counts(m: Metrics) -> dict[str, float]:
    """vLLM's pool and request gauges and the finished-request counters (`finished_<reason>`)."""
    out = {key: m.total(name) for key, name in SERVER_COUNTS.items()}
    finished = m.by_label("vllm:request_success_total", "finished_reason")
    return out | {f"finished_{reason}": n for reason, n in finished.items()}


def wait_idle(base_url: str, timeout: float = 120.0) -> dict[str, float]:
    """Poll /metrics until no request is running or waiting; returns the last reading (raises on timeout)."""
    deadline = time.time() + timeout
    while True:
        m = server_counts(scrape(base_url))
        if m["running"] == 0 and m["waiting"] == 0:
            return m
        if time.time() > deadline:
            raise TimeoutError(f"server still busy after {timeout:.0f} s: {m}")
        time.sleep(0.5)


def preloads(pid: int, lib: str = "libtcmalloc") -> dict[int, bool]:
    """For process `pid` and its descendants: whether `lib` is mapped (/proc/PID/maps)."""
    out = {}
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            out[p.pid] = lib in Path(f"/proc/{p.pid}/maps").read_text()
        except (OSError, psutil.NoSuchProcess):
            continue
    return out


def resident_memory(pid: int) -> dict[str, Any]:
    """Resident set size of process `pid` and all its descendants (bytes), total and per process."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    per: list[dict[str, Any]] = []
    for p in procs:
        try:
            per.append({"pid": p.pid, "name": p.name(), "rss": p.memory_info().rss})
        except psutil.NoSuchProcess:
            continue
    return {"total": sum(p["rss"] for p in per), "processes": per}


def rss_stable(rss: Sequence[int], per_wave: int, tol: float, kib_per_request: float) -> tuple[bool, str]:
    """Resident memory stable over waves (`rss[k]`: after wave k+1, `per_wave` requests each). The first
    half of the waves warms up (caches that fill up to a bound: allocator pools, per-shape kernel caches);
    from the wave after them to the last, growth at most `tol` (relative) and `kib_per_request` KiB per
    request served in between (a leak of one 143 KiB Laplace state page or one 16-token block per request
    would show as about that much)."""
    if len(rss) < 2:
        return True, "one wave: nothing to compare"
    k = len(rss) // 2  # rss[k]: after wave k + 1, the first wave after the warm-up half
    if k == len(rss) - 1:
        k = 0
    growth = rss[-1] - rss[k]
    per_req = growth / (per_wave * (len(rss) - 1 - k)) / 1024
    ok = growth / rss[k] <= tol and per_req <= kib_per_request
    return ok, (
        f"after wave {len(rss)} {rss[-1] / 2**20:.0f} MiB vs after wave {k + 1} {rss[k] / 2**20:.0f} MiB: "
        f"{growth / rss[k]:+.2%}, {per_req:+.1f} KiB per request (limits {tol:.0%}, {kib_per_request:g} KiB); "
        f"after wave 1: {rss[0] / 2**20:.0f} MiB"
    )


# ---------------------------------------------------------------------------------------------------
# Prompts, waves


def soak_prompts(n: int, prompt_len: str, max_tokens: int, seed: int) -> list[RequestSpec]:
    """`n` distinct random token-id prompts (byte ids 0-255, valid in both demo vocabularies)."""
    return random_requests(n, LengthDist.parse(prompt_len), LengthDist.parse(str(max_tokens)), seed, (0, 256))


def wave_plan(
    n: int, n_prompts: int, share: float, max_tokens: int, rng: random.Random
) -> list[tuple[int, int | None]]:
    """(prompt index, disconnect after k tokens or None) for each of `n` streams: the prompts in turn,
    shuffled; round(share * n) of them, chosen at random, disconnect mid-stream after k tokens, k uniform
    in [1, max_tokens - 2] (max_tokens >= 3)."""
    if share and max_tokens < 3:
        raise ValueError("disconnecting mid-stream needs max_tokens >= 3")
    prompts = [i % n_prompts for i in range(n)]
    rng.shuffle(prompts)
    drop = set(rng.sample(range(n), round(share * n)))
    return [(p, rng.randint(1, max_tokens - 2) if i in drop else None) for i, p in enumerate(prompts)]


async def serve_alone(target: Target, specs: Sequence[RequestSpec], timeout: float = 300.0) -> list[Stream]:
    """Each prompt streamed on its own, one after the other."""
    out = []
    async with make_session(timeout_s=timeout) as session:
        for spec in specs:
            s = await stream_tokens(session, target, spec, SOAK_PARAMS)
            if not s.complete:
                raise RuntimeError(f"prompt {spec.index} alone failed: {s.error or s.finish_reason}")
            out.append(s)
    return out


def peak_overlap(intervals: Sequence[tuple[float, float]]) -> int:
    """The largest number of [start, end] intervals that hold at one instant."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], -e[1]))
    peak = now = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return peak


@dataclass
class WaveOutcome:
    streams: list[Stream]
    seconds: float
    server_peak: dict[str, float]  # highest running, waiting, running + waiting (one scrape), cache usage

    @property
    def peak_in_flight(self) -> int:
        """Requests sent and not yet ended at one instant, client side."""
        return peak_overlap([(s.t_sent, s.t_end) for s in self.streams])

    @property
    def peak_open_streams(self) -> int:
        """Streams with their response headers in and not yet ended or closed at one instant."""
        return peak_overlap([(s.t_headers, s.t_end) for s in self.streams if s.t_headers is not None])


async def run_wave(
    target: Target,
    specs: Sequence[RequestSpec],
    plan: Sequence[tuple[int, int | None]],
    timeout: float = 900.0,
    poll_s: float = 1.0,
) -> WaveOutcome:
    """All streams of `plan` opened at once (no client-side limit), /metrics polled meanwhile."""
    peak = {"running": 0.0, "waiting": 0.0, "in_server": 0.0, "kv_cache_usage": 0.0}
    stop = asyncio.Event()

    async def poll(session: aiohttp.ClientSession) -> None:
        url = target.base_url.rstrip("/") + "/metrics"
        while not stop.is_set():
            try:
                async with session.get(url) as r:
                    m = Metrics(await r.text())
                now = {key: m.total(SERVER_COUNTS[key]) for key in ("running", "waiting", "kv_cache_usage")}
                now["in_server"] = now["running"] + now["waiting"]
                for key, v in now.items():
                    peak[key] = max(peak[key], v)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                pass  # unreachable, or no Prometheus text: this poll sees nothing, the wave goes on
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
            except asyncio.TimeoutError:
                pass

    async def one(session: aiohttp.ClientSession, i: int, p: int, k: int | None) -> Stream:
        spec = RequestSpec(i, specs[p].prompt, specs[p].max_tokens, specs[p].prompt_len)
        return await stream_tokens(session, target, spec, SOAK_PARAMS, disconnect_after=k, prompt=p)

    t0 = time.perf_counter()
    async with make_session(limit=0, timeout_s=timeout) as session, make_session(timeout_s=30) as side:
        poller = asyncio.create_task(poll(side))
        try:
            streams = await asyncio.gather(*(one(session, i, p, k) for i, (p, k) in enumerate(plan)))
        finally:
            stop.set()
            await poller
    return WaveOutcome(list(streams), time.perf_counter() - t0, peak)


def summarize_wave(
    w: WaveOutcome, refs: Sequence[Stream], max_tokens: int, tie_tol: float
) -> tuple[dict[str, int], list[dict[str, Any]], float]:
    """Verdict counts; for anything not correct, the details (first few); the largest chosen-token logprob
    difference from alone over the complete streams equal to alone."""
    counts: dict[str, int] = {}
    bad: list[dict[str, Any]] = []
    gap = 0.0
    for s in w.streams:
        ref = refs[s.prompt]
        v = judge(s, ref, max_tokens, tie_tol)
        counts[v] = counts.get(v, 0) + 1
        if v == "correct":
            gap = max(gap, logprob_gap(s, ref))
        elif v != "prefix" and len(bad) < 10:
            j = agreement(s, ref, tie_tol).step
            bad.append(
                {
                    "stream": s.index,
                    "prompt": s.prompt,
                    "verdict": v,
                    "error": s.error,
                    "finish_reason": s.finish_reason,
                    "tokens": len(s.tokens),
                    "first_divergence": j,
                    "alone_top2": ref.top[j] if j is not None and j < len(ref.top) else None,
                    "this_top2": s.top[j] if j is not None and j < len(s.top) else None,
                }
            )
    return counts, bad, gap


# ---------------------------------------------------------------------------------------------------
# A model's whole run


@dataclass
class SoakConfig:
    waves: int = 12
    concurrency: int = 256
    disconnect: float = 0.25
    prompts: int = 64
    prompt_len: str = "uniform:8-160"
    output_len: int = 32
    tie_tol: float = TIE_MARGIN_BY_DTYPE["float32"]
    rss_tol: float = 0.02
    rss_kib_per_request: float = 16.0
    seed: int = 0
    sweep: bool = True
    timeout: float = 900.0


def soak(
    base_url: str,
    model: str,
    pid: int | None,
    cfg: SoakConfig,
    log: Callable[[str], object] = print,
    cases: Sequence[Case] | None = None,
) -> dict[str, Any]:
    """The whole run against one server (see the module docstring): everything measured, and `checks`
    (name -> {"ok", "detail"}); `ok` when every check passed. `cases`: the sweep (default all)."""
    target = Target(base_url, model)
    specs = soak_prompts(cfg.prompts, cfg.prompt_len, cfg.output_len, cfg.seed)
    t0 = time.perf_counter()
    log(f"[{model}] serving {len(specs)} prompts alone ...")
    refs = asyncio.run(serve_alone(target, specs))
    alone_s = time.perf_counter() - t0
    before = wait_idle(base_url)
    rss0 = resident_memory(pid) if pid else None
    rng = random.Random(cfg.seed)
    waves: list[dict[str, Any]] = []
    checks: dict[str, tuple[bool, str]] = {}
    for k in range(cfg.waves):
        plan = wave_plan(cfg.concurrency, len(specs), cfg.disconnect, cfg.output_len, rng)
        log(f"[{model}] wave {k + 1}/{cfg.waves}: {len(plan)} streams ...")
        w = asyncio.run(run_wave(target, specs, plan, timeout=cfg.timeout))
        wave, wave_checks, before = _after_wave(k, w, plan, specs, refs, target, pid, before, cfg)
        waves.append(wave)
        checks.update(wave_checks)
        log(
            f"[{model}] wave {k + 1}: {wave['completed']} complete, {wave['disconnected']} disconnected, "
            f"{wave['verdicts']} in {w.seconds:.0f} s; pool after {wave['pool_after']}; RSS "
            + (f"{wave['rss_total'] / 2**20:.0f} MiB" if wave["rss_total"] else "-")
        )
    if pid and waves:
        checks["resident memory stable across waves"] = rss_stable(
            [w["rss_total"] for w in waves], cfg.concurrency + 1, cfg.rss_tol, cfg.rss_kib_per_request
        )
    sweep: list[dict[str, Any]] = []
    if cfg.sweep:
        log(f"[{model}] malformed-input sweep ...")
        sweep = run_sweep(base_url, model, malformed_cases(MAX_MODEL_LEN) if cases is None else cases)
        failed = [f"{r['name']}: {r['status']} {r['answer'][:120]}" for r in sweep if not r["ok"]]
        checks["malformed sweep: no 5xx, no hang, 4xx where invalid"] = (
            not failed,
            "; ".join(failed) or f"{len(sweep)} cases",
        )
    health = requests.get(base_url.rstrip("/") + "/health", timeout=30).status_code
    final = asyncio.run(serve_alone(target, [specs[0]]))[0]
    checks["healthy after: /health 200 and a request equal to its reference"] = (
        health == 200 and final.tokens == refs[0].tokens,
        f"/health {health}, request {'equal' if final.tokens == refs[0].tokens else 'DIFFERENT'}",
    )
    return {
        "model": model,
        "base_url": base_url,
        "config": asdict(cfg),
        "alone_seconds": round(alone_s, 1),
        "rss_before_waves": rss0["total"] if rss0 else None,
        "tcmalloc_by_pid": preloads(pid) if pid else None,
        "waves": waves,
        "sweep": sweep,
        "checks": {name: {"ok": ok, "detail": detail} for name, (ok, detail) in checks.items()},
        "ok": all(ok for ok, _ in checks.values()),
    }


def _after_wave(
    k: int,
    w: WaveOutcome,
    plan: Sequence[tuple[int, int | None]],
    specs: Sequence[RequestSpec],
    refs: Sequence[Stream],
    target: Target,
    pid: int | None,
    before: dict[str, float],
    cfg: SoakConfig,
) -> tuple[dict[str, Any], dict[str, tuple[bool, str]], dict[str, float]]:
    """Judge a finished wave, wait for the server to go idle, probe, read the pool and memory."""
    base_url = target.base_url
    counts, bad, gap = summarize_wave(w, refs, cfg.output_len, cfg.tie_tol)
    idle = wait_idle(base_url)
    probe_i = k % len(specs)
    probe = asyncio.run(serve_alone(target, [specs[probe_i]]))[0]
    after = server_counts(scrape(base_url))
    rss = resident_memory(pid) if pid else None
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    completed = sum(s.complete for s in w.streams)
    disconnected = sum(s.disconnected for s in w.streams)
    wave = {
        "wave": k + 1,
        "streams": len(plan),
        "planned_disconnects": sum(d is not None for _, d in plan),
        "disconnected": disconnected,
        "completed": completed,
        "verdicts": counts,
        "not_correct": bad,
        "max_logprob_gap_equal_streams": gap,
        "seconds": round(w.seconds, 1),
        "tokens_received": sum(len(s.tokens) for s in w.streams),
        "tokens_if_none_disconnected": len(plan) * cfg.output_len,
        "server_generated_tokens": delta["generation_tokens"] - len(probe.tokens),
        "server_finished_length": delta.get("finished_length", 0.0) - 1,  # less the probe
        "server_finished_error": delta.get("finished_error", 0.0),
        "server_cut_short": completed + disconnected - (delta.get("finished_length", 0.0) - 1),
        "peak_in_flight": w.peak_in_flight,
        "peak_open_streams": w.peak_open_streams,
        "server_peak": w.server_peak,
        "idle_before_probe": {key: idle[key] for key in ("running", "waiting", "kv_cache_usage")},
        "probe_prompt": probe_i,
        "probe_equal": probe.tokens == refs[probe_i].tokens,
        "pool_after": {key: after[key] for key in ("running", "waiting", "kv_cache_usage", "preemptions")},
        "rss_total": rss["total"] if rss else None,
        "rss": rss["processes"] if rss else None,
    }
    pre = f"wave {k + 1}"
    full = len(plan) - disconnected
    n_ok = counts.get("correct", 0) + counts.get("tie", 0)
    checks = {
        f"{pre}: {len(plan)} streams open at once": (
            w.peak_in_flight >= len(plan),
            f"in flight at once {w.peak_in_flight}, streaming at once {w.peak_open_streams}; in the server at "
            f"once {w.server_peak['in_server']:.0f} (peak running {w.server_peak['running']:.0f})",
        ),
        f"{pre}: every other stream complete and equal to alone": (
            n_ok == full and completed == full,
            f"{counts.get('correct', 0)} equal + {counts.get('tie', 0)} ties of {full} "
            f"(max logprob gap where equal {wave['max_logprob_gap_equal_streams']:.2e}); not correct: {bad[:3]}",
        ),
        f"{pre}: ties rare (<= 5% of complete streams)": (
            counts.get("tie", 0) <= 0.05 * max(full, 1),
            f"{counts.get('tie', 0)} of {full}",
        ),
        f"{pre}: disconnected streams received a prefix of alone": (
            counts.get("prefix-wrong", 0) == 0 and counts.get("error", 0) == 0,
            f"{counts.get('prefix', 0)} prefixes, {counts.get('prefix-tie', 0)} ties, "
            f"{counts.get('prefix-wrong', 0)} wrong, {counts.get('error', 0)} errors",
        ),
        f"{pre}: server counters agree with the streams": (
            # Every complete stream finished on the server. A disconnected one was either cut short or finished
            # before the server noticed; which, depends on how fast the server runs, so only the bounds are
            # checked: the server generated at least what the clients received and at most the whole wave.
            completed <= wave["server_finished_length"] <= completed + disconnected
            and wave["server_finished_error"] == 0
            and wave["tokens_received"] <= wave["server_generated_tokens"] <= wave["tokens_if_none_disconnected"],
            f"finished 'length' {wave['server_finished_length']:.0f} for {completed} complete + "
            f"{disconnected} disconnected ({wave['server_cut_short']:.0f} cut short); generated "
            f"{wave['server_generated_tokens']:.0f} tokens of {wave['tokens_if_none_disconnected']} without "
            f"disconnects ({wave['tokens_received']} received)",
        ),
        f"{pre}: pool empty, nothing running or waiting": (
            after["kv_cache_usage"] == 0 and after["running"] == 0 and after["waiting"] == 0,
            json.dumps(wave["pool_after"]),
        ),
        f"{pre}: probe alone equals its reference": (wave["probe_equal"], f"prompt {probe_i}"),
    }
    return wave, checks, after


def format_report(r: dict[str, Any]) -> str:
    """The per-wave table, the sweep's status counts and the checks."""
    c = r["config"]
    lines = [
        f"== {r['model']}: {c['concurrency']} streams per wave, {c['disconnect']:.0%} disconnecting, "
        f"{c['output_len']} tokens, {c['prompts']} prompts (alone: {r['alone_seconds']:.0f} s) =="
    ]
    cols = ["wave", "streams", "in flight", "discon", "complete", "equal", "ties", "bad", "in vLLM/run"]
    cols += ["pool after", "gen tokens", "RSS MiB", "s"]
    lines.append("  ".join(f"{h:>10}" for h in cols))
    for w in r["waves"]:
        v, pool = w["verdicts"], w["pool_after"]
        empty = pool["kv_cache_usage"] == 0 and pool["running"] == 0 and pool["waiting"] == 0
        row = [
            w["wave"],
            w["streams"],
            w["peak_in_flight"],
            w["disconnected"],
            w["completed"],
            v.get("correct", 0),
            v.get("tie", 0),
            sum(v.get(x, 0) for x in ("wrong", "incomplete", "error", "prefix-wrong")),
            f"{w['server_peak']['in_server']:.0f}/{w['server_peak']['running']:.0f}",
            "empty" if empty else f"{pool['kv_cache_usage']:.4f}",
            f"{w['server_generated_tokens']:.0f}/{w['tokens_if_none_disconnected']}",
            f"{w['rss_total'] / 2**20:.0f}" if w["rss_total"] else "-",
            f"{w['seconds']:.0f}",
        ]
        lines.append("  ".join(f"{x!s:>10}" for x in row))
    if r["rss_before_waves"]:
        tc = r["tcmalloc_by_pid"] or {}
        lines.append(
            f"RSS before the waves: {r['rss_before_waves'] / 2**20:.0f} MiB; tcmalloc in {sum(tc.values())} of "
            f"{len(tc)} server processes"
        )
    if r["sweep"]:
        by_status: dict[str, int] = {}
        for s in r["sweep"]:
            key = str(s["status"]) + (f" (stream error {s['stream_error_code']})" if s.get("stream_error_code") else "")
            by_status[key] = by_status.get(key, 0) + 1
        lines.append(f"sweep: {len(r['sweep'])} cases; answers {dict(sorted(by_status.items()))}")
        accepted = [s["name"] for s in r["sweep"] if s["status"] == 200 and not s.get("stream_error_code")]
        if accepted:
            lines.append(f"  answered 200 (vLLM accepts these, see Case.note): {', '.join(accepted)}")
    groups: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, ch in r["checks"].items():  # "wave k: what" checks grouped over the waves
        wave, sep, what = name.partition(": ")
        key = what if sep and wave.startswith("wave ") else name
        groups.setdefault(key, []).append((wave if key != name else "", ch))
    for key, items in groups.items():
        bad = [(w, ch) for w, ch in items if not ch["ok"]]
        w, ch = bad[0] if bad else items[-1]
        where = f" ({len(items) - len(bad)}/{len(items)} waves; {w})" if len(items) > 1 or w else ""
        lines.append(f"  [{'FAIL' if bad else 'ok'}] {key}{where}: {ch['detail'][:240]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="demo models to serve (default: both)")
    p.add_argument("--base-url", help="soak a server already running instead (with --model, --pid)")
    p.add_argument("--model", help="model name at --base-url (default: its first)")
    p.add_argument("--pid", type=int, help="the server's process id, for resident memory (with --base-url)")
    p.add_argument("--waves", type=int, default=SoakConfig.waves)
    p.add_argument("--concurrency", type=int, default=SoakConfig.concurrency, help="streams opened at once per wave")
    p.add_argument("--disconnect", type=float, default=SoakConfig.disconnect, help="share of streams disconnecting")
    p.add_argument("--prompts", type=int, default=SoakConfig.prompts, help="distinct prompts (each also served alone)")
    p.add_argument("--prompt-len", default=SoakConfig.prompt_len, help="N | uniform:LO-HI (tokens)")
    p.add_argument("--output-len", type=int, default=SoakConfig.output_len)
    p.add_argument("--tie-tol", type=float, help="top-2 logprob gap counted as a tie (default: by --dtype)")
    p.add_argument("--rss-tol", type=float, default=SoakConfig.rss_tol, help="relative, after the warm-up half")
    p.add_argument("--rss-kib-per-request", type=float, default=SoakConfig.rss_kib_per_request)
    p.add_argument(
        "--malloc",
        choices=sorted(ALLOCATORS),
        default="tcmalloc",
        help="the server's allocator: 'tcmalloc' (default; vllm-trn serve preloads it when installed, else "
        "glibc), 'glibc' (as is: it keeps freed heap memory, RSS grows), 'glibc-return' (glibc handing freed "
        "memory back: MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ 64 KiB)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(TIE_MARGIN_BY_DTYPE),
        help="served dtype (--dtype to vLLM, which on CPU serves bf16 unless told); default float32",
    )
    p.add_argument("--serve-args", default="", help="extra `vllm serve` options, one string")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/vllm-trn-soak", help="checkpoints and server logs")
    p.add_argument("--out", default="soak-out/soak.json")
    return p


def _first_model(base_url: str) -> str:
    url = base_url.rstrip("/") + "/v1/models"
    r = requests.get(url, timeout=30)
    r.raise_for_status()
    return model_id(url, r.text)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    cfg = SoakConfig(
        waves=a.waves,
        concurrency=a.concurrency,
        disconnect=a.disconnect,
        prompts=a.prompts,
        prompt_len=a.prompt_len,
        output_len=a.output_len,
        tie_tol=a.tie_tol if a.tie_tol is not None else TIE_MARGIN_BY_DTYPE[a.dtype],
        rss_tol=a.rss_tol,
        rss_kib_per_request=a.rss_kib_per_request,
        seed=a.seed,
        sweep=not a.no_sweep,
    )
    results = []
    t_start = time.time()
    if a.base_url:
        results.append(soak(a.base_url, a.model or _first_model(a.base_url), a.pid, cfg))
    else:
        for name in a.models.split(","):
            t0 = time.time()
            extra = ["--max-model-len", str(MAX_MODEL_LEN), *a.serve_args.split()]
            # the soak's pool, unless the user sized the cache (asked of vLLM's parser only when given options)
            if not a.serve_args.strip() or not cache_budget_given(["model", *a.serve_args.split()]):
                extra += ["--kv-cache-memory-bytes", str(POOL_BYTES[name])]
            env = ALLOCATORS[a.malloc]
            with serve_new_demo(name, Path(a.work), a.dtype, extra=extra, env=env) as server:
                server.wait_healthy()
                print(f"[{name}] server up in {time.time() - t0:.0f} s at {server.url}", flush=True)
                r = soak(server.url, server.model, server.proc.pid, cfg)
                r["server_cmd"] = server.cmd
                r["server_env"] = env
                r["server_alive_at_end"] = server.proc.poll() is None
            results.append(r)
            print(format_report(r), flush=True)
    payload = {"argv": sys.argv[1:] if argv is None else argv, "seconds": round(time.time() - t_start)}
    payload["results"] = results
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    if a.base_url:
        print(format_report(results[0]))
    ok = all(r["ok"] for r in results)
    print(f"{'PASS' if ok else 'FAIL'}: {len(results)} model(s) in {payload['seconds']} s; JSON in {out}")
    return 0 if ok else 1
