"""MLA-Trinity's FP8 latent cache: Trainium2 E4M3 codes with one fp32 scale per token, served by real vLLM.

References: `references.packed.fp8_activation` (an independent FP8 rounding through ml_dtypes, in float64) for the
quantizer, and for the served model transformers' `AfmoeForCausalLM` in float64 whose latent layers compute K and
V through the latent rounded the same way (`references.afmoe.cached_latent_model`): an exact implementation of the
format must reproduce it up to float32 noise, while the unrounded model is measurably elsewhere.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

import pytest
import torch

from tests.helpers import (
    FP8_LATENT_LOGIT_TOL,
    greedy_params,
    random_prompts,
    raw_logits_llm,
    token_prompts,
    worker_functions_allowed,
)
from tests.references.afmoe import cached_latent_model, check_against_hf_greedy, hf_greedy, load_hf_model
from tests.references.packed import fp8_activation
from vllm_trn_plugin.kernels.fp8 import FP8_DTYPE, FP8_MAX, quantize_per_token
from vllm_trn_plugin.kernels.latent_decode import dequantize_latents

VOCAB = 259
STEPS = 16
FP8_LATENT = {"latent_cache_dtype": "fp8"}
# test_fp8_latent_cost_over_1100_positions: next-token agreement, |mean NLL difference| (nats), mean logit cosine.
# Measured on its model and text: 0.9945, +3.6e-4, 0.99984 against the bf16 latent (the same against a float32 one).
# The same test serves the text again from a cache that dequantizes with a wrong scale (codes x WRONG_SCALE instead of
# x d_i, within 2x of the right value there) and asserts that each bound fails it: measured 0.9809, +2.4e-3, 0.99966.
BOUNDS = (0.99, 1e-3, 0.9997)
WRONG_SCALE = 0.01


def test_fp8_latent_rounding_holds_every_finite_latent() -> None:
    """Rows from 1e-30 to 1e30, an all-zero row and rows with one outlier: codes within Trainium2's E4M3 range (no
    saturation: the scale is the row's own maximum), nothing NaN or infinite, and the dequantized values those of
    the independent float64 rounding (within one fp32 rounding of the scale)."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(8, 256, generator=g) * 10.0**e for e in (-30, -8, 0, 8, 30)]
    spike = torch.randn(4, 256, generator=g)
    spike[:, 7] = 1e4  # one outlier per row: the rest falls into E4M3's subnormals, none to NaN
    x = torch.cat([*rows, torch.zeros(1, 256), spike])
    codes, scales = quantize_per_token(x)
    assert codes.dtype == FP8_DTYPE and scales.dtype == torch.float32
    c = codes.float()
    assert torch.isfinite(c).all() and torch.isfinite(scales).all()
    assert c.abs().amax(-1)[x.abs().amax(-1) > 0].eq(FP8_MAX).all()  # each row's maximum lands on 240 exactly
    amax = x.double().abs().amax(-1, keepdim=True)
    want = fp8_activation(x) / torch.where(amax > 0, amax / FP8_MAX, 1.0)  # the reference's codes
    # They differ only where the fp32 scale arithmetic moves a value across an E4M3 rounding midpoint: by one code
    # step (2^-3 relative; 2^-9 absolute among the subnormals), and rarely.
    step = want.abs().clamp_min(2.0**-6) * 2.0**-3
    assert ((c.double() - want).abs() <= step).all()
    assert torch.isclose(c.double(), want, rtol=1e-12, atol=0).double().mean() > 0.999
    got = dequantize_latents(codes, scales).double()
    assert ((got - fp8_activation(x)).abs() <= step * amax / FP8_MAX * 1.001).all()
    assert torch.equal(dequantize_latents(codes[-5:-4], scales[-5:-4]), torch.zeros(1, 256))  # zero row stays zero


def test_latent_scale_granularity_per_token_vs_calibrated_per_layer(pair: tuple[Any, Any]) -> None:
    """Why one scale per token and layer, measured: the latents of a 1100-token text rounded with the cache's
    per-token scale vs with a static per-layer scale calibrated (amax / 240) on another 512-token text, as a static
    scale would be.

    - on the text itself the per-token scale's error is no larger, token by token on average, and it saturates
      nothing (the static scale clips what the calibration never saw);
    - E4M3 is a floating-point format (normal values span 2^14), so a static scale loses little while a token's
      range is within about 1000x of the calibrated maximum; a token 10^4x smaller falls into E4M3's subnormals and
      its error grows, the per-token scale's does not (it is scale-invariant);
    - the logits of the float64 model with each rounding against the unrounded one are printed: on this random
      model both cost about the same (their difference is which rounding lands where, not the granularity).
    The per-token scale costs 4 B per 256 B row (1.6%) and one multiply folded into each key's factor in decode."""
    from tests.references.afmoe import exact_latents
    from tests.references.packed import fp8_static

    _, mla = pair
    calib = random_prompts(1, [512], seed=31)[0]
    text = random_prompts(1, [1100], seed=29)[0]
    scales = {i: x.abs().max().item() / FP8_MAX for i, x in exact_latents(mla, calib).items()}

    def rel_err(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # per token
        return ((y.double() - x).norm(dim=-1) / x.norm(dim=-1)).mean()

    def per_token(x: torch.Tensor) -> torch.Tensor:  # what the cache stores, dequantized
        return dequantize_latents(*quantize_per_token(x))

    lines = []
    for i, x in exact_latents(mla, text).items():
        tok, lay = rel_err(per_token(x), x), rel_err(fp8_static(x, scales[i]), x)
        clipped = (x.abs() > FP8_MAX * scales[i]).double().mean().item()
        lines.append(
            f"layer {i}: relative error per token {tok:.4e} (per token) vs {lay:.4e} (per layer, {clipped:.1e} clipped)"
        )
        assert tok <= lay, (i, tok, lay)
        for f in (1e-1, 1e-2, 1e-3, 1e-4):
            tok_f, lay_f = rel_err(per_token(x * f), x * f), rel_err(fp8_static(x * f, scales[i]), x * f)
            lines.append(f"  tokens {f:g} x as large: {tok_f:.4e} vs {lay_f:.4e}")
            assert torch.isclose(tok_f, tok, rtol=1e-3), (i, f, tok_f, tok)
        assert lay_f > 2 * tok_f, (i, lay_f, tok_f)  # at 1e-4 of the calibrated range
    ids = torch.tensor([text])
    with torch.no_grad():
        exact = cached_latent_model(mla, "float64")(input_ids=ids).logits[0].double()
        for name, model in (
            ("per token", cached_latent_model(mla)),
            ("per layer", cached_latent_model(mla, "fp8", scales)),
        ):
            lp, lq = torch.log_softmax(exact, -1), torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
            kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
            lines.append(f"logits, {name} scale vs the unrounded latent: mean KL {kl:.3e}")
    print("\n" + "\n".join(lines))


def latent_caches(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Run in the worker (LLM.apply_model): each latent layer's cache dtype and its stores' rows."""
    from vllm_trn_plugin.model_executors.latent_attention import TrinityLatentAttention

    return [
        {
            "dtype": str(m.kv_cache.dtype),
            "rows": m.kv_cache.numel() // m.kv_lora_rank,
            "key_scales": None if m.key_scales is None else m.key_scales.shape[0],
            "latent_scales": None if m.latent_scales is None else m.latent_scales.shape[0],
        }
        for m in model.modules()
        if isinstance(m, TrinityLatentAttention)
    ]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from tests.references.afmoe import trinity_geometry_pair

    return trinity_geometry_pair(tmp_path_factory.mktemp("fp8-latent"), seed=5)


@pytest.fixture(scope="module")
def fp8_llm(pair: tuple[Any, Any]) -> Any:
    _, mla = pair
    with worker_functions_allowed():
        # max_model_len 4096: the cache groups' common block is 2048 tokens here (an FP8 latent row is 1/16 of a
        # float32 sliding layer's, so vLLM gives the latent group 16x the block size), the prefix cache's grain
        llm = raw_logits_llm(mla, VOCAB, additional_config=FP8_LATENT, disable_log_stats=False, max_model_len=4096)
        yield llm, llm.apply_model(latent_caches)[0]
    del llm
    gc.collect()


@pytest.mark.vllm
def test_fp8_latent_cache_is_what_vllm_allocates(fp8_llm: Any) -> None:
    """The spec's FP8 row is what vLLM allocates and binds: FP8 latent rows, a key-scale and a dequantization-scale
    store row for every cache row."""
    _, caches = fp8_llm
    assert caches, "no latent layer"
    for c in caches:
        assert c["dtype"] == str(FP8_DTYPE) and c["rows"] > 0, c
        assert c["key_scales"] == c["latent_scales"] == c["rows"], c


@pytest.mark.vllm
def test_fp8_latent_engine_equals_float64_model_with_the_same_rounding(pair: tuple[Any, Any], fp8_llm: Any) -> None:
    """Greedy tokens and every step's logits of the served FP8 latent (float32, chunked prefill of the 300-token
    prompt, decode through the absorbed op) against transformers in float64 with the latent rounded alike, within
    FP8_LATENT_LOGIT_TOL (float32 noise moving a latent element across an FP8 rounding midpoint). And the format is
    really in play: at every prompt's first step the served logits are > 10x closer to the rounded model than to the
    unrounded one (a cache that kept the latent unrounded, or dropped a dequantization scale, fails that)."""
    _, mla = pair
    llm, _ = fp8_llm
    prompts = random_prompts(3, [5, 60, 300], seed=17)
    outs = llm.generate(token_prompts(prompts), greedy_params(STEPS, logprobs=VOCAB), use_tqdm=False)
    rounded, plain = cached_latent_model(mla, "fp8"), load_hf_model(mla)
    worst, ratios = [0.0], []
    for p, out in zip(prompts, outs):
        ref = hf_greedy(rounded, p, STEPS)
        check_against_hf_greedy(out, ref, f"FP8 latent, prompt of {len(p)} tokens", FP8_LATENT_LOGIT_TOL, worst)
        first = out.outputs[0].logprobs[0]
        served = torch.tensor([first[t].logprob for t in range(VOCAB)], dtype=torch.float64)
        to_rounded = float((served - ref["prefill_logits"].double()).abs().max())
        to_plain = float((served - hf_greedy(plain, p, 1)["prefill_logits"].double()).abs().max())
        ratios.append(to_plain / max(to_rounded, 1e-12))
        assert to_plain > 10 * to_rounded, (len(p), to_rounded, to_plain)
    print(
        f"\nFP8 latent vs float64 FP8 reference: logits within {worst[0]:.1e}; first-step distance to the unrounded "
        f"model / to the rounded one: {', '.join(f'{r:.0f}x' for r in ratios)}"
    )


@pytest.mark.vllm
def test_prefix_cache_hit_reads_the_stored_fp8_latents(fp8_llm: Any) -> None:
    """A prompt served again hits vLLM's prefix cache (its first 2048 tokens, one common block): its prefill reads
    the FP8 rows and scales the first run wrote, which are also what the first run's own chunked prefill read, so
    the logits are the same bits."""
    llm, _ = fp8_llm
    prompt = random_prompts(1, [2100], seed=23)

    def hits() -> float:
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")

    params = greedy_params(4, logprobs=VOCAB)
    first = llm.generate(token_prompts(prompt), params, use_tqdm=False)[0]
    before = hits()
    again = llm.generate(token_prompts(prompt), params, use_tqdm=False)[0]
    assert hits() - before >= 2048, "the second run did not hit the prefix cache"
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids)
    for a, b in zip(first.outputs[0].logprobs, again.outputs[0].logprobs):
        assert all(a[t].logprob == b[t].logprob for t in a), "a prefix-cache hit read different latents"


def wrong_dequantization_scale(model: torch.nn.Module, undo: bool = False) -> None:
    """Run in the worker (LLM.apply_model): every latent layer reads its FP8 rows as codes x WRONG_SCALE instead of
    codes x their own scale d_i (prefill, and the key scales computed at write), or, with `undo`, as it should."""
    from vllm_trn_plugin.model_executors.latent_attention import TrinityLatentAttention as A

    if undo:
        A.latent_values = A.__dict__["right_latent_values"]
        del A.right_latent_values
    else:
        A.right_latent_values = A.__dict__["latent_values"]
        A.latent_values = staticmethod(lambda rows, d: rows if d is None else rows.float() * WRONG_SCALE)


@pytest.mark.vllm
def test_fp8_latent_cost_over_1100_positions(pair: tuple[Any, Any], fp8_llm: Any) -> None:
    """What the format costs against a bf16 latent, teacher-forced over a 1100-token text: the served FP8 latent's
    prompt logprobs vs transformers in float64 on the same checkpoint with its latents stored in bf16 (what the
    model serves without the option). Next-token agreement at every position whose reference top-2 margin is not a
    tie, the mean NLL difference and the mean logit cosine, each bounded about 2x outside what the format costs on
    this model (deterministic: fixed weights and text). And the bounds are tight enough to matter: the same text
    served again by the same engine, its cache dequantizing with a wrong scale (codes x WRONG_SCALE, within 2x of
    the right d_i), fails each of them."""
    from vllm import SamplingParams

    from vllm_trn_plugin.gate.ties import TIE_MARGIN

    _, mla = pair
    llm, _ = fp8_llm
    text = random_prompts(1, [1100], seed=29)[0]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=VOCAB)

    def served_logits() -> torch.Tensor:  # raw logits predicting tokens 1..
        (out,) = llm.generate(token_prompts([text]), params, use_tqdm=False)
        return torch.tensor(
            [[pos[t].logprob for t in range(VOCAB)] for pos in out.prompt_logprobs[1:]], dtype=torch.float64
        )

    served = served_logits()
    with worker_functions_allowed():
        llm.apply_model(wrong_dequantization_scale)
        try:
            wrong = served_logits()
        finally:
            llm.apply_model(functools.partial(wrong_dequantization_scale, undo=True))
            llm.reset_prefix_cache()  # nothing the wrong run wrote may be read again
    with torch.no_grad():
        ref = cached_latent_model(mla, "bf16")(input_ids=torch.tensor([text])).logits[0, :-1].double()
    targets = torch.tensor(text[1:])
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= TIE_MARGIN
    ref_nll = -torch.log_softmax(ref, -1).gather(1, targets[:, None])[:, 0]

    def cost(x: torch.Tensor) -> tuple[float, float, float]:  # agreement, mean NLL difference, mean logit cosine
        nll = -torch.log_softmax(x, -1).gather(1, targets[:, None])[:, 0]
        return (
            (x.argmax(-1) == ref.argmax(-1))[clear].double().mean().item(),
            (nll - ref_nll).mean().item(),
            torch.nn.functional.cosine_similarity(x, ref, dim=-1).mean().item(),
        )

    (agree, dnll, cos), (w_agree, w_dnll, w_cos) = cost(served), cost(wrong)
    print(
        f"\nFP8 vs bf16 latent, {len(targets)} positions ({int(clear.sum())} not ties): agreement {agree:.4f}, "
        f"mean NLL difference {dnll:+.2e} nats (NLL {ref_nll.mean().item():.3f}), mean logit cosine {cos:.6f}; "
        f"dequantized x {WRONG_SCALE}: {w_agree:.4f}, {w_dnll:+.2e}, {w_cos:.6f}"
    )
    assert len(targets) >= 1000
    assert agree >= BOUNDS[0] and abs(dnll) <= BOUNDS[1] and cos >= BOUNDS[2], (agree, dnll, cos)
    assert w_agree < BOUNDS[0] and abs(w_dnll) > BOUNDS[1] and w_cos < BOUNDS[2], (w_agree, w_dnll, w_cos)


@pytest.mark.vllm
def test_bad_latent_cache_dtype_is_refused_at_start(pair: tuple[Any, Any]) -> None:
    from vllm import LLM

    _, mla = pair
    with pytest.raises(ValueError, match="latent_cache_dtype='fp16'"):
        LLM(model=str(mla), dtype="float32", additional_config={"latent_cache_dtype": "fp16"}, enforce_eager=True)


@pytest.mark.vllm
def test_fp8_latent_at_tp2_equals_the_float64_model_with_the_same_rounding(pair: tuple[Any, Any]) -> None:
    """Tensor parallel 2: every rank caches the whole latent in FP8 (its own scale stores beside it) and serves its
    own heads from it; the greedy tokens and logits are those of the float64 model with the latent rounded alike,
    within FP8_LATENT_LOGIT_TOL, as at TP 1."""
    _, mla = pair
    prompts = random_prompts(2, [5, 200], seed=31)
    with worker_functions_allowed():
        llm = raw_logits_llm(
            mla,
            VOCAB,
            tensor_parallel_size=2,
            max_num_seqs=4,
            max_num_batched_tokens=None,
            kv_cache_memory_bytes=128 << 20,
            enforce_eager=True,
            additional_config=FP8_LATENT,
        )
        try:
            ranks = llm.apply_model(latent_caches)
            outs = llm.generate(token_prompts(prompts), greedy_params(8, logprobs=VOCAB), use_tqdm=False)
        finally:
            del llm
            gc.collect()
    assert len(ranks) == 2
    for caches in ranks:
        assert all(c["dtype"] == str(FP8_DTYPE) and c["latent_scales"] == c["rows"] > 0 for c in caches), caches
    rounded, worst = cached_latent_model(mla, "fp8"), [0.0]
    for p, out in zip(prompts, outs):
        check_against_hf_greedy(
            out, hf_greedy(rounded, p, 8), f"FP8 latent at TP 2, prompt of {len(p)}", FP8_LATENT_LOGIT_TOL, worst
        )
