"""MLA-Trinity under vLLM's n-gram (prompt lookup) and EAGLE3 speculative decoding, served by real vLLM: greedy
output with speculation equals the same engine configuration's output without it, step for step (the tie rule and
LOGPROB_TOL, as batched runs are held to their runs alone), with the model-dtype latent and with the FP8 latent cache.

A verification step feeds each request its token and up to k drafts; the latent layers run them over the cached
context and write a latent (and key scale) for every draft, and the rejected drafts' slots must be written again
before anything reads them. The prompts make the drafts land in full, in part and not at all (random models fall
into loops that prompt lookup predicts, and leave them); the acceptance counters prove each case occurred. The
reference is the same checkpoint served without speculation.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import (
    FP8_LATENT_LOGIT_TOL,
    LOGPROB_TOL,
    check_batched_against_alone,
    chosen_steps,
    greedy_params,
    random_prompts,
    raw_logits_llm,
    run_with_aborts,
    token_prompts,
)

pytestmark = pytest.mark.vllm

VOCAB = 259
STEPS = 48
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# 300: prefilled in two chunks (max_num_batched_tokens 256); the last two repeat a short motif, which prompt lookup
# proposes from the first step.
PROMPTS = random_prompts(6, [9, 40, 130, 300, 65, 17], seed=5) + [p * 6 for p in random_prompts(2, [8, 5], seed=6)]
ALONE = (0, 3, 7)
LATENTS = {"model": {}, "fp8": {"latent_cache_dtype": "fp8"}}
TOL = {"model": LOGPROB_TOL, "fp8": FP8_LATENT_LOGIT_TOL}


@pytest.fixture(scope="module")
def mla(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.references.afmoe import convert_to_mla, make_random_afmoe

    root = tmp_path_factory.mktemp("trinity-spec")
    return convert_to_mla(make_random_afmoe(root / "orig", seed=0, hidden_size=1024), root / "mla")


def _spec_counters(llm: Any) -> tuple[float, float, list[float]]:
    """vLLM's cumulative speculation counters: drafts proposed, draft tokens, accepted tokens per draft position."""
    metrics = {m.name: m for m in llm.get_metrics()}
    per_pos = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    return (
        metrics["vllm:spec_decode_num_drafts"].value if "vllm:spec_decode_num_drafts" in metrics else 0.0,
        metrics["vllm:spec_decode_num_draft_tokens"].value if "vllm:spec_decode_num_draft_tokens" in metrics else 0.0,
        list(per_pos.values) if per_pos is not None else [0.0] * K,
    )


@pytest.fixture(scope="module", params=sorted(LATENTS))
def engines(request: pytest.FixtureRequest, mla: Path) -> Any:
    """(latent dtype, reference outputs without speculation (batched; ALONE's also alone), the speculating engine)."""
    extra = {"additional_config": LATENTS[request.param]} if LATENTS[request.param] else {}
    ref = raw_logits_llm(mla, VOCAB, max_num_seqs=16, **extra)
    refs = [chosen_steps(o) for o in ref.generate(token_prompts(PROMPTS), greedy_params(STEPS), use_tqdm=False)]
    # Alone as well: a batch's other rows move float32 sums by an ulp, which an FP8 code can round across
    alone = {
        i: chosen_steps(ref.generate(token_prompts([PROMPTS[i]]), greedy_params(STEPS), use_tqdm=False)[0])
        for i in ALONE
    }
    del ref
    gc.collect()
    spec = raw_logits_llm(mla, VOCAB, max_num_seqs=16, speculative_config=NGRAM, disable_log_stats=False, **extra)
    yield request.param, refs, alone, spec
    del spec
    gc.collect()


def _check(latent: str, what: str, outs: list[Any], refs: Any, idx: list[int]) -> None:
    for i, out in zip(idx, outs):
        toks, vals, _ = chosen_steps(out)
        assert len(toks) == STEPS, f"{latent} latent, {what}, prompt {i}: {len(toks)} tokens"
        where = f"{latent} latent, {what}, prompt {i} ({len(PROMPTS[i])} tokens)"
        check_batched_against_alone(where, toks, vals, refs[i], TOL[latent])


def test_ngram_speculation_equals_greedy_without_it(engines: Any) -> None:
    """Batched, then alone, then the batch again (from the prefix cache, model-dtype latent): the speculating
    engine's tokens and logits are the reference's; the drafts were accepted in full, in part and not at all."""
    latent, refs, alone, llm = engines
    before = _spec_counters(llm)
    idx = list(range(len(PROMPTS)))
    _check(
        latent,
        "batched",
        llm.generate(token_prompts(PROMPTS), greedy_params(STEPS), use_tqdm=False),
        refs,
        idx,
    )
    (d1, t1, p1), (d0, t0, p0) = _spec_counters(llm), before
    drafts, draft_tokens, per_pos = d1 - d0, t1 - t0, [x - y for x, y in zip(p1, p0)]
    accepted = sum(per_pos)
    print(
        f"\n{latent} latent: {drafts:.0f} drafts, {draft_tokens:.0f} draft tokens, {accepted:.0f} accepted "
        f"({per_pos} by position)"
    )
    assert per_pos[K - 1] > 0, "no draft was accepted in full"
    assert per_pos[0] < drafts, "every draft's first token was accepted: none rejected outright"
    assert per_pos[0] > per_pos[K - 1], "no draft was accepted in part"
    for i in ALONE:
        out = llm.generate(token_prompts([PROMPTS[i]]), greedy_params(STEPS), use_tqdm=False)
        _check(latent, "alone", out, {i: alone[i]}, [i])

    def hits() -> float:
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")

    h0 = hits()
    _check(
        latent,
        "from the prefix cache",
        llm.generate(token_prompts(PROMPTS), greedy_params(STEPS), use_tqdm=False),
        refs,
        idx,
    )
    # The FP8 latent engine's common block across cache groups (an FP8 latent row is 1/16 of a float32 sliding
    # layer's, so vLLM scales that group's block up) is longer than these prompts: its hits, test_fp8_latent.py
    if latent == "model":
        assert hits() > h0, "the repeated batch did not hit the prefix cache"


def test_aborts_under_speculation_leave_the_others_exact(engines: Any) -> None:
    """One request aborted mid-prefill, two after a few speculated steps: the rest finish exact, the aborted
    prompts resent are exact, and no cache block is left held."""
    latent, refs, alone, llm = engines
    # the 300-token prompt's prefill spans two steps
    finished = run_with_aborts(llm.llm_engine, PROMPTS, greedy_params(STEPS), {3}, {1, 6}, after=5)
    keep = sorted(finished)
    _check(latent, "beside aborts", [finished[i] for i in keep], refs, keep)
    redo = sorted(set(range(len(PROMPTS))) - set(finished))
    outs = llm.generate(token_prompts([PROMPTS[i] for i in redo]), greedy_params(STEPS), use_tqdm=False)
    _check(latent, "aborted and resent", outs, refs, redo)
    usage = [m.value for m in llm.get_metrics() if m.name == "vllm:kv_cache_usage_perc"]
    assert usage == [0.0], f"cache blocks still held after every request ended: {usage}"


def write_echo_eagle3(out: Path, target: Path, seed: int = 0) -> Path:
    """An EAGLE3 draft (vLLM's LlamaForCausalLMEagle3 checkpoint) that reads the target's residual stream after its
    last layer and proposes the target's own greedy token from it: `fc` selects that aux state, the layer's
    attention and MLP outputs are zero (the stream passes through), and its norm and LM head are the target's. Its
    other weights are random. So every draft repeats the token just sampled, and with exact aux states the drafts
    accepted are exactly the target's repeats (echo_acceptance); aux states from another place accept ~nothing."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    t = json.loads((target / "config.json").read_text())
    h, vocab, inter, heads, hd = t["hidden_size"], t["vocab_size"], 512, 8, 128
    own = {}
    for f in target.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            own |= {k: sf.get_tensor(k).float() for k in sf.keys() if k in ("lm_head.weight", "model.norm.weight")}
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    fc = torch.zeros(h, 3 * h)
    fc[:, 2 * h :] = torch.eye(h)  # the third aux state: after the last layer
    weights = {
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": rand(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(heads * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(heads * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": torch.zeros(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": torch.zeros(h, inter),
        "fc.weight": fc,
        "norm.weight": own["model.norm.weight"],
        "lm_head.weight": own["lm_head.weight"],
    }
    config = dict(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hd,
        vocab_size=vocab,
        draft_vocab_size=vocab,
        max_position_embeddings=t["max_position_embeddings"],
        rms_norm_eps=t["rms_norm_eps"],
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        dtype="float32",
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, t["num_hidden_layers"]]},
    )
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def echo_acceptance(tokens: list[int]) -> list[int]:
    """Accepted drafts by position when every draft is K copies of the last token: at each step the leading run of
    the following tokens equal to it, then the bonus token."""
    per_pos, p = [0] * K, 0
    while p < len(tokens) - 1:
        j = 0
        while j < K and p + 1 + j < len(tokens) and tokens[p + 1 + j] == tokens[p]:
            per_pos[j] += 1
            j += 1
        p += j + 1
    return per_pos


def test_eagle3_equals_greedy_without_it_and_reads_the_right_hidden_states(
    engines: Any, mla: Path, tmp_path: Path
) -> None:
    """EAGLE3 with the echo draft: the tokens and logits are the reference's, and the drafts accepted by position
    are exactly those the reference's own repeats predict, which holds only if the model hands the draft the residual
    stream after its last layer."""
    latent, refs, _, _ = engines
    draft = write_echo_eagle3(tmp_path / "eagle3", mla)
    extra = {"additional_config": LATENTS[latent]} if LATENTS[latent] else {}
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": K}
    llm = raw_logits_llm(mla, VOCAB, max_num_seqs=16, speculative_config=spec, disable_log_stats=False, **extra)
    try:
        outs = llm.generate(token_prompts(PROMPTS), greedy_params(STEPS), use_tqdm=False)
        _check(latent, "EAGLE3, batched", outs, refs, list(range(len(PROMPTS))))
        _, _, per_pos = _spec_counters(llm)
    finally:
        del llm
        gc.collect()
    want = [sum(c) for c in zip(*(echo_acceptance(r[0]) for r in refs))]
    print(f"\n{latent} latent, EAGLE3 echo draft: accepted by position {per_pos}, the reference's repeats {want}")
    assert want[K - 1] > 0, "the reference never repeats a token K + 1 times: the check below would be empty"
    assert per_pos == want
