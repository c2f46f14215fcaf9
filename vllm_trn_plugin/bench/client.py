"""One streaming request to an OpenAI-compatible server, timed token by token.

Timing follows `vllm bench serve` so the two tools report the same quantities:
- TTFT: from sending the request to the first streamed chunk that carries generated text;
- ITL: the gaps between successive such chunks (a chunk may carry more than one token under load);
- E2E latency: from sending to the last such chunk;
- TPOT: (E2E - TTFT) / (output tokens - 1), output tokens from the server's `usage` (requested with
  `stream_options.include_usage`), or the number of chunks when the server sends no usage.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from vllm_trn_plugin.bench.workload import RequestSpec


@dataclass
class Target:
    """An endpoint under test: `base_url` like http://host:8000 (no /v1), `endpoint` completions or chat."""

    base_url: str
    model: str | None = None
    endpoint: str = "completions"
    label: str = "A"
    api_key: str | None = None

    @property
    def url(self) -> str:
        path = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}[self.endpoint]
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestResult:
    """What one request did. Times are seconds; `start` is relative to the start of its load point."""

    index: int
    target: str
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    # Prompt tokens served from the server's prefix cache, where it reports them (vLLM: --enable-prompt-tokens-details).
    cached_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a single-token output."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def row(self) -> dict[str, Any]:
        tpot = self.tpot
        return {
            "target": self.target,
            "index": self.index,
            "ok": int(self.ok),
            "start_s": round(self.start, 6),
            "ttft_ms": round(self.ttft * 1e3, 3),
            "tpot_ms": "" if tpot is None else round(tpot * 1e3, 3),
            "e2el_ms": round(self.latency * 1e3, 3),
            "mean_itl_ms": round(sum(self.itl) / len(self.itl) * 1e3, 3) if self.itl else "",
            "chunks": self.chunks,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "finish_reason": self.finish_reason or "",
            "error": self.error[:200],
        }


def build_payload(target: Target, spec: RequestSpec, params: dict[str, Any]) -> dict[str, Any]:
    """The JSON body: streaming, usage requested, `params` (temperature, ignore_eos, ...) merged in."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": spec.max_tokens, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if target.endpoint == "chat":
        if isinstance(spec.prompt, list) and spec.prompt and all(isinstance(m, dict) for m in spec.prompt):
            body["messages"] = spec.prompt  # a conversation so far
        elif not isinstance(spec.prompt, str):
            raise ValueError("the chat endpoint takes text prompts (use text prompts or a dataset of strings)")
        else:
            body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    body.update(params)
    return body


def _chunk_text(target: Target, choice: dict[str, Any]) -> str | None:
    """The generated text a chunk carries, or None when it carries none (the chat role announcement)."""
    if target.endpoint == "chat":
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content is None or (content == "" and "role" in delta and not choice.get("finish_reason")):
            return None
        return content
    return choice.get("text") or ""


DONE = None  # what `sse_messages` yields for the stream's final `data: [DONE]`


async def sse_messages(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any] | None]:
    """The JSON messages of an OpenAI server-sent-event stream, in order, then DONE (None) if the stream
    ends with `data: [DONE]`; blank separators and SSE comments are skipped."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            yield DONE
            return
        yield json.loads(data)


def stream_error(msg: dict[str, Any]) -> str | None:
    """The message of an error event inside a 200 stream (vLLM sends one when a request fails mid-stream)."""
    if "error" not in msg and msg.get("object") != "error":
        return None
    err = msg.get("error", msg)
    return str(err.get("message", err) if isinstance(err, dict) else err)


async def stream_request(
    session: aiohttp.ClientSession,
    target: Target,
    spec: RequestSpec,
    params: dict[str, Any],
    t0: float,
    keep_text: bool = False,
) -> RequestResult:
    """Send `spec` to `target` with streaming on and time every chunk; never raises for a failed request."""
    res = RequestResult(spec.index, target.label, prompt_tokens=spec.prompt_len or 0)
    body = build_payload(target, spec, params)
    st = time.perf_counter()
    res.start = st - t0
    last = st
    pieces: list[str] = []
    done = False
    try:
        async with session.post(target.url, json=body, headers=target.headers()) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for msg in sse_messages(resp):
                if msg is DONE:
                    done = True
                    break
                if (err := stream_error(msg)) is not None:
                    res.error = f"stream error: {err}"
                    return res
                for choice in msg.get("choices") or []:
                    text = _chunk_text(target, choice)
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
                    if text is None:
                        continue
                    now = time.perf_counter()
                    if res.chunks == 0:
                        res.ttft = now - st
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.chunks += 1
                    pieces.append(text)
                usage = msg.get("usage")
                if usage:
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    res.prompt_tokens = int(usage.get("prompt_tokens") or res.prompt_tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        res.cached_tokens = int(details["cached_tokens"])
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    if res.chunks == 0:
        res.error = "no token was streamed"
        return res
    if not done:
        res.error = "stream ended without [DONE]"
        return res
    res.ok = True
    res.latency = last - st
    if res.output_tokens == 0:
        res.output_tokens = res.chunks
    if keep_text:
        res.text = "".join(pieces)
    return res


async def first_model(session: aiohttp.ClientSession, target: Target) -> str:
    """The first model id the server lists at /v1/models."""
    async with session.get(target.base_url.rstrip("/") + "/v1/models", headers=target.headers()) as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]
