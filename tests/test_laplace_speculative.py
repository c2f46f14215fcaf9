"""Laplace under vLLM's n-gram (prompt lookup) speculative decoding, served by real vLLM: greedy output with
speculation equals the output without it (the session engine, conftest.laplace_llm; the tie rule and LOGPROB_TOL, as
batched runs are held to their runs alone) and the float64 per-token reference's tokens.

A verification step feeds each request its last token and up to k drafts. The mixer computes them from the state,
moves the state over the first (never a draft) and keeps the drafts' keys, values and conv inputs in the state page;
the next step, once vLLM has accepted some, moves the state over exactly those (LaplaceMixer.mix_speculative). A
rejected draft left in the state, or an accepted one left out, changes every later token. The prompts make the drafts
land in full, in part and not at all; vLLM's acceptance counters prove each case occurred. One state page per
sequence: a pool of N pages of the size the geometry predicts (state + k tokens' inputs) admits N - 1 requests at
once (vLLM keeps a null page), no more.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    LOGPROB_TOL,
    check_batched_against_alone,
    chosen_steps,
    greedy_params,
    laplace_engine,
    random_prompts,
    run_with_aborts,
    token_prompts,
)
from tests.references.laplace import LaplaceReference, assert_same_greedy

pytestmark = pytest.mark.vllm

STEPS = 40
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# 300 and 517: prefilled in chunks (256-token batches); 1: a one-token prompt is a "decode" row from its first step;
# the last two repeat a short motif, which prompt lookup proposes from the first step.
PROMPTS = random_prompts(7, [9, 40, 130, 300, 1, 517, 17], seed=5) + [p * 6 for p in random_prompts(2, [8, 5], seed=6)]
ALONE = (0, 3, 8)
PAGES = 12  # the speculating engine's pool: fewer pages than requests in the abort test, so pages are reused


def page_bytes(cfg: dict[str, Any], pending: int, dtype_bytes: int = 4) -> int:
    """One layer's state page as the geometry predicts it: the fp32 GLA state and the conv window, then `pending`
    tokens' keys, values and conv inputs and two int32 counters."""
    H, dk, dv, D = cfg["num_heads"], cfg["head_k_dim"], cfg["head_v_dim"], cfg["hidden_size"]
    state = 4 * H * dk * dv + dtype_bytes * (cfg["conv_size"] - 1) * D
    return state + dtype_bytes * pending * (H * dk + H * dv + D) + 8


def pool_bytes(ckpt: Path, pages: int) -> int:
    cfg = LaplaceReference(ckpt).cfg
    return pages * cfg["num_hidden_layers"] * page_bytes(cfg, K)


@pytest.fixture(scope="module")
def spec_llm(laplace_ckpt: Path) -> Any:
    llm = laplace_engine(
        laplace_ckpt,
        speculative_config=NGRAM,
        kv_cache_memory_bytes=pool_bytes(laplace_ckpt, PAGES),
        enforce_eager=True,
    )
    yield llm
    del llm
    gc.collect()


def _counters(llm: Any) -> tuple[float, list[float]]:
    """vLLM's cumulative speculation counters: drafts proposed, accepted tokens per draft position."""
    m = {x.name: x for x in llm.get_metrics()}
    per_pos = m.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    drafts = m["vllm:spec_decode_num_drafts"].value if "vllm:spec_decode_num_drafts" in m else 0.0
    return drafts, list(per_pos.values) if per_pos is not None else [0.0] * K


def _check(what: str, outs: list[Any], refs: dict[int, Any], idx: list[int]) -> None:
    """Each output against the reference of its prompt (PROMPTS index)."""
    for i, out in zip(idx, outs, strict=True):
        toks, lps, _ = chosen_steps(out)
        assert len(toks) == STEPS, f"{what}, prompt {i}: {len(toks)} tokens"
        check_batched_against_alone(f"{what}, prompt {i} ({len(PROMPTS[i])} tokens)", toks, lps, refs[i], LOGPROB_TOL)


@pytest.fixture(scope="module")
def refs(laplace_llm: Any) -> dict[int, Any]:
    """The prompts on the session engine (no speculation), batched."""
    outs = laplace_llm.llm.generate(token_prompts(PROMPTS), greedy_params(STEPS), use_tqdm=False)
    return {i: chosen_steps(o) for i, o in enumerate(outs)}


def test_ngram_speculation_equals_greedy_without_it(
    spec_llm: Any, refs: dict[int, Any], laplace_llm: Any, laplace_ref: LaplaceReference
) -> None:
    """Batched, then alone: the speculating engine's tokens and logprobs are those of the engine without
    speculation, its tokens the float64 reference's; the drafts were accepted in full, in part and not at all."""
    d0, p0 = _counters(spec_llm)
    idx = list(range(len(PROMPTS)))
    outs = spec_llm.generate(token_prompts(PROMPTS), greedy_params(STEPS), use_tqdm=False)
    _check("batched", outs, refs, idx)
    d1, p1 = _counters(spec_llm)
    drafts, per_pos = d1 - d0, [x - y for x, y in zip(p1, p0)]
    print(f"\n{drafts:.0f} drafts, {sum(per_pos):.0f} draft tokens accepted ({per_pos} by position)")
    assert per_pos[K - 1] > 0, "no draft was accepted in full"
    assert per_pos[0] < drafts, "every draft's first token was accepted: none rejected outright"
    assert per_pos[0] > per_pos[K - 1], "no draft was accepted in part"
    for i in ALONE:
        assert_same_greedy(list(outs[i].outputs[0].token_ids), laplace_ref.greedy(PROMPTS[i], STEPS), f"prompt {i}")
        alone = laplace_llm.llm.generate(token_prompts([PROMPTS[i]]), greedy_params(STEPS), use_tqdm=False)
        (out,) = spec_llm.generate(token_prompts([PROMPTS[i]]), greedy_params(STEPS), use_tqdm=False)
        _check("alone", [out], {i: chosen_steps(alone[0])}, [i])


def test_aborts_under_speculation_leave_the_others_exact(spec_llm: Any, refs: dict[int, Any]) -> None:
    """Twice the prompts for a 12-page pool (pages reused while others speculate), one aborted mid-prefill and two
    after a few speculated steps: the rest finish exact, the aborted ones resent are exact, no page is left held."""
    prompts = PROMPTS + PROMPTS[::-1]
    twin = {i: i if i < len(PROMPTS) else 2 * len(PROMPTS) - 1 - i for i in range(len(prompts))}
    finished = run_with_aborts(spec_llm.llm_engine, prompts, greedy_params(STEPS), {3}, {1, 13}, after=5)
    keep = sorted(finished)
    _check("beside aborts", [finished[i] for i in keep], refs, [twin[i] for i in keep])
    outs = spec_llm.generate(token_prompts([PROMPTS[i] for i in (1, 3)]), greedy_params(STEPS), use_tqdm=False)
    _check("aborted and resent", outs, refs, [1, 3])
    usage = [m.value for m in spec_llm.get_metrics() if m.name == "vllm:kv_cache_usage_perc"]
    assert usage == [0.0], f"state pages still held after every request ended: {usage}"


def test_one_page_per_sequence(spec_llm: Any) -> None:
    """The pool holds PAGES pages of the predicted size (one state and k tokens' inputs per layer, not a page
    per draft position): of 2 * PAGES short prompts, PAGES - 1 run at once (vLLM keeps one page as its null block),
    and the rest wait for pages."""
    engine = spec_llm.llm_engine
    for i, p in enumerate(random_prompts(2 * PAGES, [6], seed=12)):
        # 32 tokens each: every request stays in flight for dozens of steps, so all 24 are queued long before the
        # first ones finish, on any machine; the pool alone caps how many run
        engine.add_request(f"page-{i}", {"prompt_token_ids": p}, greedy_params(32))
    running = []
    while engine.has_unfinished_requests():
        engine.step()
        running += [m.value for m in spec_llm.get_metrics() if m.name == "vllm:num_requests_running"]
    assert max(running) == PAGES - 1, f"at most {max(running)} of {2 * PAGES} requests ran in a {PAGES}-page pool"
