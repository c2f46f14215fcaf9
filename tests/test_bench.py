"""`vllm-trn bench`: statistics on hand-made samples and against numpy, the /metrics reader, the arrival processes
and length distributions, the load driver against a scripted streaming server (exact concurrency, batches,
side-by-side order), the bench, the soak's wave and the malformed-input sweep against a server sending malformed
events (each such request fails with its message, the rest is measured and written), one end-to-end sweep against
the session's real `vllm-trn serve` of the demo Laplace checkpoint whose results `vllm bench sweep plot` draws, and
the trn2 recipes (flags, buckets, and how the replicas share an instance's NeuronCores)."""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import os
import random
import shlex
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import TRN2, trn2_recipe_argv
from vllm_trn_plugin.bench import build_parser, run_bench
from vllm_trn_plugin.bench.client import RequestResult, Target
from vllm_trn_plugin.bench.local import vllm_trn_command
from vllm_trn_plugin.bench.metrics import Metrics
from vllm_trn_plugin.bench.report import describe, ratios, summarize
from vllm_trn_plugin.bench.runner import Load, run_point
from vllm_trn_plugin.bench.workload import (
    LengthDist,
    dataset_requests,
    fixed_batches,
    poisson_arrivals,
    random_requests,
)

# ---------------------------------------------------------------------------------------------------
# Statistics


def test_describe_on_hand_made_samples() -> None:
    # Percentiles interpolate linearly between order statistics at rank (n - 1) p / 100 (vllm bench serve's rule).
    d = describe([40, 15, 50, 35, 20], percentiles=(0, 50, 90, 99, 100))
    assert (d["n"], d["min"], d["max"], d["p0"], d["p50"], d["p100"]) == (5, 15, 50, 15, 35, 50)
    assert d["p90"] == pytest.approx(40 + 0.6 * 10) and d["p99"] == pytest.approx(40 + 0.96 * 10)
    assert d["mean"] == 32 and d["std"] == pytest.approx((830 / 5) ** 0.5)  # population std (ddof 0)
    one = describe([7.5])
    assert one["std"] == 0 and one["p50"] == one["p99"] == one["mean"] == 7.5
    empty = describe([])
    assert empty["n"] == 0 and all(v != v for k, v in empty.items() if k != "n")  # NaN: nothing measured


def test_metrics_reader_sums_series_over_engines() -> None:
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 10.0
vllm:request_success_total{engine="1",finished_reason="length",model_name="m"} 4.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 1.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 2.5
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 3.0
"""
    m = Metrics(text)
    assert m.total("vllm:num_requests_running") == 5
    assert m.by_label("vllm:request_success_total", "finished_reason") == {"length": 14, "abort": 1}
    assert m.total("vllm:e2e_request_latency_seconds_sum") == 2.5
    assert m.total("vllm:e2e_request_latency_seconds_count") == 3
    assert m.total("vllm:num_requests_waiting") == 0  # absent


def test_summary_of_synthetic_timings_equals_numpy() -> None:
    rng = np.random.default_rng(0)
    results, ttft, tpot, itl, e2e, out_tok = [], [], [], [], [], 0
    for i in range(40):
        n_out = int(rng.integers(1, 30))
        t_first = float(rng.uniform(0.01, 0.5))
        gaps = rng.exponential(0.02, n_out - 1).tolist()
        lat = t_first + sum(gaps)
        r = RequestResult(i, "A", ok=True, ttft=t_first, latency=lat, itl=gaps, chunks=n_out, output_tokens=n_out)
        r.prompt_tokens = 10
        results.append(r)
        ttft.append(t_first * 1e3)
        e2e.append(lat * 1e3)
        itl += [g * 1e3 for g in gaps]
        if n_out > 1:
            tpot.append((lat - t_first) / (n_out - 1) * 1e3)
        out_tok += n_out
    results.append(RequestResult(40, "A", ok=False, error="HTTP 400: bad"))
    s = summarize(results, duration_s=8.0)
    assert (s["requests"], s["completed"], s["failed"]) == (41, 40, 1)
    assert s["errors"] == {"HTTP 400: bad": 1}
    assert s["output_tokens"] == out_tok and s["input_tokens"] == 400
    assert s["output_throughput"] == pytest.approx(out_tok / 8.0)
    assert s["request_throughput"] == pytest.approx(40 / 8.0)
    assert s["total_token_throughput"] == pytest.approx((out_tok + 400) / 8.0)
    for key, ref in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2el_ms", e2e)):
        assert s[key]["n"] == len(ref)
        assert s[key]["mean"] == pytest.approx(np.mean(ref), rel=1e-9)
        assert s[key]["std"] == pytest.approx(np.std(ref), rel=1e-9)
        for p in (50, 90, 95, 99):
            assert s[key][f"p{p}"] == pytest.approx(np.percentile(ref, p), rel=1e-9)
    # B twice as slow, same counts: throughput ratio 1/2, every latency ratio 2.
    slow = [
        RequestResult(r.index, "B", r.ok, r.error, 0, 2 * r.ttft, 2 * r.latency, [2 * g for g in r.itl], r.chunks)
        for r in results
    ]
    for r, orig in zip(slow, results):
        r.output_tokens, r.prompt_tokens = orig.output_tokens, orig.prompt_tokens
    q = ratios(summarize(slow, 16.0), s)
    assert q["output_throughput"] == pytest.approx(0.5) and q["request_throughput"] == pytest.approx(0.5)
    assert all(v == pytest.approx(2.0) for k, v in q.items() if k.endswith(("_p50", "_p99", "_mean")))


# ---------------------------------------------------------------------------------------------------
# Arrivals and lengths


def test_poisson_arrivals_have_the_rate_and_poisson_counts() -> None:
    rate, n = 4.0, 40000
    for exact in (False, True):
        t = np.array(poisson_arrivals(n, rate, random.Random(1), exact_total=exact))
        gaps = np.diff(t, prepend=0.0)
        assert np.all(gaps >= 0)
        se = (1 / rate) / np.sqrt(n)
        assert abs(gaps.mean() - 1 / rate) < (1e-12 if exact else 4 * se)  # mean rate (exact: by construction)
        assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)  # exponential gaps: CV 1
        counts = np.bincount(t.astype(int))[:-1]  # arrivals per whole second
        assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.1)  # Poisson counts: dispersion 1
    assert poisson_arrivals(n, rate, random.Random(1))[-1] == pytest.approx(n / rate)
    g = np.diff(poisson_arrivals(n, rate, random.Random(2), burstiness=4.0, exact_total=False))
    assert abs(g.mean() - 1 / rate) < 4 * se / 2
    assert g.std() / g.mean() == pytest.approx(0.5, abs=0.02)  # Gamma(4): CV 1/sqrt(4)
    assert poisson_arrivals(5, float("inf"), random.Random(0)) == [0.0] * 5


def test_fixed_batches() -> None:
    assert fixed_batches(10, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert fixed_batches(3, 8) == [[0, 1, 2]]
    assert sum(fixed_batches(1000, 7), []) == list(range(1000))
    with pytest.raises(ValueError):
        fixed_batches(3, 0)


def test_length_distributions(tmp_path: Path) -> None:
    rng = random.Random(0)
    assert LengthDist.parse("96").sample(3, rng) == [96, 96, 96] == LengthDist.parse("fixed:96").sample(3, rng)
    u = np.array(LengthDist.parse("uniform:10-20").sample(30000, rng))
    assert u.min() == 10 and u.max() == 20 and set(u.tolist()) == set(range(10, 21))
    assert u.mean() == pytest.approx(15.0, abs=0.1)
    assert np.bincount(u)[10:].min() > 30000 / 11 * 0.9  # every value about equally likely
    f = tmp_path / "lens.txt"
    f.write_text("5 5 5 40\n")
    s = np.array(LengthDist.parse(f"file:{f}").sample(20000, rng))
    assert set(s.tolist()) == {5, 40} and (s == 40).mean() == pytest.approx(0.25, abs=0.02)
    (tmp_path / "lens.json").write_text("[7, 9]")
    assert set(LengthDist.parse(f"file:{tmp_path / 'lens.json'}").sample(100, rng)) == {7, 9}
    for bad in ["uniform:5", "uniform:9-3", "0", "gauss:3"]:
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_requests_have_the_drawn_lengths(tmp_path: Path) -> None:
    reqs = random_requests(50, LengthDist.parse("uniform:3-9"), LengthDist.parse("uniform:1-4"), seed=3)
    assert all(3 <= len(r.prompt) == r.prompt_len <= 9 and 1 <= r.max_tokens <= 4 for r in reqs)
    assert all(0 <= t < 256 for r in reqs for t in r.prompt)
    again = random_requests(50, LengthDist.parse("uniform:3-9"), LengthDist.parse("uniform:1-4"), seed=3)
    assert [r.prompt for r in reqs] == [r.prompt for r in again]  # reproducible from the seed
    text = random_requests(4, LengthDist.parse("6"), LengthDist.parse("2"), text=True)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 6 for r in text)
    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": "hi there", "output_tokens": 3}\n{"prompt": [1, 2, 3], "output_tokens": 5}\n')
    rows = dataset_requests(ds, 5)
    assert [(r.prompt, r.max_tokens, r.prompt_len) for r in rows[:2]] == [("hi there", 3, None), ([1, 2, 3], 5, 3)]
    assert rows[4].prompt == "hi there" and dataset_requests(ds, 2, LengthDist.parse("9"))[1].max_tokens == 9


# ---------------------------------------------------------------------------------------------------
# The load driver against a scripted streaming server: what was in flight when.


class ScriptedServer:
    """An OpenAI-style streaming completions server: `max_tokens` chunks, `gap` s apart; records every
    request's (model, prompt, start, end) and the most requests in flight per model."""

    def __init__(self, gap: float = 0.01) -> None:
        from aiohttp import web

        self.gap, self.log, self.inflight, self.peak = gap, [], {}, {}
        app = web.Application()
        self.routes(app)
        self.runner = web.AppRunner(app)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        started.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def routes(self, app) -> None:  # noqa: ANN001
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)

    async def models(self, request):  # noqa: ANN001, ANN201
        from aiohttp import web

        return web.json_response({"data": [{"id": "scripted"}]})

    async def completions(self, request):  # noqa: ANN001, ANN201
        from aiohttp import web

        body = await request.json()
        model, start = body["model"], time.perf_counter()
        self.inflight[model] = self.inflight.get(model, 0) + 1
        self.peak[model] = max(self.peak.get(model, 0), self.inflight[model])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for _ in range(n):
            await asyncio.sleep(self.gap)
            await resp.write(b'data: {"choices": [{"index": 0, "text": "x", "finish_reason": null}]}\n\n')
        # Logged before the last bytes go out: the client may be done as soon as it reads [DONE].
        self.inflight[model] -= 1
        self.log.append((model, body["prompt"][0], start, time.perf_counter()))
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def scripted():  # noqa: ANN201
    s = ScriptedServer()
    yield s
    s.close()


def _specs(n: int, out: int = 4):  # noqa: ANN202
    reqs = random_requests(n, LengthDist.parse("5"), LengthDist.parse(str(out)), seed=0)
    for r in reqs:
        r.prompt[0] = r.index  # the server logs which request it served
    return reqs


def _open_at(rs: list[RequestResult], t: float) -> int:
    """Requests the client had sent and not yet seen end at time t (a request counts at its own start)."""
    return sum(r.start <= t < r.start + r.latency for r in rs)


def test_concurrency_mode_keeps_exactly_c_in_flight(scripted: ScriptedServer) -> None:
    scripted.log.clear(), scripted.peak.clear()
    target = Target(scripted.url, "conc")
    res = asyncio.run(run_point([target], _specs(12), Load("concurrency", 3), {}, progress=False))
    rs = res.results["A"]
    assert len(rs) == 12 and all(r.ok for r in rs)
    # Client side, whatever the machine's speed: the first 3 go out together and none goes out while 3 are open.
    assert max(_open_at(rs, r.start) for r in rs) == 3 and scripted.peak["conc"] <= 3
    assert all(r.chunks == 4 and r.output_tokens == 4 and r.prompt_tokens == 5 and len(r.itl) == 3 for r in rs)
    assert all(r.ttft >= scripted.gap * 0.9 and r.latency >= 4 * scripted.gap * 0.9 for r in rs)


def test_batch_mode_waits_for_the_whole_batch(scripted: ScriptedServer) -> None:
    scripted.log.clear(), scripted.peak.clear()
    target = Target(scripted.url, "batch")
    asyncio.run(run_point([target], _specs(10), Load("batch", 4), {}, progress=False))
    spans = {idx: (s, e) for _, idx, s, e in scripted.log}
    assert scripted.peak["batch"] <= 4
    for prev, nxt in ([0, 1, 2, 3], [4, 5, 6, 7]), ([4, 5, 6, 7], [8, 9]):
        assert min(spans[i][0] for i in nxt) >= max(spans[i][1] for i in prev)


def test_rate_mode_spreads_the_arrivals(scripted: ScriptedServer) -> None:
    scripted.log.clear()
    load = Load("rate", 10.0)
    res = asyncio.run(run_point([Target(scripted.url, "rate")], _specs(20, 1), load, {}, seed=5, progress=False))
    starts = [r.start for r in res.results["A"]]
    expected = poisson_arrivals(20, 10.0, random.Random(5))
    assert expected[-1] == pytest.approx(2.0)
    late = np.array(starts) - np.array(expected)
    # Never early (how late depends on how busy the machine is, so it is not asserted), in schedule order.
    assert late.min() > -0.005 and starts == sorted(starts)
    assert res.durations["A"] >= expected[-1]


def test_side_by_side_pairs_and_blocks(scripted: ScriptedServer) -> None:
    a, b = Target(scripted.url, "ma", label="A"), Target(scripted.url, "mb", label="B")
    scripted.log.clear(), scripted.peak.clear()
    res = asyncio.run(run_point([a, b], _specs(8), Load("concurrency", 2), {}, progress=False))
    assert [r.index for r in res.results["A"]] == [r.index for r in res.results["B"]] == list(range(8))
    assert scripted.peak == {"ma": 2, "mb": 2}  # each endpoint under the same load, at the same time
    spans = {m: [(s, e) for mm, _, s, e in scripted.log if mm == m] for m in ("ma", "mb")}
    assert any(s1 < e2 and s2 < e1 for s1, e1 in spans["ma"] for s2, e2 in spans["mb"])  # served together
    scripted.log.clear()
    res = asyncio.run(
        run_point([a, b], _specs(8), Load("concurrency", 2), {}, interleave="blocks", block_size=2, progress=False)
    )
    order = [m for m, *_ in sorted(scripted.log, key=lambda x: x[2])]
    blocks = [order[i] for i in range(0, 16, 2)]
    assert blocks == ["ma", "mb", "mb", "ma", "ma", "mb", "mb", "ma"]  # A B B A ...
    assert all(len(v) == 8 and all(r.ok for r in v) for v in res.results.values())


def test_failed_requests_are_counted_not_raised(scripted: ScriptedServer) -> None:
    dead = Target("http://127.0.0.1:9", "x")  # nothing listens on the discard port
    res = asyncio.run(run_point([dead], _specs(3), Load("concurrency", 3), {}, progress=False, timeout_s=5))
    s = summarize(res.results["A"], res.durations["A"])
    assert (s["completed"], s["failed"]) == (0, 3) and s["errors"]


# ---------------------------------------------------------------------------------------------------
# A server that answers some requests with malformed events: those requests fail with a clear message,
# the others are measured, and the load point (or the soak's wave) completes and is written.

# Each: the `data:` payload sent after one well-formed chunk, and what the request's error must say.
BAD_EVENTS: dict[str, tuple[bytes, str]] = {
    "array": (b"[1, 2, 3]", "event is an array ([1, 2, 3]), expected an object"),
    "number": (b"5", "event is a number (5), expected an object"),
    "string": (b'"x"', 'event is a string ("x"), expected an object'),
    "null": (b"null", "event is null, expected an object"),
    "not-json": (b"{oops", "event is not JSON"),
    "deep": (b"[" * 20000 + b"]" * 20000, "event nested too deeply"),
    "choices-number": (b'{"choices": 5}', "choices is a number (5), expected an array"),
    "choice-string": (b'{"choices": ["x"]}', 'choices[0] is a string ("x"), expected an object'),
    "finish-number": (b'{"choices": [{"index": 0, "finish_reason": 3}]}', "choices[0].finish_reason is a number"),
    "usage-array": (b'{"choices": [], "usage": [1]}', "usage is an array ([1]), expected an object"),
    "usage-count-array": (
        b'{"choices": [], "usage": {"completion_tokens": [3]}}',
        "usage.completion_tokens is an array ([3]), expected a non-negative integer",
    ),
    "usage-count-negative": (b'{"choices": [], "usage": {"completion_tokens": -2}}', "usage.completion_tokens is -2"),
}
COMPLETIONS_BAD = {
    "text-number": (b'{"choices": [{"index": 0, "text": 7}]}', "choices[0].text is a number (7), expected a string"),
}
CHAT_BAD = {
    "delta-array": (b'{"choices": [{"index": 0, "delta": [1]}]}', "choices[0].delta is an array ([1]), expected an"),
    "content-number": (b'{"choices": [{"delta": {"content": 7}}]}', "choices[0].delta.content is a number (7)"),
}
SOAK_BAD = {
    "logprobs-array": (
        b'{"choices": [{"index": 0, "text": "x", "logprobs": [1]}]}',
        "choices[0].logprobs is an array ([1]), expected an object",
    ),
    "token-number": (
        b'{"choices": [{"text": "x", "logprobs": {"tokens": [5]}}]}',
        "choices[0].logprobs.tokens[0] is a number (5), expected a string",
    ),
    "top-string": (
        b'{"choices": [{"text": "x", "logprobs": {"tokens": ["token_id:7"], "top_logprobs": ["x"]}}]}',
        'choices[0].logprobs.top_logprobs[0] is a string ("x"), expected an object',
    ),
    "top-value-string": (
        b'{"choices": [{"text": "x", "logprobs": {"tokens": ["token_id:7"], "top_logprobs": [{"token_id:7": "a"}]}}]}',
        'is a string ("a"), expected a number',
    ),
}


# An event that mentions "error" but is no object (for the malformed-input sweep's reader).
SWEEP_BAD = {"error-array": (b'["error"]', "")}


class MalformedServer(ScriptedServer):
    """Completions and chat, streamed: a request whose prompt (or last message) names an event of BAD_EVENTS,
    COMPLETIONS_BAD, CHAT_BAD or SOAK_BAD gets that event after its first chunk, then the rest of a well-formed
    stream ([DONE] included); any other prompt gets a well-formed stream of `max_tokens` chunks, each one token
    (id 7) with its top-2 logprobs. /metrics answers something that is no Prometheus text, /broken/v1/models a
    JSON array."""

    TOKEN = {"tokens": ["token_id:7"], "top_logprobs": [{"token_id:7": -0.25, "token_id:8": -2.0}]}

    def routes(self, app) -> None:  # noqa: ANN001
        super().routes(app)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/broken/v1/models", self.broken_models)

    async def metrics(self, request):  # noqa: ANN001, ANN201
        from aiohttp import web

        return web.Response(text="<html>busy</html>")

    async def broken_models(self, request):  # noqa: ANN001, ANN201
        from aiohttp import web

        return web.json_response([1, 2])

    async def completions(self, request):  # noqa: ANN001, ANN201
        body = await request.json()
        return await self._stream(request, body, body["prompt"], chat=False)

    async def chat(self, request):  # noqa: ANN001, ANN201
        body = await request.json()
        return await self._stream(request, body, body["messages"][-1]["content"], chat=True)

    async def _stream(self, request, body: dict, name: str, chat: bool):  # noqa: ANN001, ANN202
        from aiohttp import web

        bad = (BAD_EVENTS | COMPLETIONS_BAD | CHAT_BAD | SOAK_BAD | SWEEP_BAD).get(name)
        n = body["max_tokens"]
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}] if chat else []
        for k in range(n):
            finish = "length" if k == n - 1 else None
            if chat:
                events.append({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": finish}]})
            else:
                choice = {"index": 0, "text": "x", "logprobs": self.TOKEN, "finish_reason": finish}
                events.append({"choices": [choice]})
        events.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
        lines = [json.dumps(e).encode() for e in events]
        if bad is not None:
            lines.insert(2 if chat else 1, bad[0])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for line in [*lines, b"[DONE]"]:
                await resp.write(b"data: " + line + b"\n\n")
        except ConnectionResetError:  # the client gave up at the bad event
            pass
        return resp


@pytest.fixture(scope="module")
def malformed():  # noqa: ANN201
    s = MalformedServer()
    yield s
    s.close()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_malformed_events_fail_their_request_not_the_run(
    malformed: MalformedServer, tmp_path: Path, endpoint: str
) -> None:
    bad = BAD_EVENTS | (CHAT_BAD if endpoint == "chat" else COMPLETIONS_BAD)
    # The first row is well-formed: the warm-up request uses it. Good and bad requests alternate.
    names = [n for name in bad for n in (f"good-{name}", name)]
    ds = tmp_path / "prompts.jsonl"
    ds.write_text("".join(json.dumps({"prompt": n, "output_tokens": 4}) + "\n" for n in names))
    out = tmp_path / "bench"
    args = build_parser().parse_args(
        ["--base-url", malformed.url, "--model", "m", "--endpoint", endpoint, "--dataset", str(ds)]
        + ["--num-requests", str(len(names)), "--concurrency", "4", "--out", str(out), "--no-plots", "--no-progress"]
    )
    payload = run_bench(args)
    (point,) = payload["points"]
    assert (point["summary"]["completed"], point["summary"]["failed"]) == (len(bad), len(bad))
    rows = list(csv.DictReader(open(out / "requests.csv")))
    assert [int(r["index"]) for r in rows] == list(range(len(names)))
    for r, name in zip(rows, names):
        if name.startswith("good-"):
            assert (r["ok"], r["output_tokens"], r["chunks"], r["error"]) == ("1", "4", "4", ""), (name, r)
            assert float(r["ttft_ms"]) > 0 and float(r["e2el_ms"]) >= float(r["ttft_ms"])
        else:
            assert r["ok"] == "0" and r["error"].startswith("bad response: "), (name, r)
            assert bad[name][1] in r["error"], (name, r["error"])
    assert json.loads((out / "summary.json").read_text())[0]["completed"] == len(bad)
    assert (out / "bench.json").exists() and (out / "summary.csv").exists()


def test_bad_model_listing_is_a_clear_error(malformed: MalformedServer) -> None:
    from vllm_trn_plugin.bench.client import BadResponse
    from vllm_trn_plugin.bench.soak import _first_model

    url = malformed.url + "/broken"
    args = build_parser().parse_args(["--base-url", url, "--no-plots", "--no-progress", "--num-requests", "1"])
    with pytest.raises(BadResponse, match=r"/broken/v1/models: .*\[1, 2\]"):
        run_bench(args)
    with pytest.raises(BadResponse, match=r"/broken/v1/models: .*\[1, 2\]"):
        _first_model(url)


def test_soak_wave_survives_malformed_events(malformed: MalformedServer) -> None:
    from vllm_trn_plugin.bench import soak
    from vllm_trn_plugin.bench.workload import RequestSpec

    bad = BAD_EVENTS | SOAK_BAD  # (the soak reads token ids from `logprobs`, not `text`)
    names = ["good", *bad]
    specs = [RequestSpec(i, name, 4) for i, name in enumerate(names)]
    plan = [(p, None) for p in range(len(names))] * 2  # every prompt twice, all streams at once
    target = Target(malformed.url, "m")
    # /metrics answers no Prometheus text: the poll sees nothing, the wave still runs.
    w = asyncio.run(soak.run_wave(target, specs, plan, timeout=60, poll_s=0.05))
    assert [s.prompt for s in w.streams] == [p for p, _ in plan]
    for s in w.streams:
        if names[s.prompt] == "good":
            assert s.complete and s.tokens == [7] * 4 and s.usage_tokens == 4 and s.finish_reason == "length", s
            assert s.top == [{7: -0.25, 8: -2.0}] * 4
        else:
            assert not s.complete and s.error.startswith("bad response: "), (names[s.prompt], s)
            assert bad[names[s.prompt]][1] in s.error, (names[s.prompt], s.error)
    (ref,) = asyncio.run(soak.serve_alone(target, specs[:1]))
    counts, details, _ = soak.summarize_wave(w, [ref] * len(names), 4, 0.0)
    assert counts == {"correct": 2, "error": 2 * len(bad)}
    assert all(d["verdict"] == "error" and d["error"].startswith("bad response: ") for d in details)


def test_sweep_reads_a_malformed_error_event_as_a_server_error(malformed: MalformedServer) -> None:
    from vllm_trn_plugin.bench.malformed import Case, run_sweep

    # An event that mentions "error" but is no object: the sweep records a server error, it does not raise.
    cases = [Case("x", "/v1/completions", {"prompt": "error-array", "max_tokens": 2}, expect="not5xx")]
    (res,) = run_sweep(malformed.url, "m", cases, timeout=30)
    assert res["status"] == 200 and res["stream_error_code"] == 500 and not res["ok"]


# ---------------------------------------------------------------------------------------------------
# End to end against the real server


@pytest.mark.vllm
def test_sweep_against_vllm_serve(servers, tmp_path: Path) -> None:  # noqa: ANN001
    server = servers.get("laplace")
    out = tmp_path / "bench"
    args = build_parser().parse_args(
        ["--base-url", server.url, "--concurrency", "1,4", "--num-requests", "8", "--prompt-len", "uniform:16-48"]
        + ["--output-len", "12", "--out", str(out), "--no-progress", "--seed", "7"]
    )
    payload = run_bench(args)
    pts = payload["points"]
    assert [p["load"] for p in pts] == ["concurrency 1", "concurrency 4"]
    for p in pts:
        s = p["summary"]
        assert (s["completed"], s["failed"]) == (8, 0), s["errors"]
        assert s["output_tokens"] == 8 * 12  # ignore_eos: exact lengths, counted by the server
        # How many chunks the tokens came in depends on how fast the client reads (vLLM merges what it has not
        # sent yet), so only their bookkeeping is asserted: one inter-token gap per chunk after the first.
        assert s["mean_chunks_per_request"] >= 1
        assert 0 < s["ttft_ms"]["p50"] <= s["e2el_ms"]["p50"] and 0 < s["tpot_ms"]["p50"] < s["e2el_ms"]["p50"]
        assert s["itl_ms"]["n"] == round(8 * (s["mean_chunks_per_request"] - 1)) and s["itl_ms"]["min"] >= 0
        assert s["output_throughput"] == pytest.approx(s["output_tokens"] / s["duration_s"])
    rows = list(csv.DictReader(open(out / "requests.csv")))
    lens = [len(r.prompt) for r in random_requests(8, LengthDist.parse("uniform:16-48"), LengthDist.parse("12"), 7)]
    assert [int(r["prompt_tokens"]) for r in rows[:8]] == lens  # the server saw the prompts we meant
    assert all(int(r["output_tokens"]) == 12 and r["ok"] == "1" for r in rows)
    for r in rows:  # a request's E2E latency is its TTFT plus its inter-token gaps
        e2e = float(r["ttft_ms"]) + float(r["mean_itl_ms"]) * (int(r["chunks"]) - 1)
        assert float(r["e2el_ms"]) == pytest.approx(e2e, rel=1e-3, abs=0.05)
    bench = json.loads((out / "bench.json").read_text())
    assert bench["config"]["targets"][0]["model"] == server.model
    assert len(list(csv.DictReader(open(out / "summary.csv")))) == 2
    for png in ("latency.png", "e2e_latency.png", "throughput.png", "requests.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # summary.json: one `vllm bench serve` result per point, its statistics those of the per-request rows.
    records = json.loads((out / "summary.json").read_text())
    assert [(r["max_concurrency"], r["request_rate"], r["target"]) for r in records] == [
        (1, "inf", "A"),
        (4, "inf", "A"),
    ]
    for k, rec in enumerate(records):
        ttft = [float(r["ttft_ms"]) for r in rows[8 * k : 8 * k + 8]]
        e2e = [float(r["e2el_ms"]) for r in rows[8 * k : 8 * k + 8]]
        assert rec["median_ttft_ms"] == pytest.approx(np.median(ttft), abs=1e-3)
        assert rec["p99_e2el_ms"] == pytest.approx(np.percentile(e2e, 99), abs=1e-3)
        assert (rec["completed"], rec["total_output_tokens"]) == (8, 96)
    # ... which vLLM's own `sweep plot` reads and draws (through `vllm-trn vllm`, as on the CPU build).
    plot = [vllm_trn_command(), "vllm", "bench", "sweep", "plot", str(out), "--var-x", "max_concurrency"]
    plot += ["--var-y", "median_ttft_ms", "--curve-by", "target", "--fig-name", "ttft", "--fig-dpi", "50"]
    done = subprocess.run(plot, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (out / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------------
# The trn2 recipes: every flag exists in `vllm serve` and the numbers obey vllm-neuron's bucket rules


TRN2_CORES = 64  # logical NeuronCores of a trn2.48xlarge: 16 Trainium2 chips x 4 at LNC=2


def trn2_instance_plan(model: str, log_dir: Path, root: Path = TRN2) -> tuple[list[list[int]], list[str], list[str]]:
    """What `launch-instance.sh MODEL CKPT --dry-run` (in `root`) starts: the NeuronCores of each replica
    (NEURON_RT_VISIBLE_CORES), each replica's URL, and the URLs the router sends to."""
    env = {k: v for k, v in os.environ.items() if k not in ("REPLICAS", "NEURON_CORES", "BASE_PORT")}
    printed = subprocess.run(
        [str(root / "launch-instance.sh"), model, "/models/x", "--dry-run"],
        env={**env, "LOG_DIR": str(log_dir)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cores, urls, router = [], [], []
    for words in map(shlex.split, printed.splitlines()):
        if words[:1] == ["env"]:
            assert model in words, words  # a replica of this model
            opts = dict(w.split("=", 1) for w in words[1:] if "=" in w)
            lo, _, hi = opts["NEURON_RT_VISIBLE_CORES"].partition("-")
            cores.append(list(range(int(lo), int(hi or lo) + 1)))
            urls.append(f"http://127.0.0.1:{opts['PORT']}")
        elif words[:1] == ["vllm-router"]:
            i = words.index("--worker-urls") + 1
            router = list(itertools.takewhile(lambda w: not w.startswith("--"), words[i:]))
    return cores, urls, router


def trn2_k8s_engine(model: str, root: Path = TRN2) -> tuple[int, dict[str, Any]]:
    """The engine Deployment of deploy/trn2/k8s/MODEL.yaml: its replica count and its container's resources."""
    import yaml

    docs = yaml.safe_load_all((root / "k8s" / f"{model}.yaml").read_text())
    (dep,) = [d for d in docs if d and d.get("kind") == "Deployment"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return dep["spec"]["replicas"], container["resources"]


@pytest.mark.vllm
@pytest.mark.parametrize("model,cores", [("laplace-3b", 1), ("mla-trinity", 2)])
def test_trn2_recipe_parses_as_vllm_serve(model: str, cores: int, tmp_path: Path) -> None:
    from vllm_trn_plugin.compat import ensure_vllm_version_lookup

    ensure_vllm_version_lookup()
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = trn2_recipe_argv(model)
    assert argv[:2] == ["vllm", "serve"]
    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers())
    ns = parser.parse_args(argv[1:])  # unknown or misspelt flags fail here
    assert ns.model_tag == "/models/x" and ns.tensor_parallel_size == cores
    # One engine shards over `tensor_parallel_size` NeuronCores. The instance launcher must give every replica
    # exactly that many, no core to two replicas, and fill the instance: 64 // cores replicas (64 Laplace engines
    # of 1 core, 32 MLA-Trinity replicas of 2), all behind the router; Kubernetes the same count and cores per pod.
    replica_cores, urls, router = trn2_instance_plan(model, tmp_path)
    assert [len(c) for c in replica_cores] == [ns.tensor_parallel_size] * (TRN2_CORES // ns.tensor_parallel_size)
    assert sorted(sum(replica_cores, [])) == list(range(TRN2_CORES))
    assert router == urls and len(set(urls)) == len(urls)
    replicas, resources = trn2_k8s_engine(model)
    assert replicas == TRN2_CORES // ns.tensor_parallel_size
    assert resources["requests"]["aws.amazon.com/neuroncore"] == ns.tensor_parallel_size
    assert resources["limits"]["aws.amazon.com/neuroncore"] == ns.tensor_parallel_size
    assert ns.enable_prefix_caching is False
    nc = ns.additional_config["neuron_config"]
    # vllm-neuron: the largest decode-width bucket is max_num_seqs; a token budget below max_model_len means segmented
    # prefill, whose token buckets are exactly [the budget], a supported segment size; context buckets ascend, stay
    # below max_model_len, are multiples of 128.
    assert max(nc["num_seqs_buckets"]) == ns.max_num_seqs and nc["num_seqs_buckets"] == sorted(nc["num_seqs_buckets"])
    assert ns.max_num_batched_tokens < ns.max_model_len and ns.max_num_batched_tokens in (512, 1024, 2048, 4096, 8192)
    assert nc["num_batched_tokens_buckets"] == [ns.max_num_batched_tokens]
    ctx = nc.get("decode_context_length_buckets", [])
    assert ctx == sorted(ctx) and all(c < ns.max_model_len and c % 128 == 0 for c in ctx)
    assert ns.kv_cache_dtype == "auto"  # the Neuron adapter keeps caches in the model dtype (it refuses FP8)
    if model == "mla-trinity":
        assert "latent_cache_dtype" not in ns.additional_config
        assert ctx + [ns.max_model_len] == [2304, 4352, 8448, 16640]
    else:
        assert ns.max_num_seqs == 20 and ns.kv_cache_dtype == "auto"  # no KV cache: fp32 state pages
