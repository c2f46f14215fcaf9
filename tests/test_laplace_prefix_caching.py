"""Laplace with vLLM's prefix caching (`--enable-prefix-caching`, its Mamba "align" mode): the GLA state and the
conv window checkpointed at block boundaries in vLLM's own state pool, restored for a prompt that extends a cached
prefix, the remainder prefilled from there.

Reference: the session engine (conftest.laplace_llm), the same float32 checkpoint with prefix caching off. A
request served with a cached prefix differs from it only in how the prompt was split (float32 summation order): its
greedy tokens must equal the reference's up to a near-tie (the tie rule) and each chosen token's logprob within
LOGPROB_TOL, as batch-invariance is tested. An identical resend reads back the checkpoint its own first run left,
so it must equal that run bit for bit. `num_cached_tokens` (vLLM's RequestOutput) shows each hit.

The engine here: the session engine's settings (64 sequences, a 40-page pool) with prefix caching on at the plugin's
default checkpoint interval (256 tokens) and 512-token batches: prompts end on, before and after boundaries, long
prompts are prefilled in chunks that cross them, and 48 prefixes overflow the pool. The interval differs from the CPU
build's own block size (128), the case in which vLLM's scheduler split chunks off the checkpoint grid until the
plugin set both (engine_checks._laplace_checkpoint_interval).
"""

from __future__ import annotations

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

pytestmark = pytest.mark.vllm

BLOCK = 256  # tokens per checkpoint in this module's engine: the plugin's default (asserted by the fixture)
BUDGET = 512  # max_num_batched_tokens
STEPS = 12


def cached_len(prompt_len: int) -> int:
    """Where a prefix hit can end for a prompt of `prompt_len` tokens: the last block boundary before its last token
    (vLLM recomputes at least one token)."""
    return (prompt_len - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def pc_llm(laplace_ckpt: Any) -> Any:
    llm = laplace_engine(laplace_ckpt, max_num_batched_tokens=BUDGET, enable_prefix_caching=True, enforce_eager=True)
    cc = llm.llm_engine.vllm_config.cache_config
    assert (cc.mamba_cache_mode, cc.mamba_block_size, cc.block_size) == ("align", BLOCK, BLOCK)
    yield llm
    del llm


def off(laplace_llm: Any, prompts: list[list[int]]) -> list[tuple[list[int], list[float], list[float]]]:
    """The prompts on the session engine (prefix caching off), one batch."""
    outs = laplace_llm.llm.generate(token_prompts(prompts), greedy_params(STEPS), use_tqdm=False)
    return [chosen_steps(o) for o in outs]


def run(llm: Any, prompts: list[list[int]]) -> list[Any]:
    return llm.generate(token_prompts(prompts), greedy_params(STEPS), use_tqdm=False)


def same_as_off(what: str, out: Any, ref: tuple[list[int], list[float], list[float]]) -> None:
    toks, lps, _ = chosen_steps(out)
    check_batched_against_alone(what, toks, lps, ref, LOGPROB_TOL)


def test_prompts_on_before_and_after_a_boundary(pc_llm: Any, laplace_llm: Any) -> None:
    """Each prompt alone, then resent alone (a hit at its last boundary: bit for bit its first run), then all
    together (every one a hit, in one batch): all equal the engine without prefix caching."""
    lengths = [1, 7, 255, 256, 257, 511, 512, 513, 769, 1200]
    prompts = random_prompts(len(lengths), lengths, seed=191)
    refs = off(laplace_llm, prompts)
    for p, ref in zip(prompts, refs):
        (cold,) = run(pc_llm, [p])
        (warm,) = run(pc_llm, [p])
        assert cold.num_cached_tokens == 0, f"prompt of {len(p)}: a hit on a fresh prompt"
        assert warm.num_cached_tokens == cached_len(len(p)), f"prompt of {len(p)}: {warm.num_cached_tokens} cached"
        assert chosen_steps(warm)[:2] == chosen_steps(cold)[:2], f"prompt of {len(p)}: the resend differs"
        same_as_off(f"prompt of {len(p)}, first run", cold, ref)
    batch = run(pc_llm, prompts)
    for p, out, ref in zip(prompts, batch, refs):
        assert out.num_cached_tokens == cached_len(len(p))
        same_as_off(f"prompt of {len(p)} in a batch of hits", out, ref)


def test_extensions_restore_the_checkpoint_and_prefill_the_rest(pc_llm: Any, laplace_llm: Any) -> None:
    """Prompts extending a 600-token prompt served before (its checkpoint at 512), each the next one's prefix:
    ending before, on and after the next boundary (the last leaves a checkpoint at 768), and 1400 tokens, whose
    632-token remainder is prefilled in chunks (512-token batches) continuing from the restored state across two
    more boundaries. Each restores the latest checkpoint of its prefix."""
    (base,) = random_prompts(1, [600], seed=192)
    run(pc_llm, [base])
    tails = random_prompts(1, [800], seed=193)[0]
    prompts = [base + tails[: n - len(base)] for n in (767, 768, 769, 1400)]
    refs = off(laplace_llm, prompts)
    checkpoints = {512}  # each served prompt leaves its last boundary's (every prompt here extends the previous)
    for p, ref in zip(prompts, refs):
        (out,) = run(pc_llm, [p])
        want = max(b for b in checkpoints if b <= cached_len(len(p)))
        assert out.num_cached_tokens == want, f"extension to {len(p)}: {out.num_cached_tokens} cached, not {want}"
        same_as_off(f"extension to {len(p)}", out, ref)
        checkpoints.add(cached_len(len(p)))
    assert want == 768  # the 1400-token prompt: from 769's checkpoint


def test_multi_turn_conversation_costs_its_new_tokens(pc_llm: Any, laplace_llm: Any) -> None:
    """A conversation replayed turn by turn, each turn the whole history plus ~300 new tokens: from turn 2 on, the
    history up to the previous prompt's last boundary comes from the cache, so each turn recomputes fewer than
    BLOCK + STEPS + its new tokens, whatever the history's length; every turn equals the engine without caching."""
    news = random_prompts(6, [300, 340, 280, 320, 300, 360], seed=194)
    prompt: list[int] = []
    for turn, new in enumerate(news, 1):
        prompt = prompt + new
        (out,) = run(pc_llm, [prompt])
        (ref,) = off(laplace_llm, [prompt])
        same_as_off(f"turn {turn} ({len(prompt)} tokens)", out, ref)
        recomputed = len(prompt) - out.num_cached_tokens
        if turn > 1:
            previous = len(prompt) - len(new) - STEPS
            assert out.num_cached_tokens == cached_len(previous), (turn, out.num_cached_tokens, cached_len(previous))
            assert recomputed < BLOCK + STEPS + len(new)
        prompt = prompt + list(out.outputs[0].token_ids)


def test_eviction_pressure_keeps_every_answer_exact(pc_llm: Any, laplace_llm: Any) -> None:
    """48 distinct prefixes through a 40-page pool, 8 at a time, then all resent: the oldest checkpoints were evicted
    (no hit), the newest are hits, and every answer equals the engine without caching either way."""
    prompts = random_prompts(48, [300, 400, 500], seed=195)
    refs = off(laplace_llm, prompts)
    for i in range(0, len(prompts), 8):
        for p, out, ref in zip(prompts[i : i + 8], run(pc_llm, prompts[i : i + 8]), refs[i : i + 8]):
            assert out.num_cached_tokens == 0
            same_as_off(f"prefix {len(p)} first run", out, ref)
    again = run(pc_llm, prompts[::-1])[::-1]  # the newest first, before the resends evict anything more
    hits = [out.num_cached_tokens == cached_len(len(p)) for p, out in zip(prompts, again)]
    assert any(hits) and not all(hits), f"no eviction or no hit: {hits}"
    assert not any(hits[:8]) and all(hits[-8:]), hits
    for i, (out, ref) in enumerate(zip(again, refs)):
        same_as_off(f"prefix {i} resent ({'hit' if hits[i] else 'evicted'})", out, ref)


def test_aborts_mid_prefill_and_mid_decode_leave_no_page_behind(pc_llm: Any, laplace_llm: Any) -> None:
    """Requests sharing a 520-token prefix, one aborted during its chunked prefill (1320 tokens, after its first
    512-token batch), two after 3 output tokens: the others finish exact; resent, the aborted prompts are exact;
    then no page is held and vLLM can drop its whole prefix cache (no block still referenced)."""
    engine = pc_llm.llm_engine
    (prefix,) = random_prompts(1, [520], seed=196)
    tails = random_prompts(8, [800, 40], seed=197)  # 800: a remainder longer than a batch
    prompts = [prefix + t for t in tails]
    refs = off(laplace_llm, prompts)
    # request 0 first: the first step is its first 256 tokens
    finished = run_with_aborts(engine, prompts, greedy_params(STEPS), {0}, {1, 5}, after=3)
    for i, out in finished.items():
        same_as_off(f"request {i} beside the aborts", out, refs[i])
    redo = sorted(set(range(len(prompts))) - set(finished))
    for i, out in zip(redo, run(pc_llm, [prompts[i] for i in redo])):
        assert out.num_cached_tokens >= 512
        same_as_off(f"aborted request {i} resent", out, refs[i])
    usage = [m.value for m in pc_llm.get_metrics() if m.name == "vllm:kv_cache_usage_perc"]
    assert usage == [0.0], f"state pages still held after every request ended: {usage}"
    assert pc_llm.reset_prefix_cache(), "a cached state page is still referenced"
    (out,) = run(pc_llm, [prompts[2]])
    assert out.num_cached_tokens == 0
    same_as_off("after the cache was reset", out, refs[2])


def test_prefix_caching_options_are_checked_at_start(laplace_ckpt: Any) -> None:
    """--enable-prefix-caching alone: a checkpoint every LAPLACE_CHECKPOINT_TOKENS (not the CPU build's generic
    16-token block); a block size off the GLA chunk grid, speculative decoding, and the Neuron contract adapter
    (one state page per sequence) are refused at start, naming the option."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    from vllm_trn_plugin.engine_checks import LAPLACE_CHECKPOINT_TOKENS
    from vllm_trn_plugin.neuron.laplace import LaplaceNeuronModel

    def config(**kw: Any) -> Any:
        return EngineArgs(model=str(laplace_ckpt), dtype="float32", max_model_len=2048, **kw).create_engine_config()

    cc = config(enable_prefix_caching=True).cache_config
    assert (cc.mamba_cache_mode, cc.mamba_block_size) == ("align", LAPLACE_CHECKPOINT_TOKENS)
    assert cc.block_size == LAPLACE_CHECKPOINT_TOKENS  # what vLLM's scheduler splits prefill chunks at
    with pytest.raises(ValueError, match="--block-size 256 and --mamba-block-size 512 differ"):
        config(enable_prefix_caching=True, block_size=256, mamba_block_size=512)
    assert config().cache_config.mamba_cache_mode == "none"
    assert config(enable_prefix_caching=True, block_size=384).cache_config.mamba_block_size == 384
    with pytest.raises(ValueError, match="--mamba-block-size .* 200 is not a multiple of 128"):
        config(enable_prefix_caching=True, mamba_block_size=200)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    with pytest.raises(ValueError, match="speculative"):
        config(enable_prefix_caching=True, speculative_config=spec)
    cfg = config(enable_prefix_caching=True)
    with set_current_vllm_config(cfg), pytest.raises(NotImplementedError, match="--enable-prefix-caching"):
        LaplaceNeuronModel.from_configs(cfg.model_config.hf_config, {})


def test_served_multi_turn_chat_hits_the_cache_and_answers_as_without_it(
    laplace_ckpt: Any, laplace_llm: Any, tmp_path: Any
) -> None:
    """`vllm-trn serve --enable-prefix-caching` (the plugin's default checkpoint interval) answers a 3-turn chat over
    HTTP, the whole conversation re-sent each turn as OpenAI clients do: from turn 2 on the server reports prompt
    tokens taken from its cache, and every reply is the one the engine without caching gives the same messages
    (greedy, up to a near-tie)."""
    import requests

    from vllm_trn_plugin.bench.local import serve_demo
    from vllm_trn_plugin.engine_checks import LAPLACE_CHECKPOINT_TOKENS
    from vllm_trn_plugin.gate.ties import compare_greedy

    extra = ["--enable-prefix-caching", "--enable-prompt-tokens-details", "--served-model-name", "laplace-pc"]
    server = serve_demo(laplace_ckpt, tmp_path / "serve.log", extra=extra, dtype="float32").wait_healthy(600)
    try:
        users = ["".join(chr(97 + t % 26) for t in p) for p in random_prompts(3, [300, 280, 310], seed=198)]
        messages: list[dict[str, str]] = []
        for turn, text in enumerate(users, 1):
            messages.append({"role": "user", "content": text})
            body = {"model": "laplace-pc", "messages": messages, "max_tokens": 8, "temperature": 0.0}
            body |= {"ignore_eos": True, "logprobs": True, "top_logprobs": 2}
            reply = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=300).json()
            choice, usage = reply["choices"][0], reply["usage"]
            served = [c["token"] for c in choice["logprobs"]["content"]]
            (out,) = laplace_llm.llm.chat(messages, greedy_params(8), use_tqdm=False)
            c = out.outputs[0]
            ref = [lp[t].decoded_token for t, lp in zip(c.token_ids, c.logprobs)]
            agreement = compare_greedy(served, ref, chosen_steps(out)[2])
            assert agreement.ok, f"turn {turn}: served {served}, without caching {ref}"
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            if turn > 1:
                assert cached >= LAPLACE_CHECKPOINT_TOKENS, f"turn {turn}: {cached} cached prompt tokens"
            messages.append({"role": "assistant", "content": choice["message"]["content"]})
    finally:
        server.stop()
