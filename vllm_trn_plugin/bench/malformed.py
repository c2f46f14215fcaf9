"""The malformed-input sweep of an OpenAI-compatible server: wrong types, missing fields, out-of-range numbers,
bad token ids and bytes, bad JSON and content types, unknown models, n/best_of abuse, odd stops, prompts
beyond the context, bad chat roles. Every case must be answered within the timeout and never with a 5xx (nor
a 5xx error event inside a 200 stream); every invalid request with a 4xx, except those vLLM accepts by
design (`Case.note` says which and why)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import requests


@dataclass(frozen=True)
class Case:
    """One malformed (or odd) request. `body`: a dict sent as JSON (with "model" added unless present or
    `add_model` is False), raw bytes, or None. `expect`: '4xx' (invalid: must be refused with a 4xx) or
    'not5xx' (odd, or invalid but accepted by vLLM by design, said in `note`: any well-formed answer below
    500)."""

    name: str
    path: str
    body: dict[str, Any] | bytes | None
    method: str = "POST"
    content_type: str | None = "application/json"
    expect: str = "4xx"
    add_model: bool = True
    note: str = ""  # why a 2xx is right for an 'not5xx' case (vLLM's own, deliberate behaviour)
    slow: bool = False  # a long prefill: left out of the CI-sized sweep


_BEST_OF = "vLLM 0.32's CompletionRequest has no best_of field: unknown fields are ignored (extra='allow')"
_ROLE: dict[str, str] = {
    "expect": "not5xx",
    "note": "vLLM accepts any role string (renderers/chat_utils.CustomChatCompletionMessageParam); "
    "the chat template renders it",
}


def malformed_cases(max_model_len: int, vocab: int = 259) -> list[Case]:
    """The sweep for a server with context `max_model_len` and a vocabulary of `vocab` ids (the demos': 259)."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    too_long = max_model_len + 16
    cases = [
        # the body itself
        Case("bad-json", c, b'{"prompt": "x", "max_tokens": 2', add_model=False),
        Case("json-array-body", c, b"[1, 2, 3]", add_model=False),
        Case("json-string-body", c, b'"hello"', add_model=False),
        Case("empty-body", c, b"", add_model=False),
        Case("invalid-utf8-bytes", c, b'{"prompt": "\xff\xfe\xfa", "max_tokens": 2}', add_model=False),
        Case(
            "invalid-utf8-bytes-chat", ch, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', add_model=False
        ),
        Case("lone-surrogate-escape", c, b'{"prompt": "\\ud800 x", "max_tokens": 2}'),
        Case("lone-surrogate-chat", ch, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'),
        Case("nul-bytes-in-prompt", c, {"prompt": "a\u0000b\u0000", "max_tokens": 2}, expect="not5xx"),
        Case("wrong-content-type", c, b'{"prompt": "x", "max_tokens": 2}', content_type="text/plain", add_model=False),
        Case("form-content-type", c, b"prompt=x&max_tokens=2", content_type="application/x-www-form-urlencoded"),
        Case("no-content-type", c, b'{"prompt": "x", "max_tokens": 2}', content_type=None, add_model=False),
        Case("get-on-post-endpoint", c, None, method="GET"),
        Case("unknown-path", "/v1/no-such-endpoint", {"prompt": "x"}),
        # missing fields and wrong types
        Case("missing-prompt", c, {"max_tokens": 2}),
        Case("null-prompt", c, {"prompt": None, "max_tokens": 2}),
        Case("missing-messages", ch, {"max_tokens": 2}),
        Case("prompt-number", c, {"prompt": 12345, "max_tokens": 2}),
        Case("prompt-object", c, {"prompt": {"text": "x"}, "max_tokens": 2}),
        Case("prompt-mixed-list", c, {"prompt": [1, "two", 3], "max_tokens": 2}),
        Case("prompt-nested-bad", c, {"prompt": [[1, 2], [3, "x"]], "max_tokens": 2}),
        Case("prompt-float-ids", c, {"prompt": [1.5, 2.5], "max_tokens": 2}),
        Case("max-tokens-string", c, {"prompt": "x", "max_tokens": "ten"}),
        Case("max-tokens-float", c, {"prompt": "x", "max_tokens": 2.5}),
        Case("temperature-string", c, {"prompt": "x", "max_tokens": 2, "temperature": "hot"}),
        Case("stream-string", c, {"prompt": "x", "max_tokens": 2, "stream": "yes please"}),
        Case("messages-string", ch, {"messages": "hello"}),
        Case("messages-content-number", ch, {"messages": [{"role": "user", "content": 5}], "max_tokens": 2}),
        Case("model-number", c, {"model": 7, "prompt": "x", "max_tokens": 2}),
        # numbers out of range
        Case("max-tokens-negative", c, {"prompt": "x", "max_tokens": -1}),
        Case("max-tokens-zero", c, {"prompt": "x", "max_tokens": 0}),
        Case("max-tokens-huge", c, {"prompt": "x", "max_tokens": 10**7}),
        Case("max-tokens-2^63", c, {"prompt": "x", "max_tokens": 2**63}),
        Case("max-tokens-2^80", c, {"prompt": "x", "max_tokens": 2**80}),
        Case("chat-max-completion-negative", ch, {"messages": msgs, "max_completion_tokens": -5}),
        Case("chat-max-tokens-huge", ch, {"messages": msgs, "max_tokens": 10**7}),
        Case("temperature-negative", c, {"prompt": "x", "max_tokens": 2, "temperature": -1}),
        Case("temperature-nan", c, b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}'),
        Case("top-p-zero", c, {"prompt": "x", "max_tokens": 2, "top_p": 0}),
        Case("top-p-above-one", c, {"prompt": "x", "max_tokens": 2, "top_p": 1.5}),
        Case("top-k-negative", c, {"prompt": "x", "max_tokens": 2, "top_k": -5}),
        Case("repetition-penalty-zero", c, {"prompt": "x", "max_tokens": 2, "repetition_penalty": 0}),
        Case("min-tokens-above-max", c, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}),
        Case("seed-huge", c, {"prompt": "x", "max_tokens": 2, "seed": 2**70}),
        Case("truncate-prompt-negative", c, {"prompt": "x", "max_tokens": 2, "truncate_prompt_tokens": -7}),
        Case("truncate-prompt-beyond-context", c, {"prompt": "x", "max_tokens": 2, "truncate_prompt_tokens": too_long}),
        Case("logit-bias-bad-key", c, {"prompt": "x", "max_tokens": 2, "logit_bias": {"abc": 1}}),
        Case("logit-bias-out-of-vocab", c, {"prompt": "x", "max_tokens": 2, "logit_bias": {str(10**6): 5}}),
        Case(
            "logit-bias-huge-value",
            c,
            {"prompt": "x", "max_tokens": 2, "logit_bias": {"5": 1e30}},
            expect="not5xx",
            note="vLLM checks logit_bias keys against the vocabulary but not the values (OpenAI: -100..100)",
        ),
        # prompts: empty, out of vocabulary, beyond the context
        Case("empty-prompt", c, {"prompt": "", "max_tokens": 2}),
        Case("empty-token-list", c, {"prompt": [], "max_tokens": 2}),
        Case("empty-prompt-list", c, {"prompt": [[]], "max_tokens": 2}),
        Case("token-id-vocab-size", c, {"prompt": [1, vocab], "max_tokens": 2}),
        Case("token-id-huge", c, {"prompt": [10**9], "max_tokens": 2}),
        Case("token-id-2^40", c, {"prompt": [2**40], "max_tokens": 2}),
        Case("token-id-negative", c, {"prompt": [5, -1], "max_tokens": 2}),
        Case("token-id-out-of-vocab-stream", c, {"prompt": [10**9], "max_tokens": 2, "stream": True}),
        Case("prompt-beyond-context-ids", c, {"prompt": [7] * too_long, "max_tokens": 2}),
        Case("prompt-beyond-context-text", c, {"prompt": "x" * (20 * max_model_len), "max_tokens": 2}),
        Case(
            "prompt-plus-output-beyond-context",
            c,
            {"prompt": [7] * (max_model_len - 4), "max_tokens": 64},
            expect="not5xx",
            note="vLLM caps max_tokens at the context left (entrypoints/serve/utils/api_utils.get_max_tokens)",
            slow=True,
        ),
        Case("chat-beyond-context", ch, {"messages": [{"role": "user", "content": "y" * too_long}], "max_tokens": 2}),
        Case("prompt-beyond-context-stream", c, {"prompt": [7] * too_long, "max_tokens": 2, "stream": True}),
        # n / best_of abuse
        Case("n-zero", c, {"prompt": "x", "max_tokens": 2, "n": 0}),
        Case("n-negative", c, {"prompt": "x", "max_tokens": 2, "n": -3}),
        Case("n-huge", c, {"prompt": "x", "max_tokens": 2, "n": 10**6}),
        Case("n-string", c, {"prompt": "x", "max_tokens": 2, "n": "two"}),
        Case("best-of-zero", c, {"prompt": "x", "max_tokens": 2, "best_of": 0}, expect="not5xx", note=_BEST_OF),
        Case(
            "best-of-below-n", c, {"prompt": "x", "max_tokens": 2, "n": 3, "best_of": 2}, expect="not5xx", note=_BEST_OF
        ),
        Case("best-of-huge", c, {"prompt": "x", "max_tokens": 2, "best_of": 10**6}, expect="not5xx", note=_BEST_OF),
        Case("chat-n-huge", ch, {"messages": msgs, "max_tokens": 2, "n": 10**6}),
        # logprobs out of range
        Case("logprobs-negative", c, {"prompt": "x", "max_tokens": 2, "logprobs": -1}),
        Case("logprobs-huge", c, {"prompt": "x", "max_tokens": 2, "logprobs": 10**6}),
        Case("prompt-logprobs-huge", c, {"prompt": "x", "max_tokens": 2, "prompt_logprobs": 10**6}),
        Case("prompt-logprobs-negative", c, {"prompt": "x", "max_tokens": 2, "prompt_logprobs": -2}),
        Case(
            "chat-top-logprobs-negative", ch, {"messages": msgs, "max_tokens": 2, "logprobs": True, "top_logprobs": -5}
        ),
        Case(
            "chat-top-logprobs-huge", ch, {"messages": msgs, "max_tokens": 2, "logprobs": True, "top_logprobs": 10**6}
        ),
        Case("chat-logprobs-string", ch, {"messages": msgs, "max_tokens": 2, "logprobs": "many"}),
        # stop sequences
        Case("stop-number", c, {"prompt": "x", "max_tokens": 2, "stop": 5}),
        Case("stop-list-of-null", c, {"prompt": "x", "max_tokens": 2, "stop": [None]}),
        Case("stop-token-ids-negative", c, {"prompt": "x", "max_tokens": 2, "stop_token_ids": [-1]}),
        Case("stop-token-ids-huge", c, {"prompt": "x", "max_tokens": 2, "stop_token_ids": [10**12]}),
        Case("stop-empty-string", c, {"prompt": "x", "max_tokens": 4, "stop": [""]}, expect="not5xx"),
        Case("stop-many", c, {"prompt": "x", "max_tokens": 4, "stop": [f"s{i}" for i in range(2000)]}, expect="not5xx"),
        Case("stop-long", c, {"prompt": "x", "max_tokens": 4, "stop": ["z" * 100_000]}, expect="not5xx"),
        Case(
            "stop-control-chars",
            c,
            {"prompt": "x", "max_tokens": 4, "stop": ["\u0000", "\ufffd", "\n"]},
            expect="not5xx",
        ),
        # chat roles and messages
        Case("chat-empty-messages", ch, {"messages": [], "max_tokens": 2}),
        Case("chat-role-missing", ch, {"messages": [{"content": "hi"}], "max_tokens": 2}),
        Case("chat-role-number", ch, {"messages": [{"role": 3, "content": "hi"}], "max_tokens": 2}),
        Case("chat-role-null", ch, {"messages": [{"role": None, "content": "hi"}], "max_tokens": 2}),
        Case("chat-role-unknown", ch, {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}, **_ROLE),
        Case("chat-role-empty", ch, {"messages": [{"role": "", "content": "hi"}], "max_tokens": 2}, **_ROLE),
        Case("chat-tool-without-id", ch, {"messages": [{"role": "tool", "content": "42"}], "max_tokens": 2}, **_ROLE),
        Case("chat-content-bad-part", ch, {"messages": [{"role": "user", "content": [{"type": "nope"}]}]}),
        Case(
            "chat-image-part",
            ch,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}],
                    }
                ],
                "max_tokens": 2,
            },
        ),
        Case("chat-message-not-object", ch, {"messages": ["hi"], "max_tokens": 2}),
        Case("chat-tool-choice-without-tools", ch, {"messages": msgs, "max_tokens": 2, "tool_choice": "required"}),
        Case(
            "chat-response-format-bogus",
            ch,
            {"messages": msgs, "max_tokens": 2, "response_format": {"type": "nonsense"}},
        ),
        Case(
            "chat-json-schema-invalid",
            ch,
            {
                "messages": msgs,
                "max_tokens": 2,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
                },
            },
        ),
        Case("chat-template-untrusted", ch, {"messages": msgs, "max_tokens": 2, "chat_template": "{% for %}"}),
        # models and other endpoints
        Case("unknown-model", c, {"model": "no-such-model", "prompt": "x", "max_tokens": 2}),
        Case("unknown-model-chat", ch, {"model": "no-such-model", "messages": msgs}),
        Case("tokenize-bad-type", "/tokenize", {"prompt": 5}),
        Case(
            "detokenize-out-of-vocab",
            "/detokenize",
            {"tokens": [10**9]},
            expect="not5xx",
            note="vLLM's /detokenize passes ids to the tokenizer, which drops unknown ids (answers '')",
        ),
        Case("embeddings-on-generate-model", "/v1/embeddings", {"input": "x"}),
    ]
    return cases


def _send(base_url: str, case: Case, model: str, timeout: float) -> requests.Response:
    url = base_url.rstrip("/") + case.path
    headers = {"Content-Type": case.content_type} if case.content_type else {}
    body = case.body
    if isinstance(body, dict):
        body = json.dumps({"model": model, **body} if case.add_model else body).encode()
    elif isinstance(body, bytes) and case.add_model and body.startswith(b"{"):
        body = b'{"model": ' + json.dumps(model).encode() + b", " + body[1:]
    return requests.request(case.method, url, data=body, headers=headers, timeout=timeout)


def run_sweep(base_url: str, model: str, cases: Sequence[Case], timeout: float = 60.0) -> list[dict[str, Any]]:
    """Send every case; each result: status (or 'timeout' / connection error), `ok`, the answer's start.
    A streamed 200 is read to the end and its error event's code, if any, kept (`stream_error_code`); a
    plain 200 must be a JSON object (`well_formed`)."""
    out = []
    for case in cases:
        t0 = time.perf_counter()
        res: dict[str, Any] = {"name": case.name, "path": case.path, "expect": case.expect}
        try:
            r = _send(base_url, case, model, timeout)
            res["status"], text = r.status_code, r.text
            if r.status_code == 200 and "text/event-stream" in r.headers.get("content-type", ""):
                res["stream_error_code"] = _stream_error_code(text)
            elif r.status_code == 200:
                res["well_formed"] = _json_object(text)
        except requests.Timeout:
            res["status"], text = "timeout", ""
        except requests.ConnectionError as e:
            res["status"], text = "connection error", str(e)
        res["seconds"] = round(time.perf_counter() - t0, 3)
        res["answer"] = text[:240]
        res["ok"] = _sweep_ok(case, res)
        out.append(res)
    return out


def _stream_error_code(text: str) -> int | None:
    """The code of the stream's first error event; 500 when that event is malformed (not JSON, not an object,
    an error or code of the wrong type): a server that cannot write its error event well is at fault."""
    for line in text.splitlines():
        if line.startswith("data:") and '"error"' in line:
            try:
                event = json.loads(line[5:])
                err = event.get("error", {}) if isinstance(event, dict) else None
                code = err.get("code", 500) if isinstance(err, dict) else 500
                return 500 if isinstance(code, bool) else int(code)
            except (ValueError, TypeError, OverflowError, RecursionError):
                return 500
    return None


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _sweep_ok(case: Case, res: dict[str, Any]) -> bool:
    status = res["status"]
    if not isinstance(status, int) or status >= 500 or res.get("well_formed") is False:
        return False
    code = res.get("stream_error_code")
    if code is not None and code >= 500:
        return False
    if case.expect == "4xx":
        return 400 <= status < 500 or (code is not None and 400 <= code < 500)
    return True
