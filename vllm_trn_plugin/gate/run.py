"""One gate run: both sides over the same token windows, then the passkey grid, then the verdict."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_trn_plugin.gate import passkey as pk_mod
from vllm_trn_plugin.gate.errors import GateError
from vllm_trn_plugin.gate.inputs import TokenInput, check_vocab
from vllm_trn_plugin.gate.metrics import DEFAULT_BUCKETS, Accumulator, Scores, Thresholds, judge, paired
from vllm_trn_plugin.gate.sources import Source
from vllm_trn_plugin.gate.ties import TIE_MARGIN

# Both tokenizers must turn these into the same ids (with the text's own beginning).
PROBES = ("The quick brown fox jumps over the lazy dog 0123456789.", "  naïve café — 東京 🚀\n\tdef f(x): return x**2")
MIN_BUCKET_POSITIONS = 16  # a bucket scored on fewer positions says nothing: the text is too short for it


@dataclass
class GateOptions:
    text: str | None = None
    tokens: str | None = None
    max_tokens: int | None = None
    window: int | None = None  # default: the longest both sides allow, at most the last bucket edge
    buckets: Sequence[int] = DEFAULT_BUCKETS
    top_k: int = 20
    chunk: int = 512  # positions per scored chunk of a local side: bounds its logits memory
    tie_margin: float = TIE_MARGIN
    thresholds: Thresholds = field(default_factory=Thresholds)
    decode_prompts: int = 8  # greedy continuations of the candidate, each scored by the reference (0: none)
    decode_context: int = 1024  # tokens of text before each continuation
    decode_tokens: int = 64
    passkey: bool = True
    passkey_lengths: Sequence[int] = pk_mod.DEFAULT_LENGTHS
    passkey_depths: Sequence[float] = pk_mod.DEFAULT_DEPTHS
    seed: int = 0
    progress: bool = True


def _log(opts: GateOptions, msg: str) -> None:
    if opts.progress:
        print(f"gate: {msg}", file=sys.stderr, flush=True)


def check_tokenizers(ref: Source, cand: Source, sample: str) -> None:
    """The two sides must tokenize alike, or their scores are about different token streams."""
    for probe in (*PROBES, sample):
        a, b = ref.encode(probe), cand.encode(probe)
        if a != b:
            i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise GateError(
                f"tokenizer mismatch: the reference ({ref.spec}) and the candidate ({cand.spec}) tokenize "
                f"{probe[:40]!r} differently (from token {i}: {a[i : i + 4]} vs {b[i : i + 4]}); gate models that "
                "share a tokenizer"
            )


def _both(ref_call: Any, cand_call: Any, parallel: bool) -> tuple[Any, Any]:
    if not parallel:
        return ref_call(), cand_call()
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(ref_call), pool.submit(cand_call)
        return a.result(), b.result()


def _window_pairs(ref: Source, cand: Source, window: list[int], opts: GateOptions) -> Iterator[tuple[Scores, Scores]]:
    if ref.kind == cand.kind == "endpoint":  # two servers: score at the same time
        a, b = _both(
            lambda: list(ref.score(window, opts.top_k, opts.chunk)),
            lambda: list(cand.score(window, opts.top_k, opts.chunk)),
            True,
        )
        yield from paired(iter(a), iter(b))
        return
    yield from paired(ref.score(window, opts.top_k, opts.chunk), cand.score(window, opts.top_k, opts.chunk))


def plan_buckets(edges: Sequence[int], window: int, longest: int, where: str) -> tuple[list[int], list[str]]:
    """The bucket edges the run scores and notes on those dropped. Buckets starting at or beyond the window are
    dropped (the models allow no such context); a kept bucket the text cannot fill is an error."""
    notes = []
    keep = [e for e in edges if e < window]
    if len(keep) < len(edges):
        keep.append(min(edges[len(keep)], window))
    if window < edges[-1]:
        notes.append(f"buckets cut at {window} tokens: the window (what both models allow, or --window)")
    if len(keep) < 2:
        raise GateError(f"--buckets {','.join(map(str, edges))}: no bucket starts below the window ({window})")
    for lo, hi in zip(keep, keep[1:]):
        have = max(0, min(hi, longest) - max(lo, 1))
        if have < MIN_BUCKET_POSITIONS:
            raise GateError(
                f"{where}: too short for bucket {lo}-{hi}: its longest window has {longest} tokens, so the bucket "
                f"gets {have} scored positions (at least {MIN_BUCKET_POSITIONS} needed); pass a longer text (at "
                f"least {max(lo, 1) + MIN_BUCKET_POSITIONS} tokens) or fewer --buckets"
            )
    return keep, notes


def run_gate(ref: Source, cand: Source, opts: GateOptions) -> dict[str, Any]:
    """Measure, judge and return the report (the verdict in report["verdict"]). Raises GateError on bad input."""
    t0 = time.perf_counter()
    if opts.top_k < 2:
        raise GateError(f"--top-k {opts.top_k}: at least 2 (the top-2 margin decides near-ties)")
    notes: list[str] = []
    text = TokenInput(opts.text, opts.tokens, ref.encode, opts.max_tokens)
    sample = next(iter(_sample(text)), "")
    check_tokenizers(ref, cand, sample)
    allowed = min(ref.max_len, cand.max_len) - 1  # a request holds the window and one generated token
    window = min(allowed, opts.window or allowed, max(opts.buckets))
    if window < 2:
        raise GateError(f"--window {window}: at least 2 tokens")
    lengths = text.window_lengths(window)
    if not lengths:
        raise GateError(f"{text.path}: {text.total} tokens: nothing to score")
    edges, bucket_notes = plan_buckets(opts.buckets, window, max(lengths), str(text.path))
    notes += bucket_notes
    full = ref.full and cand.full
    acc = Accumulator(edges, opts.tie_margin, full)
    _log(opts, f"{text.total} tokens in {len(lengths)} window(s) of up to {window}; {ref.kind} vs {cand.kind}")
    offset = 0
    for w, toks in enumerate(text.windows(window)):
        for side in (ref, cand):
            check_vocab(toks, side.vocab_size, side.label, offset)
        tw = time.perf_counter()
        for a, b in _window_pairs(ref, cand, toks, opts):
            acc.add(a, b, f"window {w + 1}")
        offset += len(toks)
        _log(opts, f"window {w + 1}/{len(lengths)} ({len(toks)} tokens) scored in {time.perf_counter() - tw:.1f} s")
    t_score = time.perf_counter() - t0

    th = opts.thresholds
    summaries = [b.summary() for b in acc.buckets]
    overall = acc.total().summary()
    failures = [f for s in [*summaries, overall] for f in judge(s, th, full)]
    decode = None
    if opts.decode_prompts > 0:
        decode = decode_check(ref, cand, text, window, opts)
        failures += judge(decode, th, full)
    t_decode = time.perf_counter() - t0 - t_score

    pk: dict[str, Any] | None = None
    if opts.passkey:
        limit = allowed + 1 - pk_mod.ANSWER_TOKENS
        keep, dropped = pk_mod.fitting_lengths(opts.passkey_lengths, limit)
        if dropped:
            notes.append(f"passkey lengths {dropped} exceed what the models allow; tested up to {limit} tokens")
        grid = pk_mod.cells(ref.encode, keep, opts.passkey_depths, opts.seed)
        _log(opts, f"passkey: {len(grid)} cells, lengths {keep}")
        prompts = [c.prompt for c in grid]
        r_out, c_out = _both(
            lambda: ref.generate(prompts, pk_mod.ANSWER_TOKENS),
            lambda: cand.generate(prompts, pk_mod.ANSWER_TOKENS),
            ref.kind == cand.kind == "endpoint",
        )
        pk = pk_mod.score_grid(grid, r_out, c_out)
        pk["lengths"], pk["depths"] = keep, list(opts.passkey_depths)
        if pk["misses"] > th.max_passkey_misses:
            failures.append(
                f"passkey: the candidate misses {pk['misses']} cell(s) the reference retrieves "
                f"(at most {th.max_passkey_misses} allowed)"
            )
        if pk["reference_retrieved"] == 0:
            notes.append(
                "passkey: the reference retrieves no key, so this check cannot fail here (a random or small model)"
            )
    metric = "full-logit cosine and KL" if full else f"top-{opts.top_k} logit cosine and KL on the shared support"
    return {
        "verdict": "fail" if failures else "pass",
        "failures": failures,
        "notes": notes,
        "reference": ref.describe(),
        "candidate": cand.describe(),
        "logit_metric": metric,
        "full_logits": full,
        "tie_margin": opts.tie_margin,
        "thresholds": th.__dict__,
        "text": {"path": str(text.path), "tokens": text.total, "window": window, "windows": len(lengths)},
        "buckets": summaries,
        "overall": overall,
        "decode": decode,
        "passkey": pk,
        "seconds": {
            "scoring": round(t_score, 2),
            "decode": round(t_decode, 2),
            "passkey": round(time.perf_counter() - t0 - t_score - t_decode, 2),
            "total": round(time.perf_counter() - t0, 2),
        },
    }


def decode_check(ref: Source, cand: Source, text: TokenInput, window: int, opts: GateOptions) -> dict[str, Any]:
    """The decode path, which teacher-forced scoring never runs: the candidate continues `decode_prompts` stretches
    of the text greedily, token by token against its cache, with each step's distribution; the reference scores the
    same tokens teacher-forced. Same metrics, one bucket "decode"; its NLLs are the sampled perplexity of the
    candidate's continuations under each side."""
    gen = opts.decode_tokens
    ctx = min(opts.decode_context, window - gen)
    if ctx < 1:
        raise GateError(f"--decode-tokens {gen}: no room for a prompt in a window of {window}")
    prompts: list[list[int]] = []
    buf: list[int] = []
    for t in text.ids():
        buf.append(t)
        if len(buf) == ctx:
            prompts.append(buf)
            buf = []
            if len(prompts) == opts.decode_prompts:
                break
    if not prompts:
        raise GateError(f"{text.path}: {text.total} tokens, fewer than one --decode-context ({ctx}) prompt")
    full = ref.full and cand.full
    acc = Accumulator([0, ctx + gen], opts.tie_margin, full)
    for i, p in enumerate(prompts):
        tokens, got = cand.decode_scored(p, gen, opts.top_k)
        if len(tokens) != gen:
            raise GateError(f"candidate: {len(tokens)} tokens generated, {gen} asked for")
        want = (
            c.slice(int(np.searchsorted(c.positions, ctx)), len(c))
            for c in ref.score(p + tokens, opts.top_k, opts.chunk)
        )
        for a, b in paired(want, iter([got])):
            acc.add(a, b, f"continuation {i + 1}")
    _log(opts, f"decode: {len(prompts)} continuations of {gen} tokens after {ctx}")
    summary = acc.buckets[0].summary()
    summary["bucket"] = "decode"
    summary["prompts"], summary["context"], summary["tokens"] = len(prompts), ctx, gen
    return summary


def _sample(text: TokenInput) -> Iterator[str]:
    """The text's first 2000 characters (a text file only): also checked for equal tokenization."""
    if text.is_text:
        with open(text.path, encoding="utf-8", errors="replace") as f:
            yield f.read(2000)
