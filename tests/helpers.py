"""Helpers the tests share: prompts, sampling parameters, reading checkpoints, counting calls, and the session
engine's settings (the fixtures themselves live in conftest.py)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

POOL_SLOTS = 40  # state pages in the session engine's pool
MAX_NUM_SEQS = 64  # more than the pool holds: admission is limited by free pages
TOKEN_BUDGET = 256  # max_num_batched_tokens: prompts longer than this are prefilled in chunks


def read_safetensors_dir(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in d."""
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def random_prompts(n: int, lengths: list[int], seed: int, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def greedy_params(max_tokens: int, logprobs: int = 2):  # noqa: ANN201
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=True)


def greedy_logits(
    llm: object, prompts: list[list[int]], steps: int, vocab: int
) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy tokens and the full logits [steps, vocab] each was chosen from (an engine built with
    `max_logprobs=vocab` and `logprobs_mode="raw_logits"`)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0.0, logprobs=vocab, ignore_eos=True)
    out = []
    for o in llm.generate(token_prompts(prompts), params, use_tqdm=False):
        c = o.outputs[0]
        logits = torch.full((len(c.token_ids), vocab), -math.inf, dtype=torch.float64)
        for i, top in enumerate(c.logprobs):
            for tok, lp in top.items():
                logits[i, tok] = lp.logprob
        out.append((list(c.token_ids), logits))
    return out


def count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Wrap module.name so its calls are counted (calls[0]): proves a path really ran."""
    calls = [0]
    original = getattr(module, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@contextlib.contextmanager
def worker_functions_allowed() -> Iterator[None]:
    """While open, `LLM.apply_model` may ship a function to vLLM's worker process (vLLM refuses to serialise
    functions otherwise); the engine must be created inside it, as its processes read the switch at start.

    The CPU thread binding is the plugin's to choose inside (engine_checks.bind_cpu_workers, for an engine of two
    workers) and is put back as it was on exit, so that later engines in the session choose their own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        mp.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        yield


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


# Probes run first on the fresh engine, and again after the other tests have reused every slot.
PROBES = random_prompts(3, [9, 200, 300], seed=99)
PROBE_TOKENS = 12
