"""One streaming request to an OpenAI-compatible server, timed token by token.

Timing follows `vllm bench serve` so the two tools report the same quantities:
- TTFT: from sending the request to the first streamed chunk that carries generated text;
- ITL: the gaps between successive such chunks (a chunk may carry more than one token under load);
- E2E latency: from sending to the last such chunk;
- TPOT: (E2E - TTFT) / (output tokens - 1), output tokens from the server's `usage` (requested with
  `stream_options.include_usage`), or the number of chunks when the server sends no usage.

Whatever a server sends, a request fails on its own: an event that is not a JSON object, or a field of the wrong
type (`choices` not an array, `text` not a string, `usage` not an object, a token count not a non-negative
integer), is a `BadResponse`, recorded as that request's error ("bad response: ..."); the load point goes on.
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


class BadResponse(ValueError):
    """The server's answer has the wrong shape: an event that is no JSON object, a field of the wrong type."""


_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "object": dict,
    "array": list,
    "string": str,
    "number": (int, float),
    "non-negative integer": int,
}
COUNT = "non-negative integer"  # a token count (`usage`)


def json_kind(v: Any) -> str:
    """What a decoded JSON value is, for a message: 'null', 'an array ([1, 2, 3])', ..."""
    if v is None:
        return "null"
    kinds = ((bool, "a boolean"), (dict, "an object"), (list, "an array"), (str, "a string"))
    kind = next((name for t, name in kinds if isinstance(v, t)), "a number")
    text = json.dumps(v)
    return f"{kind} ({text if len(text) <= 60 else text[:57] + '...'})"


def expect(v: Any, want: str, path: str, null_ok: bool = True) -> Any:
    """`v` when it is a JSON `want` (object, array, string, number, non-negative integer), or null and `null_ok`;
    otherwise a BadResponse naming `path` (where `v` sits in the event), what it is and what was expected."""
    if v is None and null_ok:
        return None
    if isinstance(v, _JSON_TYPES[want]) and not isinstance(v, bool) and not (want.endswith("integer") and v < 0):
        return v
    what = f"{v}" if isinstance(v, int) and not isinstance(v, bool) and want.endswith("integer") else json_kind(v)
    article = "an" if want[0] in "aeiou" else "a"
    raise BadResponse(f"{path} is {what}, expected {article} {want}")


def json_field(obj: dict[str, Any], key: str, want: str, path: str = "") -> Any:
    """`obj[key]` checked by `expect` (absent or null: None); `path` is where `obj` sits, e.g. 'choices[0].'."""
    return expect(obj.get(key), want, path + key)


def _chunk_text(target: Target, choice: dict[str, Any], path: str) -> str | None:
    """The generated text a chunk carries, or None when it carries none (the chat role announcement)."""
    if target.endpoint == "chat":
        delta = json_field(choice, "delta", "object", path) or {}
        content = json_field(delta, "content", "string", path + "delta.")
        if content is None or (content == "" and "role" in delta and not choice.get("finish_reason")):
            return None
        return content
    return json_field(choice, "text", "string", path) or ""


def choices(msg: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The event's choices, each with its path ('choices[i].'); BadResponse unless an array of objects."""
    return [
        (f"choices[{i}].", expect(c, "object", f"choices[{i}]", null_ok=False))
        for i, c in enumerate(json_field(msg, "choices", "array") or [])
    ]


DONE = None  # what `sse_messages` yields for the stream's final `data: [DONE]`


def _snippet(data: bytes) -> str:
    return repr(data[:60]) + ("..." if len(data) > 60 else "")


async def sse_messages(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any] | None]:
    """The JSON messages of an OpenAI server-sent-event stream, in order, then DONE (None) if the stream
    ends with `data: [DONE]`; blank separators and SSE comments are skipped. An event that is not a JSON
    object (an array, a number, a string, null, not JSON at all) raises BadResponse."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            yield DONE
            return
        try:
            msg = json.loads(data)
        except RecursionError:
            raise BadResponse(f"event nested too deeply to parse: {_snippet(data)}") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise BadResponse(f"event is not JSON ({e}): {_snippet(data)}") from None
        yield expect(msg, "object", "event", null_ok=False)


def stream_error(msg: Any) -> str | None:
    """The message of an error event inside a 200 stream (vLLM sends one when a request fails mid-stream)."""
    if not isinstance(msg, dict) or ("error" not in msg and msg.get("object") != "error"):
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
                for path, choice in choices(msg):
                    text = _chunk_text(target, choice, path)
                    if finish := json_field(choice, "finish_reason", "string", path):
                        res.finish_reason = finish
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
                usage = json_field(msg, "usage", "object")
                if usage:
                    res.output_tokens = json_field(usage, "completion_tokens", COUNT, "usage.") or 0
                    res.prompt_tokens = json_field(usage, "prompt_tokens", COUNT, "usage.") or res.prompt_tokens
                    details = json_field(usage, "prompt_tokens_details", "object", "usage.") or {}
                    cached = json_field(details, "cached_tokens", COUNT, "usage.prompt_tokens_details.")
                    if cached is not None:
                        res.cached_tokens = cached
    except BadResponse as e:
        res.error = f"bad response: {e}"
        return res
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
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


def model_id(url: str, text: str) -> str:
    """The first model id in `text`, the answer of `url` (a server's /v1/models); BadResponse naming `url` and
    what it answered when that is not `{"data": [{"id": "...", ...}, ...], ...}`."""
    try:
        listing = json.loads(text)
    except (ValueError, RecursionError):
        listing = None
    data = listing.get("data") if isinstance(listing, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
        return data[0]["id"]
    shown = text[:100] + ("..." if len(text) > 100 else "")
    raise BadResponse(f'{url}: expected a model listing {{"data": [{{"id": ...}}, ...]}}, got {shown}')


async def first_model(session: aiohttp.ClientSession, target: Target) -> str:
    """The first model id the server lists at /v1/models."""
    url = target.base_url.rstrip("/") + "/v1/models"
    async with session.get(url, headers=target.headers()) as r:
        r.raise_for_status()
        return model_id(url, await r.text())
