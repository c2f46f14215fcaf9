"""Serving features through `vllm-trn serve` on each demo checkpoint, over real HTTP, on the session servers (started
in tests/conftest.py with `--served-model-name`, `--enable-auto-tool-choice --tool-call-parser hermes` and
`--shutdown-timeout`): structured output, tool calling, the served model name, and a graceful shutdown, which stops
the servers and so runs after every other test of the session.

The demo checkpoints have random weights. A grammar confines them to its language, but JSON allows whitespace between
any two tokens and random weights may keep choosing it until max_tokens. `COMPACT`, a logit bias against the four
whitespace bytes, makes them write compact JSON (as trained models do), so every schema below has only short valid
outputs and each request ends with the grammar, not at max_tokens.
"""

from __future__ import annotations

import json
import re
import signal
import time

import jsonschema
import pytest
import requests
from openai import NotFoundError, OpenAI

pytestmark = pytest.mark.vllm

MODELS = ["laplace", "mla-trinity"]
COMPACT = {str(b): -100 for b in b" \t\n\r"}  # token id = byte value in the demo tokenizer

THING = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["color", "size", "tags"],
    "additionalProperties": False,
}
THING_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": THING}}


def _function(name: str, properties: dict) -> dict:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    # strict: vLLM holds the arguments to the parameters schema only for strict functions (as OpenAI does).
    return {"type": "function", "function": {"name": name, "strict": True, "parameters": parameters}}


TOOLS = [
    _function(
        "get_weather",
        {
            "city": {"type": "string", "enum": ["Paris", "Oslo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
    ),
    _function("get_time", {"zone": {"type": "string", "enum": ["UTC", "CET"]}}),
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module", params=MODELS)
def server(request, servers):  # noqa: ANN001, ANN201
    return servers.get(request.param)


@pytest.fixture(scope="module")
def client(server) -> OpenAI:  # noqa: ANN001
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


# ---------------------------------------------------------------------------------------------------------------------
# Structured output


def test_json_schema_chat(client, server) -> None:  # noqa: ANN001
    args = dict(model=server.model, messages=ASK, max_tokens=128, temperature=0, logit_bias=COMPACT)
    r = client.chat.completions.create(**args, response_format=THING_FORMAT)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), THING)
    streamed = client.chat.completions.create(**args, response_format=THING_FORMAT, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == text
    free = client.chat.completions.create(**args).choices[0].message.content  # the same request without the grammar
    assert not _valid(free, THING)


@pytest.mark.parametrize(
    "constraint",
    [{"response_format": THING_FORMAT}, {"structured_outputs": {"json": THING}}],
    ids=["response_format", "structured_outputs"],
)
def test_json_schema_completions(client, server, constraint: dict) -> None:  # noqa: ANN001
    args = dict(model=server.model, prompt="A thing:", max_tokens=128, temperature=0, logit_bias=COMPACT)
    r = client.completions.create(**args, extra_body=constraint)
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), THING)
    streamed = client.completions.create(**args, extra_body=constraint, stream=True)
    pieces = [c.choices[0].text for c in streamed if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == text


def test_json_object(client, server) -> None:  # noqa: ANN001
    """`json_object`: any JSON object. With whitespace and the quote (which would open a key) biased away, the only
    object left is `{}`, whatever the weights: the grammar, not chance, ends the reply."""
    bias = {**COMPACT, str(ord('"')): -100}
    r = client.chat.completions.create(
        model=server.model,
        messages=ASK,
        max_tokens=32,
        temperature=0,
        logit_bias=bias,
        response_format={"type": "json_object"},
    )
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("{}", "stop")
    r = client.completions.create(
        model=server.model,
        prompt="{",
        max_tokens=32,
        temperature=0,
        logit_bias=bias,
        extra_body={"structured_outputs": {"json_object": True}},
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("{}", "stop")


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t) is not None),
    ],
    ids=["choice", "regex"],
)
def test_structured_outputs_choice_and_regex(client, server, constraint: dict, check) -> None:  # noqa: ANN001
    r = client.completions.create(
        model=server.model,
        prompt="Answer:",
        max_tokens=16,
        temperature=0,
        extra_body={"structured_outputs": constraint},
    )
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), r.choices[0].text


# ---------------------------------------------------------------------------------------------------------------------
# Tool calling


def _tool_request(client: OpenAI, server, stream: bool = False, **kw: object):  # noqa: ANN001, ANN202
    return client.chat.completions.create(
        model=server.model,
        messages=ASK,
        tools=TOOLS,
        max_tokens=128,
        temperature=0,
        logit_bias=COMPACT,
        stream=stream,
        **kw,
    )


def _streamed_calls(stream) -> tuple[list[tuple[str, dict]], str | None]:  # noqa: ANN001
    """The (name, parsed arguments) of each tool call a stream delivers in pieces, and its finish reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for tc in chunk.choices[0].delta.tool_calls or []:
            name, args = calls.setdefault(tc.index, ["", ""])
            calls[tc.index] = [name + (tc.function.name or ""), args + (tc.function.arguments or "")]
    return [(calls[i][0], json.loads(calls[i][1])) for i in sorted(calls)], finish


@pytest.mark.parametrize("name", list(PARAMETERS))
def test_named_tool_choice_calls_that_function(client, server, name: str) -> None:  # noqa: ANN001
    choice = {"type": "function", "function": {"name": name}}
    r = _tool_request(client, server, tool_choice=choice)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"  # OpenAI's finish reason for a named tool choice
    assert calls and len(calls) == 1 and calls[0].function.name == name, r.choices[0].message
    arguments = json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, PARAMETERS[name])
    streamed, finish = _streamed_calls(_tool_request(client, server, stream=True, tool_choice=choice))
    assert streamed == [(name, arguments)] and finish == "stop"


def test_required_tool_choice_calls_a_function(client, server) -> None:  # noqa: ANN001
    r = _tool_request(client, server, tool_choice="required", parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert calls and len(calls) == 1 and calls[0].function.name in PARAMETERS, r.choices[0].message
    arguments = json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, PARAMETERS[calls[0].function.name])
    streamed, finish = _streamed_calls(
        _tool_request(client, server, stream=True, tool_choice="required", parallel_tool_calls=False)
    )
    assert streamed == [(calls[0].function.name, arguments)] and finish == "tool_calls"


def test_tool_result_is_rendered_and_answered(client, server) -> None:  # noqa: ANN001
    """A conversation carrying the assistant's tool call and the tool's result: the chat template renders both (the
    server's own /tokenize shows them in the prompt) and the model answers after them."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
    }
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 3}'},
    ]
    tok = requests.post(
        server.url + "/tokenize",
        json={"model": server.model, "messages": messages, "tools": TOOLS, "add_generation_prompt": True},
        timeout=60,
    )
    assert tok.status_code == 200, tok.text
    prompt = bytes(t for t in tok.json()["tokens"] if t < 256).decode()  # ids 0-255 are the bytes
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temp_c": 3}\n</tool_response>' in prompt and '"name": "get_time"' in prompt
    r = client.chat.completions.create(
        model=server.model, messages=messages, tools=TOOLS, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == tok.json()["count"] and r.usage.completion_tokens == 8
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content


def test_tool_choice_none_answers_in_text(client, server) -> None:  # noqa: ANN001
    """Tools offered, tool_choice "none": the reply is plain text, all of it. (Bytes 128-255 and the special tokens are
    biased away, so that each of the 8 tokens is one ASCII character of the content.)"""
    ascii_only = {str(t): -100 for t in range(128, 259)}
    r = client.chat.completions.create(
        model=server.model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
        logit_bias=ascii_only,
        extra_body={"ignore_eos": True},
    )
    message = r.choices[0].message
    assert not message.tool_calls and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and len(message.content) == 8, message


# ---------------------------------------------------------------------------------------------------------------------
# The served model name


def test_served_model_name(client, server) -> None:  # noqa: ANN001
    assert [m.id for m in client.models.list()] == [server.model]
    r = client.completions.create(model=server.model, prompt="hi", max_tokens=2)
    assert r.model == server.model and r.usage.completion_tokens >= 1
    with pytest.raises(NotFoundError, match=f"does not exist. Valid aliases: {server.model}"):
        client.completions.create(model=str(server.checkpoint), prompt="hi", max_tokens=2)


# ---------------------------------------------------------------------------------------------------------------------
# Graceful shutdown (stops the session servers: runs last)


def _wait_for_log(server, line: str) -> None:  # noqa: ANN001
    end = time.monotonic() + server.shutdown_timeout
    while line not in server.log.read_text():
        assert time.monotonic() < end, f"no {line!r} in {server.log}"
        time.sleep(0.05)


@pytest.mark.stops_server
@pytest.mark.parametrize("model", MODELS)
def test_sigterm_lets_streams_in_flight_finish(servers, model: str) -> None:  # noqa: ANN001
    """SIGTERM to a server with a stream in flight: with --shutdown-timeout the engine drains (vLLM 0.32), the stream
    gets every one of its tokens, its finish reason and [DONE]; a request arriving during the drain is refused (vLLM
    0.32 answers 500 "cannot schedule new futures after shutdown": its input processing has already stopped) while
    /health still answers 200; then the server exits within the timeout.

    The stream is long by token count (1,500 tokens; SIGTERM goes after its first chunk), and the server's log shows
    that the drain began with it in flight."""
    server = servers.get(model)
    n = 1500
    body = {"model": server.model, "prompt": "drain", "max_tokens": n, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, finish, usage, done = [], None, None, False
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=server.shutdown_timeout) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: "):
                chunk = json.loads(line[len(b"data: ") :])
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    text.append(c["text"])
                    finish = c["finish_reason"] or finish
                if len(text) == 1:
                    server.proc.send_signal(signal.SIGTERM)
                    _wait_for_log(server, "[shutdown] EngineCore: draining in-flight requests count=1")
                    late = requests.post(
                        server.url + "/v1/completions",
                        json={"model": server.model, "prompt": "late", "max_tokens": 2},
                        timeout=60,
                    )
                    assert late.status_code == 500 and "cannot schedule new futures after shutdown" in late.text
                    assert requests.get(server.url + "/health", timeout=60).status_code == 200  # not a readiness cue
    assert done and finish == "length" and usage["completion_tokens"] == n
    assert server.proc.wait(timeout=server.shutdown_timeout) == 0
