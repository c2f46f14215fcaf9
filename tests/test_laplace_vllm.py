"""Laplace served by real vLLM (compiled mode, float32) against the independent float64 reference.

All tests share the session engine (conftest.laplace_llm): a 40-page state pool, 64 sequences
admitted at most, 256-token batches, so long prompts are prefilled in several chunks that
continue from the saved state, and prefills and decodes share batches.
"""

from __future__ import annotations

import pytest

from tests.helpers import (
    LOGPROB_TOL,
    POOL_SLOTS,
    PROBE_TOKENS,
    PROBES,
    TOKEN_BUDGET,
    check_batched_against_alone,
    chosen_steps,
    greedy_params,
    random_prompts,
    token_prompts,
)
from tests.references.laplace import assert_same_greedy
from vllm_trn_plugin.bench.ties import first_divergence

pytestmark = pytest.mark.vllm

# Lengths around the 128-token chunk edges and past the 256-token batch budget.
MIXED_LENGTHS = [1, 7, 127, 128, 129, 300, 517, 40, 255, 256, 257, 3, 64, 200, 90, 411]


def test_greedy_equals_plain_pytorch_forward(laplace_llm, laplace_ref) -> None:
    prompts = random_prompts(8, MIXED_LENGTHS[::2], seed=1)
    outs = laplace_llm.llm.generate(token_prompts(prompts), greedy_params(24), use_tqdm=False)
    assert any(len(p) > TOKEN_BUDGET for p in prompts)  # chunked prefill from a saved state
    for prompt, out in zip(prompts, outs):
        ref = laplace_ref.greedy(prompt, 24)
        toks, lps, _ = chosen_steps(out)
        assert_same_greedy(toks, ref, f"prompt of {len(prompt)} tokens")
        d = first_divergence(toks, ref.tokens)
        n = len(toks) if d is None else d
        err = max(abs(a - b) for a, b in zip(lps[:n], ref.logprobs[:n]))
        assert err < 1e-3, f"prompt of {len(prompt)} tokens: chosen-token logprob differs by {err:.2e} from float64"


@pytest.fixture(scope="module")
def alone_outputs(laplace_llm):
    prompts = random_prompts(32, MIXED_LENGTHS, seed=2)
    alone = [
        chosen_steps(laplace_llm.llm.generate(token_prompts([p]), greedy_params(16), use_tqdm=False)[0])
        for p in prompts
    ]
    return prompts, alone


@pytest.mark.parametrize("batch", [1, 4, 8, 16, 32])
def test_batch_invariance(laplace_llm, alone_outputs, batch: int) -> None:
    prompts, alone = alone_outputs
    # Different members per batch size, in a shuffled order.
    idx = [(i * 7 + batch) % 32 for i in range(batch)]
    outs = laplace_llm.llm.generate(token_prompts([prompts[i] for i in idx]), greedy_params(16), use_tqdm=False)
    for i, out in zip(idx, outs):
        toks, lps, _ = chosen_steps(out)
        what = f"seq {i} (len {len(prompts[i])}) in batch {batch}"
        check_batched_against_alone(what, toks, lps, alone[i], LOGPROB_TOL)


def test_waves_with_aborts_more_sequences_than_pages(laplace_llm, laplace_ref) -> None:
    """100 requests for a 40-page pool, a quarter aborted mid-stream: the rest are exact."""
    engine = laplace_llm.llm.llm_engine
    distinct = random_prompts(10, [5, 33, 130, 260, 12], seed=3)
    refs = [laplace_ref.greedy(p, 10) for p in distinct]
    n_req = 100
    assert n_req > POOL_SLOTS
    ids = {f"wave-{r}": r for r in range(n_req)}  # outputs and aborts use these external ids
    for rid, r in ids.items():
        engine.add_request(rid, {"prompt_token_ids": distinct[r % 10]}, greedy_params(10, logprobs=0))
    to_abort = {rid for rid, r in ids.items() if r % 4 == 1}
    finished, steps, aborted = {}, 0, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
            elif out.request_id in to_abort and len(out.outputs[0].token_ids) >= 3:
                engine.abort_request([out.request_id])
                aborted.add(out.request_id)
        steps += 1
        assert steps < 10_000
    assert aborted, "no request was aborted mid-stream"
    for rid, r in ids.items():
        if rid in aborted:
            continue
        assert rid in finished, f"request {r} never finished"
        assert_same_greedy(finished[rid], refs[r % 10], f"request {r} (prompt {r % 10})")
    assert len(finished) >= n_req - len(aborted)


def test_state_pool_returns_to_empty(laplace_llm) -> None:
    laplace_llm.llm.generate(token_prompts(random_prompts(50, [10, 300], seed=4)), greedy_params(4), use_tqdm=False)
    usage = [m.value for m in laplace_llm.llm.get_metrics() if m.name == "vllm:kv_cache_usage_perc"]
    assert usage and usage[0] == 0.0, f"state pages still held after all requests ended: {usage}"


def test_reused_slot_equals_fresh_engine(laplace_llm) -> None:
    """Runs after the other tests have cycled every page: the probes must see no stale state."""
    for prompt, fresh in zip(PROBES, laplace_llm.fresh_probe_outputs):
        again = laplace_llm.llm.generate(token_prompts([prompt]), greedy_params(PROBE_TOKENS), use_tqdm=False)[0]
        got, want = chosen_steps(again), chosen_steps(fresh)
        assert got[0] == want[0], f"probe of {len(prompt)} tokens: {got[0]} in a reused slot, {want[0]} fresh"
        assert max(abs(a - b) for a, b in zip(got[1], want[1])) <= LOGPROB_TOL
