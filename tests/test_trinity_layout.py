"""MLA-Trinity at its production cache layout, exact against transformers, past several latent blocks.

The checkpoint is a random transformers `AfmoeForCausalLM` with Trinity-Mini's head geometry (head_dim 128,
32 query / 4 KV heads, layers [S, S, S, F], sliding window 128) whose full-attention layer's `[k_proj; v_proj]`
is a rank-256 product by construction, converted to MLA at `kv_lora_rank` 256: the conversion is exact, so the
plugin must compute transformers' function of the original. At r = 256 a latent row is a quarter of a sliding
layer's K+V row, so vLLM unifies the page sizes by giving the latent group blocks 4x the sliding blocks (512 vs
128 tokens): the layout that ships, which `test_trinity_vllm.py` (r = 1024, equal block sizes) does not reach.

One float32 engine, prefix caching on, a 200-token budget:
every prompt is prefilled in chunks whose edges fall inside both sliding and latent blocks. Prompts span up
to four latent blocks; one shares a 1100-token prefix with another, so its prefix-cache hit covers two whole
latent blocks (eight sliding blocks). Greedy tokens and every step's full logits (vLLM's raw logits) are
compared with transformers' greedy decoding, batched, alone, and on prefix-cache hits.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from tests.helpers import random_prompts, token_prompts, worker_functions_allowed
from tests.references.afmoe import check_against_hf_greedy, hf_greedy, trinity_geometry_pair

pytestmark = pytest.mark.vllm

VOCAB = 259
RANK = 256  # Trinity-Mini's kv_lora_rank
SLIDING_BLOCK = 128  # vLLM's CPU default block size: the sliding layers keep it
LATENT_BLOCK = 4 * SLIDING_BLOCK  # r = 256 vs 4 KV heads x (128 + 128): a latent page holds 4x the tokens
BUDGET = 200  # max_num_batched_tokens: chunk edges at multiples of 200 cut through blocks of both kinds
STEPS = 24
# float32 on both sides, different kernels and summation orders; test_trinity_vllm.py measured ~2e-5 on
# logits of std ~3 at 300 tokens. A wrong block, slot, position or key scale moves logits by O(0.1-1).
LOGIT_TOL = 1e-3
LATENT_LAYER = "model.layers.3.self_attn"
SLIDING_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]

SHARED = 1100  # A and B share their first 1100 tokens: B's cache hit is the two whole latent blocks below
_a, _b_tail, _c, _d = random_prompts(4, [1300, 1537 - SHARED, 1020, 600], seed=21)
PROMPTS = {
    "A": _a,  # two full latent blocks and a partial third
    "B": _a[:SHARED] + _b_tail,  # 3 latent blocks + 1 token: its last prompt token opens the fourth
    "C": _c,  # decode crosses the boundary at 1024 on step 4
    "D": _d,  # crosses the first latent boundary inside the prompt
}


def _params(max_tokens: int = STEPS):  # noqa: ANN202
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=VOCAB, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return trinity_geometry_pair(tmp_path_factory.mktemp("afmoe-layout"), seed=7, rank=RANK)


@pytest.fixture(scope="module")
def refs(checkpoints: tuple[Any, Any], one_torch_thread: None) -> dict[str, dict]:
    """transformers' greedy run of the original per prompt, before the engine starts in this process.

    One torch thread: transformers' one-token steps are dominated by small ops, where on the shared 2-core
    host a second OpenMP thread mostly waits.
    """
    orig, _ = checkpoints
    return {name: hf_greedy(orig, p, STEPS) for name, p in PROMPTS.items()}


def cache_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Run in the worker (LLM.apply_model): the shape of the cache each attention layer was bound to."""
    shapes = {}
    for m in model.modules():
        kv, name = getattr(m, "kv_cache", None), getattr(m, "layer_name", None) or getattr(m, "prefix", None)
        if isinstance(kv, torch.Tensor) and kv.numel() and name:
            shapes[name] = tuple(kv.shape)
    return shapes


@pytest.fixture(scope="module")
def llm(checkpoints: tuple[Any, Any], refs: dict[str, dict]):  # noqa: ANN201
    from vllm import LLM

    _, mla = checkpoints
    with worker_functions_allowed():
        engine = LLM(
            model=str(mla),
            dtype="float32",
            max_model_len=2048,
            max_num_batched_tokens=BUDGET,
            max_num_seqs=8,
            enable_prefix_caching=True,
            kv_cache_memory_bytes=256 << 20,
            max_logprobs=VOCAB,
            logprobs_mode="raw_logits",
            seed=0,
            enforce_eager=True,  # layout, not compilation: test_trinity_vllm.py serves compiled
        )
        yield engine
        del engine
        gc.collect()


def _generate(llm: Any, names: list[str]) -> list[Any]:
    return llm.generate(token_prompts([PROMPTS[n] for n in names]), _params(), use_tqdm=False)


def test_engine_uses_the_production_layout(llm: Any) -> None:
    """Latent blocks are 4x the sliding blocks in the cache tensors the layers were bound to."""
    (shapes,) = llm.apply_model(cache_shapes)
    assert shapes[LATENT_LAYER][1:] == (1, LATENT_BLOCK, RANK), shapes
    for name in SLIDING_LAYERS:  # vLLM's CPU attention: [blocks, KV heads, block size, K and V of a head]
        assert shapes[name][1:] == (4, SLIDING_BLOCK, 2 * 128), shapes
    assert len({s[0] for s in shapes.values()}) == 1  # one pool: every group draws its blocks from it

    lengths = {n: len(p) for n, p in PROMPTS.items()}
    assert min(lengths.values()) > LATENT_BLOCK and max(lengths.values()) > 3 * LATENT_BLOCK, lengths
    assert min(lengths.values()) > BUDGET, "every prompt is prefilled in chunks"


def test_greedy_and_logits_equal_transformers_alone(llm: Any, refs: dict[str, dict]) -> None:
    worst = [0.0]
    for name in PROMPTS:
        llm.reset_prefix_cache()
        out = _generate(llm, [name])[0]
        assert out.num_cached_tokens == 0, f"{name}: a fresh run was served from the prefix cache"
        check_against_hf_greedy(out, refs[name], f"{name} ({len(PROMPTS[name])} tokens) alone", LOGIT_TOL, worst)
    print(f"\nalone: max |logit - transformers| {worst[0]:.2e} over {len(PROMPTS)} x {STEPS} steps")


def test_greedy_and_logits_equal_transformers_batched(llm: Any, refs: dict[str, dict]) -> None:
    """All four at once: chunked prefills of some requests interleave with the others' decodes."""
    llm.reset_prefix_cache()
    worst = [0.0]
    outs = _generate(llm, list(PROMPTS))
    for name, out in zip(PROMPTS, outs):
        check_against_hf_greedy(out, refs[name], f"{name} ({len(PROMPTS[name])} tokens) batched", LOGIT_TOL, worst)
    cached = {n: o.num_cached_tokens for n, o in zip(PROMPTS, outs)}
    print(f"\nbatched: max |logit - transformers| {worst[0]:.2e}; cached tokens {cached}")


def test_prefix_cache_hits_equal_transformers(llm: Any, refs: dict[str, dict]) -> None:
    """B after A: a hit of two whole latent blocks; B again: 1536 cached, only its last prompt token is computed."""
    llm.reset_prefix_cache()
    worst = [0.0]
    a = _generate(llm, ["A"])[0]
    assert a.num_cached_tokens == 0
    check_against_hf_greedy(a, refs["A"], "A, filling the cache", LOGIT_TOL, worst)
    expected = {"B": SHARED // LATENT_BLOCK * LATENT_BLOCK, "B again": 3 * LATENT_BLOCK, "A again": 2 * LATENT_BLOCK}
    for what, hit in expected.items():
        name = what.split()[0]
        out = _generate(llm, [name])[0]
        assert out.num_cached_tokens == hit, f"{what}: {out.num_cached_tokens} tokens from the cache, expected {hit}"
        check_against_hf_greedy(
            out, refs[name], f"{what} ({hit} of {len(PROMPTS[name])} tokens cached)", LOGIT_TOL, worst
        )
    print(f"\nprefix-cache hits {expected}: max |logit - transformers| {worst[0]:.2e}")
