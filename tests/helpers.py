"""Helpers the tests share: prompts, sampling parameters, reading checkpoints, counting calls, and the session
engine's settings (the fixtures themselves live in conftest.py)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_trn_plugin.gate.ties import compare_greedy

POOL_SLOTS = 40  # state pages in the session engine's pool
MAX_NUM_SEQS = 64  # more than the pool holds: admission is limited by free pages
TOKEN_BUDGET = 256  # max_num_batched_tokens: prompts longer than this are prefilled in chunks
# Nats, float32 engines: how far a chosen token's logprob may move when only the summation order changes (batch
# composition, how a prompt is split into chunks or restored from a cached prefix).
LOGPROB_TOL = 1e-4
# The same for an FP8 latent cache: float32 noise can move a latent element across an FP8 rounding midpoint (one code
# step, 2^-3 of that element), which moves the logits by up to ~1e-3 on the test models.
FP8_LATENT_LOGIT_TOL = 5e-3


TRN2 = Path(__file__).resolve().parents[1] / "deploy" / "trn2"


def laplace_engine(ckpt: Path, **overrides: object):  # noqa: ANN201
    """A float32 vLLM engine on the Laplace checkpoint `ckpt` with the session engine's settings (conftest.laplace_llm:
    POOL_SLOTS state pages, MAX_NUM_SEQS sequences, TOKEN_BUDGET-token batches, statistics on, seed 0); `overrides`
    replace or add LLM arguments."""
    from vllm import LLM

    from tests.references.laplace import LaplaceReference

    cfg = LaplaceReference(ckpt).cfg
    page = (
        cfg["num_hidden_layers"]
        * 4
        * (cfg["num_heads"] * cfg["head_k_dim"] * cfg["head_v_dim"] + (cfg["conv_size"] - 1) * cfg["hidden_size"])
    )
    args = dict(
        model=str(ckpt),
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=TOKEN_BUDGET,
        kv_cache_memory_bytes=POOL_SLOTS * page,
        disable_log_stats=False,
        seed=0,
    )
    return LLM(**(args | overrides))


def trn2_recipe_argv(model: str, ckpt: str | Path = "/models/x", env: dict[str, str] | None = None) -> list[str]:
    """The `vllm serve` command line deploy/trn2/serve-replica.sh prints for `model` (`--print`: runs nothing)."""
    import os
    import shlex
    import subprocess

    printed = subprocess.run(
        [str(TRN2 / "serve-replica.sh"), model, str(ckpt), "--print"],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return shlex.split(printed)


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


def chosen_steps(out) -> tuple[list[int], list[float], list[float]]:  # noqa: ANN001
    """From a vLLM RequestOutput sampled with logprobs: the chosen tokens, each one's logprob (a raw logit under
    logprobs_mode="raw_logits"), and each step's top-1 minus top-2 margin (inf with one candidate)."""
    c = out.outputs[0]
    values, margins = [], []
    for tok, top in zip(c.token_ids, c.logprobs):
        values.append(top[tok].logprob)
        ranked = sorted((x.logprob for x in top.values()), reverse=True)
        margins.append(ranked[0] - ranked[1] if len(ranked) > 1 else math.inf)
    return list(c.token_ids), values, margins


def check_batched_against_alone(
    what: str, tokens: list[int], values: list[float], alone: tuple[list[int], list[float], list[float]], tol: float
) -> None:
    """A prompt's greedy run inside a batch against its run alone (tokens, per-step values, top-2 margins): the
    tokens equal up to where they part at a near-tie (the tie rule, bench.ties), and each step's value (logprob or
    logit of the chosen token) within `tol` before that."""
    a_tokens, a_values, a_margins = alone
    agreement = compare_greedy(tokens, a_tokens, a_margins)
    assert agreement.ok, f"{what}: step {agreement.step} differs from its run alone, not at a near-tie"
    n = len(tokens) if agreement.step is None else agreement.step
    err = max((abs(x - y) for x, y in zip(values[:n], a_values[:n])), default=0.0)
    assert err <= tol, f"{what}: value differs by {err:.2e} from its run alone"


# Probes run first on the fresh engine, and again after the other tests have reused every slot.
PROBES = random_prompts(3, [9, 200, 300], seed=99)
PROBE_TOKENS = 12


def raw_logits_llm(model: str | Path, vocab: int, **overrides: object):  # noqa: ANN201
    """A float32 vLLM engine on checkpoint `model` whose sampled steps carry the full raw logits (`greedy_logits`
    with `vocab`): small batches, 256 MiB of cache, seed 0, eager (torch.compile's cold start costs a minute or two
    per engine; the session Laplace engine and test_trinity_vllm.py's engine serve compiled); `overrides` replace or
    add LLM arguments."""
    from vllm import LLM

    args = dict(
        model=str(model),
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        max_logprobs=vocab,
        logprobs_mode="raw_logits",
        kv_cache_memory_bytes=256 << 20,
        seed=0,
        enforce_eager=True,
    )
    return LLM(**{**args, **overrides})


def served_greedy_logits(
    model: str | Path, prompts: list[list[int]], steps: int, vocab: int, **overrides: object
) -> list[tuple[list[int], torch.Tensor]]:
    """`greedy_logits` of `prompts` from a fresh `raw_logits_llm`, shut down before returning."""
    llm = raw_logits_llm(model, vocab, **overrides)
    try:
        return greedy_logits(llm, prompts, steps, vocab)
    finally:
        del llm


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two tensors taken as flat vectors."""
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


_LOAD_ALL = """
import json, sys, tempfile
from vllm.config import set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader import get_model_loader
from vllm_trn_plugin import register

def config(ckpt):
    return EngineArgs(model=ckpt, dtype="float32", max_model_len=256, enforce_eager=True).create_engine_config()

register()
results = {}
for i, ckpt in enumerate(sys.argv[1:]):
    vc = config(ckpt)
    if i == 0:  # the first checkpoint's config sets up vLLM's parallel groups
        with set_current_vllm_config(vc):
            init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
            ensure_model_parallel_initialized(1, 1)
    try:
        with set_current_vllm_config(vc):
            loader = get_model_loader(vc.load_config)
            loader.load_weights(loader.create_model(vllm_config=vc, model_config=vc.model_config), vc.model_config)
        results[ckpt] = "loaded"
    except Exception as e:
        results[ckpt] = f"{type(e).__name__}: {e}"
print("RESULTS" + json.dumps(results))
"""


def load_in_child(ckpts: list[str], timeout: float = 900) -> dict[str, str]:
    """Build and load each checkpoint directory with vLLM's own default loader (float32, eager) in one child
    process, so that this process never initialises vLLM's distributed state: "loaded", or the error's type and
    message, by checkpoint. The first checkpoint's config sets up vLLM's parallel groups (a MoE model needs its
    expert-parallel group), so it should be a MoE checkpoint when any is."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _LOAD_ALL, *ckpts], capture_output=True, text=True, timeout=timeout)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS")]
    assert line, f"loader script failed:\n{proc.stderr[-3000:]}"
    return json.loads(line[0].removeprefix("RESULTS"))


def run_with_aborts(
    engine: Any, prompts: list[list[int]], params: Any, mid_prefill: set[int], mid_decode: set[int], after: int
) -> dict[int, Any]:
    """Submit `prompts` to a vLLM LLMEngine and step it until nothing is left, aborting the requests in
    `mid_prefill` (indices; each must still be prefilling after the first step) after that step and each in
    `mid_decode` once it has `after` output tokens. Returns the finished outputs by prompt index: every prompt but
    the aborted ones."""
    for i, p in enumerate(prompts):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": p}, params)
    finished: dict[int, Any] = {}
    aborted: set[int] = set()
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = int(out.request_id.split("-")[1])
            assert i not in mid_prefill or steps > 0, f"prompt {i} ({len(prompts[i])} tokens) prefilled in one step"
            if out.finished:
                finished[i] = out
            elif i in mid_decode and len(out.outputs[0].token_ids) >= after and i not in aborted:
                engine.abort_request([out.request_id])
                aborted.add(i)
        if steps == 0:
            engine.abort_request([f"abort-{i}" for i in sorted(mid_prefill)])
            aborted |= mid_prefill
        steps += 1
        assert steps < 10_000
    assert aborted == mid_prefill | mid_decode, aborted
    assert set(finished) == set(range(len(prompts))) - aborted, sorted(finished)
    return finished
