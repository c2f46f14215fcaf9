"""What the load generator sends and when: prompt/output length distributions, prompts, arrival times.

Lengths are counted in tokens. Random prompts are lists of token ids (the OpenAI completions API takes
them as `prompt`), so a prompt of length N is exactly N tokens whatever the tokenizer; for the chat API,
which only takes text, a prompt of length N is N random words (about N tokens, the server's `usage`
gives the exact count). A dataset file gives prompts verbatim.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts: `N` / `fixed:N`, `uniform:LO-HI` (inclusive), `file:PATH`.

    A file holds integers (whitespace, comma or newline separated, or a JSON list); lengths are drawn
    from them uniformly with replacement, i.e. from their empirical distribution.
    """

    kind: str
    lo: int
    hi: int
    values: tuple[int, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        spec = spec.strip()
        kind, _, arg = spec.partition(":")
        if not arg:
            kind, arg = "fixed", spec
        if kind == "fixed":
            n = int(arg)
            dist = cls("fixed", n, n)
        elif kind == "uniform":
            lo, sep, hi = arg.replace(",", "-").partition("-")
            if not sep:
                raise ValueError(f"uniform length needs LO-HI, got {spec!r}")
            dist = cls("uniform", int(lo), int(hi))
        elif kind == "file":
            text = Path(arg).read_text()
            try:
                raw = json.loads(text)
                values = [int(v) for v in (raw if isinstance(raw, list) else [raw])]
            except json.JSONDecodeError:
                values = [int(tok) for tok in text.replace(",", " ").split()]
            if not values:
                raise ValueError(f"{arg}: no lengths in the file")
            dist = cls("file", min(values), max(values), tuple(values))
        else:
            raise ValueError(f"unknown length distribution {spec!r}: use N, fixed:N, uniform:LO-HI or file:PATH")
        if dist.lo < 1 or dist.hi < dist.lo:
            raise ValueError(f"lengths must be >= 1 and LO <= HI, got {spec!r}")
        return dist

    def sample(self, n: int, rng: random.Random) -> list[int]:
        if self.kind == "fixed":
            return [self.lo] * n
        if self.kind == "uniform":
            return [rng.randint(self.lo, self.hi) for _ in range(n)]
        return [rng.choice(self.values) for _ in range(n)]

    @property
    def mean(self) -> float:
        if self.kind == "file":
            return sum(self.values) / len(self.values)
        return (self.lo + self.hi) / 2

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(self.lo)
        if self.kind == "uniform":
            return f"uniform:{self.lo}-{self.hi}"
        return f"file({len(self.values)} lengths, {self.lo}-{self.hi})"


@dataclass
class RequestSpec:
    """One request of the workload; `prompt_len` is None when only the server knows it (text prompts). For the chat
    endpoint `prompt` may also be a list of messages (a conversation so far)."""

    index: int
    prompt: str | list[int] | list[dict[str, str]]
    max_tokens: int
    prompt_len: int | None = None


# Plain ASCII words for text prompts: each is one token in byte-level and BPE vocabularies alike.
_WORDS = "the of and to in is was for on are with as at be by this from or have an they which one you were".split()


def random_requests(
    n: int,
    prompt_len: LengthDist,
    output_len: LengthDist,
    seed: int = 0,
    token_range: tuple[int, int] = (0, 256),
    text: bool = False,
) -> list[RequestSpec]:
    """`n` requests with random prompts: token ids drawn uniformly from `token_range` (or words if `text`)."""
    rng = random.Random(seed)
    plens, olens = prompt_len.sample(n, rng), output_len.sample(n, rng)
    lo, hi = token_range
    out = []
    for i in range(n):
        if text:
            prompt: str | list[int] = " ".join(rng.choice(_WORDS) for _ in range(plens[i]))
            out.append(RequestSpec(i, prompt, olens[i], None))
        else:
            prompt = [rng.randrange(lo, hi) for _ in range(plens[i])]
            out.append(RequestSpec(i, prompt, olens[i], plens[i]))
    return out


def dataset_requests(
    path: str | Path, n: int, output_len: LengthDist | None = None, seed: int = 0
) -> list[RequestSpec]:
    """Requests from a JSONL file of `{"prompt": str | [token ids], "output_tokens": int}` (vLLM's custom
    dataset format); rows are used in order and repeated when `n` exceeds them; `output_len`, if given,
    overrides `output_tokens`."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no rows")
    rng = random.Random(seed)
    olens = output_len.sample(n, rng) if output_len is not None else None
    out = []
    for i in range(n):
        row = rows[i % len(rows)]
        prompt = row["prompt"]
        max_tokens = olens[i] if olens is not None else int(row["output_tokens"])
        out.append(RequestSpec(i, prompt, max_tokens, len(prompt) if isinstance(prompt, list) else None))
    return out


def poisson_arrivals(
    n: int, rate: float, rng: random.Random, burstiness: float = 1.0, exact_total: bool = True
) -> list[float]:
    """Send times (seconds from the start) of `n` requests arriving at `rate` per second.

    Gaps are i.i.d. Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate, coefficient of
    variation 1/sqrt(burstiness); burstiness 1 is a Poisson process (exponential gaps), below 1 burstier,
    above 1 more regular. The first request waits one gap, as in `vllm bench serve`. With
    `exact_total` (vLLM's convention too) the times are rescaled so the last arrival is at exactly
    n/rate: every run offers exactly `rate` on average, and the measured throughput of a run below
    capacity does not swing with the random sum of the gaps (±1/sqrt(n) otherwise). rate=inf sends
    everything at once.
    """
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    if exact_total and out:
        scale = (n / rate) / out[-1]
        out = [x * scale for x in out]
    return out


def fixed_batches(n: int, batch_size: int) -> list[list[int]]:
    """Request indices in consecutive batches of `batch_size` (the last may be short): a batch is sent
    all at once and the next one only when every request of it has finished."""
    if batch_size < 1:
        raise ValueError("batch size must be >= 1")
    return [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
