"""MLA-Trinity served by real vLLM (compiled, float32) against code nobody here wrote.

A random transformers `AfmoeForCausalLM` with Trinity-Mini's head geometry is converted to MLA at
exact rank (kv_lora_rank = 2 x 4 KV heads x 128 = 1024, factors from an SVD); the plugin serves
the converted checkpoint and must reproduce transformers' original model. vLLM's built-in
`AfmoeForCausalLM` on the unconverted checkpoint is the harness control.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.helpers import (
    LOGPROB_TOL,
    check_batched_against_alone,
    chosen_steps,
    random_prompts,
    token_prompts,
    worker_functions_allowed,
)
from tests.references.afmoe import convert_to_mla, hf_greedy, make_random_afmoe
from vllm_trn_plugin.gate.ties import TIE_MARGIN, first_divergence

pytestmark = pytest.mark.vllm

VOCAB = 259
WINDOW = 64  # AFMOE_SMALL's sliding window: every fidelity prompt is longer
FIDELITY_LENGTHS = [100, 150, 200, 130, 300]
MIXED_LENGTHS = [1, 7, 63, 64, 65, 129, 300, 40, 255, 257, 3, 90, 200, 411, 17, 128]


def _params(max_tokens: int, logprobs: int = 2):  # noqa: ANN202
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=True)


KV_CACHE_BYTES = 512 << 20


def _engine(model: str, **kw):  # noqa: ANN003, ANN202
    from vllm import LLM

    return LLM(
        model=model,
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=256,  # long prompts are prefilled in chunks, mixed with decodes
        max_num_seqs=32,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_logprobs=VOCAB,
        logprobs_mode="raw_logits",
        disable_log_stats=False,
        seed=0,
        **kw,
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("afmoe")
    orig = make_random_afmoe(root / "orig", seed=0, hidden_size=1024)
    mla = convert_to_mla(orig, root / "mla")
    return orig, mla


@pytest.fixture(scope="module")
def hf_refs(checkpoints):  # noqa: ANN001, ANN201
    orig, _ = checkpoints
    prompts = random_prompts(len(FIDELITY_LENGTHS), FIDELITY_LENGTHS, seed=11)
    return prompts, [hf_greedy(orig, p, 64) for p in prompts]


def cache_memory(model: torch.nn.Module) -> dict[str, int]:
    """Run in the worker (LLM.apply_model): bytes of the cache tensors bound to the model's layers (a tensor that
    layers share counted once) and of the latent layers' key-scale stores."""
    from vllm_trn_plugin.model_executors.latent_attention import TrinityLatentAttention

    storages, scales = {}, 0
    for m in model.modules():
        kv = getattr(m, "kv_cache", None)
        if isinstance(kv, torch.Tensor) and kv.numel():
            storages[kv.untyped_storage().data_ptr()] = kv.untyped_storage().nbytes()
        if isinstance(m, TrinityLatentAttention) and m.key_scales is not None:
            scales += m.key_scales.numel() * m.key_scales.element_size()
    return {"cache": sum(storages.values()), "key_scales": scales}


@pytest.fixture(scope="module")
def mla_llm(checkpoints):  # noqa: ANN001, ANN201
    _, mla = checkpoints
    with worker_functions_allowed():
        llm = _engine(str(mla))
        (bound,) = llm.apply_model(cache_memory)  # before the first request
        probes = random_prompts(2, [9, 300], seed=98)
        fresh = [llm.generate(token_prompts([p]), _params(12), use_tqdm=False)[0] for p in probes]
        yield llm, probes, fresh, bound
        del llm
        gc.collect()


def _assert_matches_hf(outs, prompts, refs, what: str) -> None:  # noqa: ANN001
    for prompt, out, ref in zip(prompts, outs, refs):
        toks, _, _ = chosen_steps(out)
        d = first_divergence(toks, ref["tokens"])
        if d is not None:
            assert ref["margins"][d] < TIE_MARGIN, (
                f"{what}, prompt of {len(prompt)} tokens: step {d} gives {toks[d]}, transformers {ref['tokens'][d]} "
                f"(margin {ref['margins'][d]:.2e})"
            )


def test_greedy_64_steps_equal_transformers_batched_and_alone(mla_llm, hf_refs) -> None:
    llm = mla_llm[0]
    prompts, refs = hf_refs
    assert all(len(p) > WINDOW for p in prompts)
    _assert_matches_hf(llm.generate(token_prompts(prompts), _params(64), use_tqdm=False), prompts, refs, "batched")
    for p, r in zip(prompts, refs):
        _assert_matches_hf(llm.generate(token_prompts([p]), _params(64), use_tqdm=False), [p], [r], "alone")


def test_prefill_logits_agree_with_transformers(mla_llm, hf_refs) -> None:
    llm = mla_llm[0]
    prompts, refs = hf_refs
    outs = llm.generate(token_prompts(prompts), _params(1, logprobs=VOCAB), use_tqdm=False)
    worst_diff, worst_cos = 0.0, 1.0
    for out, ref in zip(outs, refs):
        top = out.outputs[0].logprobs[0]
        got = torch.tensor([top[i].logprob for i in range(VOCAB)], dtype=torch.float64)
        want = ref["prefill_logits"].to(torch.float64)
        worst_diff = max(worst_diff, (got - want).abs().max().item())
        worst_cos = min(worst_cos, torch.nn.functional.cosine_similarity(got, want, dim=0).item())
    print(f"\nprefill logits vs transformers: max abs diff {worst_diff:.2e}, min cosine {worst_cos:.8f}")
    assert worst_diff < 1e-3 and worst_cos > 1 - 1e-6


@pytest.fixture(scope="module")
def alone(mla_llm):  # noqa: ANN001, ANN201
    llm = mla_llm[0]
    prompts = random_prompts(32, MIXED_LENGTHS, seed=12)
    return prompts, [chosen_steps(llm.generate(token_prompts([p]), _params(12), use_tqdm=False)[0]) for p in prompts]


@pytest.mark.parametrize("batch", [1, 4, 8, 16, 32])
def test_batch_invariance(mla_llm, alone, batch: int) -> None:
    llm = mla_llm[0]
    prompts, single = alone
    idx = [(i * 5 + batch) % 32 for i in range(batch)]
    outs = llm.generate(token_prompts([prompts[i] for i in idx]), _params(12), use_tqdm=False)
    for i, out in zip(idx, outs):
        toks, vals, _ = chosen_steps(out)
        what = f"seq {i} (len {len(prompts[i])}) in batch {batch}"
        check_batched_against_alone(what, toks, vals, single[i], LOGPROB_TOL)


def test_prefix_cache_hits_give_the_same_tokens(mla_llm, checkpoints) -> None:
    """Prompts sharing a 256-token prefix: later ones reuse cached latent and sliding blocks."""
    llm = mla_llm[0]
    orig, _ = checkpoints
    prefix = random_prompts(1, [256], seed=13)[0]
    prompts = [prefix + s for s in random_prompts(3, [5, 40, 90], seed=14)]

    def hits() -> float:
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")

    before = hits()
    outs = [llm.generate(token_prompts([p]), _params(16), use_tqdm=False)[0] for p in prompts]
    assert hits() - before >= 256, "the shared prefix was not served from the cache"
    _assert_matches_hf(outs, prompts, [hf_greedy(orig, p, 16) for p in prompts], "prefix-cached")


def test_reused_blocks_equal_fresh_engine(mla_llm) -> None:
    llm, probes, fresh, _ = mla_llm
    for p, f in zip(probes, fresh):
        got, want = chosen_steps(llm.generate(token_prompts([p]), _params(12), use_tqdm=False)[0]), chosen_steps(f)
        assert got[0] == want[0], f"probe of {len(p)} tokens differs after block reuse"
        assert max(abs(a - b) for a, b in zip(got[1], want[1])) <= LOGPROB_TOL


def test_cache_budget_holds_latent_cache_and_key_scales(mla_llm) -> None:
    """--kv-cache-memory-bytes bounds everything the cache needs: vLLM's blocks plus the key-scale stores, which
    are allocated when the cache is bound (an OOM shows at start-up, not at the first request) and never grow."""
    llm, _, _, bound = mla_llm
    assert bound["key_scales"] > 0, "no key-scale store allocated when the cache was bound"
    total = bound["cache"] + bound["key_scales"]
    print(f"\ncache {bound['cache']} B + key scales {bound['key_scales']} B = {total} B of {KV_CACHE_BYTES} B")
    assert total <= KV_CACHE_BYTES
    assert total > 0.99 * KV_CACHE_BYTES  # the budget is used, not just respected (vLLM rounds to whole pages)
    (after,) = llm.apply_model(cache_memory)  # after every other test's requests
    assert after == bound


def test_builtin_afmoe_control_equals_transformers(mla_llm, checkpoints, hf_refs) -> None:
    """The harness control: vLLM's own AfmoeForCausalLM on the unconverted checkpoint."""
    orig, _ = checkpoints
    prompts, refs = hf_refs
    llm = _engine(str(orig), enforce_eager=True)  # the compiled path is mla_llm's
    try:
        _assert_matches_hf(llm.generate(token_prompts(prompts), _params(64), use_tqdm=False), prompts, refs, "built-in")
    finally:
        del llm
        gc.collect()
