"""The two sides of a gate behind one interface: an OpenAI-compatible endpoint (vLLM's completions API with
`prompt_logprobs`), transformers in this process, or vLLM in this process.

Every source scores one window of token ids at a time and yields `metrics.Scores` chunk by chunk, so the gate holds
at most one window's scores (the transformers source even one chunk's logits: it prefills the window through its
KV cache a chunk at a time). A source tokenizes and detokenizes with its own tokenizer and generates greedily for
the passkey cells.
"""

from __future__ import annotations

import json
import math
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from vllm_trn_plugin.gate.errors import GateError
from vllm_trn_plugin.gate.metrics import Scores, scores_from_logits
from vllm_trn_plugin.models import MODELS

FULL_VOCAB_LIMIT = 4096  # vLLM in process returns the full distribution (for the full-logit cosine) up to this vocab
PREFILL_CHUNK = 512  # prompt tokens per transformers forward when generating
DEFAULT_TIMEOUT = 3600.0  # s per request: a 32k-token prompt with logprobs on a CPU takes minutes


class Source:
    """One side of the gate. `full`: yields full logits; `max_len`: the most tokens a request may hold (prompt plus
    one generated token); `vocab_size`: None when unknown (an endpoint)."""

    kind = "?"
    full = False
    max_len = 0
    vocab_size: int | None = None

    def __init__(self, label: str, spec: str) -> None:
        self.label, self.spec = label, spec

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "spec": self.spec, "full_logits": self.full, "max_len": self.max_len}

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def score(self, tokens: list[int], top_k: int, chunk: int) -> Iterator[Scores]:
        """Positions 1..len(tokens)-1 of the window `tokens`, in order."""
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[str, list[int] | None]]:
        """Greedy continuations of token prompts, `max_tokens` each (EOS does not stop them, so that both sides'
        compare): (text, token ids; None where a server does not return them)."""
        raise NotImplementedError

    def decode_scored(self, prompt: list[int], max_tokens: int, top_k: int) -> tuple[list[int], Scores]:
        """A greedy continuation of `prompt` token by token (the decode path: one new token per step against the
        cache) and each step's distribution as Scores (positions len(prompt) + i; target: the chosen token)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


# ---- endpoint -----------------------------------------------------------------------------------------------------


class EndpointSource(Source):
    """An OpenAI-compatible server at `url` (http://host:port, with or without /v1)."""

    kind = "endpoint"

    def __init__(
        self, label: str, url: str, model: str | None, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        super().__init__(label, url)
        self.base = url.rstrip("/").removesuffix("/v1")
        self.api_key, self.timeout = api_key, timeout
        models = self._call("GET", "/v1/models", None, timeout=30)
        data = models.get("data") or []
        if not data:
            raise GateError(f"{label} {url}: /v1/models lists no model")
        ids = [m.get("id") for m in data]
        if model is not None and model not in ids:
            raise GateError(f"{label} {url}: serves {ids}, not --{label}-model {model}")
        self.model = model or ids[0]
        card = data[ids.index(self.model)]
        probe = self._call("POST", "/tokenize", {"model": self.model, "prompt": "a", "add_special_tokens": False})
        self.max_len = int(probe.get("max_model_len") or card.get("max_model_len") or 0)
        if self.max_len < 2:
            raise GateError(f"{label} {url}: cannot tell the model's context length (no max_model_len)")

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "model": self.model}

    def _call(self, method: str, path: str, body: dict[str, Any] | None, timeout: float | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        where = f"{self.label} endpoint {self.base}{path}"
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            if e.code == 404 and path == "/tokenize":
                raise GateError(
                    f"{where}: not found: the gate tokenizes through vLLM's /tokenize (is {self.base} a vLLM server?)"
                ) from None
            hint = ""
            if e.code == 400 and "logprobs" in detail:
                hint = " (lower --top-k, or serve with a larger --max-logprobs)"
            raise GateError(f"{where}: HTTP {e.code}: {detail}{hint}") from None
        except (urllib.error.URLError, OSError) as e:
            raise GateError(f"{where}: unreachable ({getattr(e, 'reason', e)})") from None
        except ValueError as e:
            raise GateError(f"{where}: the answer is not JSON ({e})") from None

    def encode(self, text: str) -> list[int]:
        return list(
            self._call("POST", "/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})[
                "tokens"
            ]
        )

    def score(self, tokens: list[int], top_k: int, chunk: int) -> Iterator[Scores]:
        body = {
            "model": self.model,
            "prompt": tokens,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": top_k,
        }
        out = self._call("POST", "/v1/completions", body)
        choices = out.get("choices") or [{}]
        plp = choices[0].get("prompt_logprobs")
        if not plp:
            raise GateError(
                f"{self.label} endpoint {self.base} (model {self.model}): the completion carries no prompt_logprobs; "
                "the gate needs vLLM's prompt_logprobs extension of the completions API (serve the model with vLLM)"
            )
        if len(plp) != len(tokens):
            raise GateError(
                f"{self.label} endpoint {self.base}: {len(plp)} prompt logprobs for a prompt of {len(tokens)} tokens"
            )
        yield from _from_logprob_dicts(plp, tokens, top_k, self.label)

    def decode_scored(self, prompt: list[int], max_tokens: int, top_k: int) -> tuple[list[int], Scores]:
        return _endpoint_decode(self, prompt, max_tokens, top_k)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[str, list[int] | None]]:
        texts = []
        for p in prompts:  # one at a time: a batch of long prompts would only queue on the server anyway
            body = {"model": self.model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0}
            body.update(ignore_eos=True, return_token_ids=True)
            choice = (self._call("POST", "/v1/completions", body).get("choices") or [{}])[0]
            ids = choice.get("token_ids")
            texts.append((str(choice.get("text", "")), None if ids is None else [int(t) for t in ids]))
        return texts


def _token_id(key: str, label: str) -> int:
    """A token of a completion's logprobs asked with return_tokens_as_token_ids: "token_id:123"."""
    if not key.startswith("token_id:"):
        raise GateError(f"{label}: the server ignores return_tokens_as_token_ids (token {key!r}); serve with vLLM")
    return int(key.removeprefix("token_id:"))


def _entry_logprob(v: Any) -> tuple[float, int | None]:
    """(logprob, rank) of one prompt-logprob entry: a JSON object (HTTP) or a vLLM Logprob."""
    if isinstance(v, dict):
        lp, rank = v.get("logprob"), v.get("rank")
    else:
        lp, rank = getattr(v, "logprob", None), getattr(v, "rank", None)
    lp = float(lp)
    return (-math.inf if lp <= -9999.0 else lp), rank  # vLLM clamps -inf to -9999 in JSON


def _endpoint_decode(
    source: EndpointSource, prompt: list[int], max_tokens: int, top_k: int
) -> tuple[list[int], Scores]:
    body = {
        "model": source.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": top_k,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
    }
    out = source._call("POST", "/v1/completions", body)
    lp = ((out.get("choices") or [{}])[0].get("logprobs")) or {}
    tops = lp.get("top_logprobs")
    if not tops:
        raise GateError(f"{source.label} endpoint {source.base}: the completion carries no logprobs")
    tokens = [_token_id(t, source.label) for t in lp["tokens"]]
    dicts = [{_token_id(k, source.label): {"logprob": v} for k, v in d.items()} for d in tops]
    for d, t, v in zip(dicts, tokens, lp["token_logprobs"]):
        d.setdefault(t, {"logprob": v})
    n = len(prompt)
    # As prompt logprobs of the sequence prompt + tokens, whose first n entries nothing reads.
    (sc,) = _from_logprob_dicts([None] * n + dicts, [0] * (n - 1) + [prompt[-1], *tokens], top_k, source.label, n)
    return tokens, sc


def _from_logprob_dicts(plp: list[Any], tokens: list[int], top_k: int, label: str, start: int = 1) -> Iterator[Scores]:
    """Scores of vLLM prompt logprobs (a list over the prompt, None first; each a {token id: entry} dict holding the
    actual token and the top-k by rank), positions `start`..len(tokens)-1."""
    n = len(tokens) - start
    target = np.empty(n)
    top_ids = np.full((n, top_k), -1, dtype=np.int64)
    top_lp = np.full((n, top_k), -np.inf)
    for p in range(start, len(tokens)):
        d = plp[p]
        if not d:
            raise GateError(f"{label}: no prompt logprobs at position {p}")
        entries = {int(t): _entry_logprob(v) for t, v in d.items()}
        if tokens[p] not in entries:
            raise GateError(f"{label}: the prompt logprobs at position {p} lack the prompt's token {tokens[p]}")
        target[p - start] = entries[tokens[p]][0]
        # Listed: the top-k and the actual token. When the actual token is outside the top-k its logprob is below
        # all of theirs, so the k best entries are the top-k either way.
        ranked = sorted(entries.items(), key=lambda kv: -kv[1][0])[:top_k]
        for j, (t, (lp, _)) in enumerate(ranked):
            top_ids[p - start, j], top_lp[p - start, j] = t, lp
    if top_k >= 2 and n and np.isinf(top_lp[:, 1]).all():
        raise GateError(f"{label}: the prompt logprobs hold one token per position; the gate needs the top {top_k}")
    yield Scores(np.arange(start, len(tokens)), target, top_ids, top_lp)


# ---- transformers -------------------------------------------------------------------------------------------------


def _read_config(d: Path, label: str) -> dict[str, Any]:
    f = d / "config.json"
    if not f.is_file():
        raise GateError(f"{label} {d}: no config.json (not a checkpoint directory)")
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise GateError(f"{f}: not valid JSON: {e}") from None


def densify_mla(src: Path, dst: Path) -> Path:
    """An MLA-Trinity checkpoint as the dense AFMoE transformers loads: on latent layers k_proj / v_proj =
    split(kv_b_proj @ kv_a_proj) (float64 product), which is what the latent attention computes; every other tensor
    copied; written shard by shard into `dst` (absent or empty)."""
    import torch

    from vllm_trn_plugin.loaders.io import Checkpoint, ShardWriter, StagedCheckpoint, copy_side_files, write_config

    with Checkpoint(src) as ckpt, StagedCheckpoint(dst, src) as out:
        cfg = dict(ckpt.config)
        kv = cfg["num_key_value_heads"] * (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        writer = ShardWriter(out)
        for name in ckpt.entries:
            if name.endswith("kv_b_proj.weight"):
                continue
            if name.endswith("kv_a_proj.weight"):
                p = name.removesuffix("kv_a_proj.weight")
                a, b = ckpt.get(name), ckpt.get(p + "kv_b_proj.weight")
                w = (b.double() @ a.double()).to(a.dtype)
                writer.add(p + "k_proj.weight", w[:kv].contiguous())
                writer.add(p + "v_proj.weight", w[kv:].contiguous())
            else:
                writer.add(name, ckpt.get(name))
        writer.finish()
        copy_side_files(src, out)
        del cfg["kv_lora_rank"]
        cfg["architectures"] = ["AfmoeForCausalLM"]
        write_config(out, cfg)
    _ = torch  # the checkpoint reader hands out torch tensors
    return Path(dst)


class TransformersSource(Source):
    """`AutoModelForCausalLM` of a checkpoint directory in this process (an MLA-Trinity checkpoint is loaded as its
    dense equivalent: `densify_mla`). Scores a window by prefilling it through the KV cache `chunk` tokens at a time,
    so attention and logits memory is one chunk's."""

    kind = "transformers"
    full = True

    def __init__(self, label: str, path: str, dtype: str = "float32") -> None:
        super().__init__(label, path)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        d = Path(path)
        cfg = _read_config(d, label)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        load = d
        if "kv_lora_rank" in cfg:
            self._tmp = tempfile.TemporaryDirectory(prefix="gate-dense-")
            load = densify_mla(d, Path(self._tmp.name))
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(d))
            self.model = AutoModelForCausalLM.from_pretrained(str(load), dtype=getattr(torch, dtype)).eval()
        except (OSError, ValueError, KeyError) as e:
            raise GateError(f"{label} {path}: transformers cannot load it: {e}") from None
        self.torch = torch
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 20)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def score(self, tokens: list[int], top_k: int, chunk: int) -> Iterator[Scores]:
        torch = self.torch
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([tokens])
        with torch.no_grad():
            for a in range(0, len(tokens) - 1, chunk):
                b = min(a + chunk, len(tokens) - 1)  # the last token predicts nothing in the window
                out = self.model(
                    input_ids=ids[:, a:b],
                    past_key_values=cache,
                    use_cache=True,  # positions follow from the cache's length
                )
                cache = out.past_key_values
                logits = out.logits[0].double().numpy()
                yield scores_from_logits(np.arange(a + 1, b + 1), np.asarray(tokens[a + 1 : b + 1]), logits, top_k)

    def decode_scored(self, prompt: list[int], max_tokens: int, top_k: int) -> tuple[list[int], Scores]:
        torch = self.torch
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        rows, tokens = [], []
        with torch.no_grad():
            for a in range(0, len(prompt), PREFILL_CHUNK):  # chunked like `score`: bounded attention memory
                out = self.model(
                    input_ids=torch.tensor([prompt[a : a + PREFILL_CHUNK]]),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                cache = out.past_key_values
            for step in range(max_tokens):
                logits = out.logits[0, -1].double()
                tok = int(torch.argmax(logits))
                rows.append(logits.numpy())
                tokens.append(tok)
                if step + 1 < max_tokens:
                    out = self.model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
                    cache = out.past_key_values
        pos = np.arange(len(prompt), len(prompt) + max_tokens)
        return tokens, scores_from_logits(pos, np.asarray(tokens), np.stack(rows), top_k)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[str, list[int] | None]]:
        out = []
        for p in prompts:
            tokens, _ = self.decode_scored(p, max_tokens, 2)
            out.append((self.tokenizer.decode(tokens, skip_special_tokens=True), tokens))
        return out

    def close(self) -> None:
        self.model = None
        if self._tmp is not None:
            self._tmp.cleanup()


# ---- vLLM in process ----------------------------------------------------------------------------------------------


class VLLMSource(Source):
    """A vLLM engine in this process on a checkpoint directory (the plugin's models, or any vLLM serves). Full
    distributions when the vocabulary has at most FULL_VOCAB_LIMIT tokens, else the top-k like an endpoint."""

    kind = "vllm"

    def __init__(self, label: str, path: str, dtype: str, max_len: int, top_k: int) -> None:
        super().__init__(label, path)
        cfg = _read_config(Path(path), label)
        vocab = int(cfg.get("vocab_size") or 0)
        self.vocab_size = vocab or None
        self.full = 0 < vocab <= FULL_VOCAB_LIMIT
        limit = int(cfg.get("max_position_embeddings") or max_len)
        self.max_len = min(max_len, limit)
        from vllm import LLM

        from vllm_trn_plugin.compat import CPU_DEFAULT_CACHE_BYTES, ensure_vllm_version_lookup

        ensure_vllm_version_lookup()
        kw: dict[str, Any] = dict(
            model=path,
            dtype=dtype,
            max_model_len=self.max_len,
            max_logprobs=vocab if self.full else top_k,
            enforce_eager=True,
            seed=0,
        )
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            kw["kv_cache_memory_bytes"] = CPU_DEFAULT_CACHE_BYTES
        try:
            self.llm: Any = LLM(**kw)
        except Exception as e:  # vLLM raises many types for a checkpoint it cannot serve
            raise GateError(f"{label} {path}: vLLM cannot start on it: {type(e).__name__}: {e}") from None
        self.tokenizer = self.llm.get_tokenizer()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def score(self, tokens: list[int], top_k: int, chunk: int) -> Iterator[Scores]:
        from vllm import SamplingParams

        k = self.vocab_size if self.full else top_k
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
        out = self.llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0]
        plp = out.prompt_logprobs
        if not self.full:
            yield from _from_logprob_dicts(plp, tokens, top_k, self.label)
            return
        for a in range(1, len(tokens), chunk):  # dense [chunk, vocab] rows from the dicts, a chunk at a time
            b = min(a + chunk, len(tokens))
            logits = np.full((b - a, k), -np.inf)
            for i, p in enumerate(range(a, b)):
                for t, v in plp[p].items():
                    logits[i, int(t)] = v.logprob
            yield scores_from_logits(np.arange(a, b), np.asarray(tokens[a:b]), logits, top_k)

    def decode_scored(self, prompt: list[int], max_tokens: int, top_k: int) -> tuple[list[int], Scores]:
        from vllm import SamplingParams

        k = self.vocab_size if self.full else top_k
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=k, ignore_eos=True)
        c = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        tokens, n = list(c.token_ids), len(prompt)
        if not self.full:
            (sc,) = _from_logprob_dicts(
                [None] * n + list(c.logprobs), [0] * (n - 1) + [prompt[-1], *tokens], k, self.label, n
            )
            return tokens, sc
        logits = np.full((len(tokens), k), -np.inf)
        for i, d in enumerate(c.logprobs):
            for t, v in d.items():
                logits[i, int(t)] = v.logprob
        return tokens, scores_from_logits(np.arange(n, n + len(tokens)), np.asarray(tokens), logits, top_k)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[str, list[int] | None]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]

    def close(self) -> None:
        import gc

        self.llm = None
        gc.collect()


# ---- choosing -----------------------------------------------------------------------------------------------------


def source_kind(spec: str) -> tuple[str, str]:
    """(kind, location) of a --reference / --candidate value: an http(s) URL is an endpoint; `transformers:DIR` and
    `vllm:DIR` name the local runner; a bare DIR runs in vLLM when its architecture is one of the plugin's, else in
    transformers."""
    if spec.startswith(("http://", "https://")):
        return "endpoint", spec
    for kind in ("transformers", "vllm"):
        if spec.startswith(kind + ":"):
            return kind, spec[len(kind) + 1 :]
    d = Path(spec)
    if not d.is_dir():
        raise GateError(f"{spec}: neither an http(s) URL nor a checkpoint directory")
    arch = (_read_config(d, spec).get("architectures") or [""])[0]
    return ("vllm" if arch in MODELS else "transformers"), spec


def open_source(
    label: str,
    spec: str,
    *,
    model: str | None = None,
    api_key: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    dtype: str = "float32",
    max_len: int = 32768,
    top_k: int = 20,
) -> Source:
    kind, where = source_kind(spec)
    if kind == "endpoint":
        return EndpointSource(label, where, model, api_key, timeout)
    if not Path(where).is_dir():
        raise GateError(f"{label} {where}: not a checkpoint directory")
    if kind == "transformers":
        return TransformersSource(label, where, dtype)
    return VLLMSource(label, where, dtype, max_len, top_k)
