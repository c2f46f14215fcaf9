"""`vllm-trn serve` on each demo checkpoint, driven by a real OpenAI client over real HTTP."""

from __future__ import annotations

import pytest
import requests
from openai import OpenAI

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", params=["laplace", "mla-trinity"])
def server(request, servers):  # noqa: ANN001, ANN201
    return servers.get(request.param)


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions(client, server) -> None:
    args = dict(model=server.model, prompt="Hello, Trainium", max_tokens=8, temperature=0)
    r = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    again = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic across requests


def test_completions_streaming_equals_non_streaming(client, server) -> None:
    args = dict(model=server.model, prompt="stream me", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    pieces = [c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].text


def test_chat_completions(client, server) -> None:
    msgs = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
    stream = client.chat.completions.create(
        model=server.model, messages=msgs, max_tokens=10, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content


MALFORMED = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 2}),  # token id far outside the vocabulary
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**7}),  # beyond max_model_len
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),
    ("/v1/chat/completions", {"messages": "not a list"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**7}),
]


@pytest.mark.parametrize("path,body", MALFORMED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(MALFORMED)])
def test_malformed_requests_get_4xx_and_server_stays_up(server, path: str, body) -> None:
    url = server.url + path
    if isinstance(body, bytes):
        r = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=60)
    else:
        r = requests.post(url, json={"model": server.model, **body}, timeout=60)
    assert 400 <= r.status_code < 500, f"{path} {body!r}: HTTP {r.status_code} {r.text[:300]}"
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    ok = requests.post(
        server.url + "/v1/completions",
        json={"model": server.model, "prompt": "still alive?", "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200 and server.proc.poll() is None
