"""Both models served by real vLLM from packed MXFP4 checkpoints (`vllm-trn pack`), against an independent FP8 forward.

The reference (tests/packed_reference.py) decodes the packed files itself in float64 and applies the FP8 math
(activations rounded per token to Trainium2 FP8, FP8 weights with their row scales, bias): for Laplace inside the
float64 per-token recurrence of tests/laplace_reference.py, for MLA-Trinity inside transformers'
AfmoeForCausalLM. Logits are compared along the path vLLM took (teacher forcing), so one near-tie cannot hide
the rest of a sequence. Against the unquantized model the packed one can only be close: that agreement is
printed (run with -s) and bounded below.

Rounding activations to FP8 (3 mantissa bits) turns float32 noise into jumps: an input that the engine
(float32, chunked prefill, oneDNN GEMMs) and the reference (float64) hold a few ulps apart, close to an FP8
rounding midpoint, rounds to neighbouring FP8 values 2^-4 apart, and the recurrent state / the KV cache carries
that forward. The reference shows the same when its own activations are perturbed by 1e-7 (relative) before
rounding: jumps of 0.1-0.3 in a logit at some steps, ~1e-6 at the others (MLA-Trinity, 7-token prompt, 4 noise
seeds). Even a 7-token MLA-Trinity prompt can flip in its prefill (measured 0.23 at step 0 for one prompt, 5e-6 for
another). So the checks are: Laplace's one-token prompt, too few roundings to flip, equal to EXACT_TOL at its
first step (measured 2e-6); every short prompt's logits within FLIP_TOL at every step (the quantization itself
moves logits by 3-5 against the unquantized model, a wiring error by more); long prompts the same function
(cosine); and op-level exactness in tests/test_fp8_matmul.py.
"""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.afmoe_reference import convert_to_mla, hf_greedy, load_hf_model, make_random_afmoe
from tests.conftest import random_prompts, token_prompts
from tests.laplace_reference import LaplaceReference
from tests.packed_reference import load_packed, patch_afmoe_fp8
from vllm_trn_plugin.loaders.mxfp4 import CheckpointFormatError
from vllm_trn_plugin.loaders.packed import pack
from vllm_trn_plugin.model_executors.mxfp4_fp8 import packed_weights

pytestmark = pytest.mark.vllm

VOCAB = 259
STEPS = 12
LAPLACE_LENGTHS = [1, 37, 300]  # 300 > the 256-token budget: chunked prefill
TRINITY_LENGTHS = [7, 40, 150]  # 150 > the sliding window (64)
SHORT = 40  # prompts up to this long: logits within FLIP_TOL of the reference's
FLIP_TOL = 0.5  # a few FP8 rounding flips (see above)
EXACT_TOL = 1e-4
LONG_COSINE = 0.99


def _engine(model: Path, **kw):  # noqa: ANN003, ANN202
    from vllm import LLM

    return LLM(
        model=str(model),
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        max_logprobs=VOCAB,
        logprobs_mode="raw_logits",
        seed=0,
        **kw,
    )


def _served(llm, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:  # noqa: ANN001
    """Greedy tokens and the full raw logits [STEPS, VOCAB] each was chosen from."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=VOCAB, ignore_eos=True)
    out = []
    for o in llm.generate(token_prompts(prompts), params, use_tqdm=False):
        c = o.outputs[0]
        logits = torch.full((len(c.token_ids), VOCAB), -math.inf, dtype=torch.float64)
        for i, top in enumerate(c.logprobs):
            for tok, lp in top.items():
                logits[i, tok] = lp.logprob
        out.append((list(c.token_ids), logits))
    return out


def _check(what: str, prompt_len: int, tokens: list[int], got: torch.Tensor, ref: torch.Tensor) -> float:
    """Served logits equal the reference's along the served path (short prompts; long ones: same function);
    each token is the reference argmax unless tied."""
    err = float((got - ref).abs().max())
    if prompt_len > SHORT:
        assert _cosine(got, ref) > LONG_COSINE, f"{what}: logits cosine {_cosine(got, ref):.4f} vs the FP8 reference"
        return err
    assert err < FLIP_TOL, f"{what}: max |logit diff| {err:.2e} vs the FP8 reference"
    if prompt_len == 1:  # four layers' worth of roundings: no flip (measured 2e-6, and stable)
        first = float((got[0] - ref[0]).abs().max())
        assert first < EXACT_TOL, f"{what}: prefill logits differ by {first:.2e} from the FP8 reference"
    for i, tok in enumerate(tokens):
        top2 = torch.topk(ref[i], 2).values
        if float(top2[0] - top2[1]) >= 2 * FLIP_TOL:
            assert tok == int(ref[i].argmax()), f"{what}: step {i} chose {tok}, reference argmax {int(ref[i].argmax())}"
    return err


def _fmt(lengths: list[int], errs: list[float]) -> str:
    return ", ".join(f"{n}: {e:.1e}" for n, e in zip(lengths, errs))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def _laplace_logits(ref: LaplaceReference, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Reference logits at every generated step, feeding the served tokens (teacher forcing)."""
    state = ref.new_state()
    for t in prompt[:-1]:
        ref.step(t, state)
    rows, tok = [], prompt[-1]
    for nxt in tokens:
        rows.append(ref.step(tok, state))
        tok = nxt
    return torch.stack(rows)


@torch.no_grad()
def _hf_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:  # noqa: ANN001
    ids = torch.tensor([prompt + tokens[:-1]])
    return model(input_ids=ids).logits[0, len(prompt) - 1 :].double()


@pytest.fixture(scope="module")
def laplace_packed(laplace_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack(laplace_ckpt, tmp_path_factory.mktemp("laplace-packed") / "ckpt").dst


@pytest.fixture(scope="module")
def trinity_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("trinity-packed")
    orig = make_random_afmoe(root / "orig", seed=3, full_kv_rank=256)
    mla = convert_to_mla(orig, root / "mla", kv_lora_rank=256)
    return mla, pack(mla, root / "packed").dst


def test_laplace_packed_equals_fp8_reference(laplace_packed: Path, laplace_ckpt: Path) -> None:
    prompts = random_prompts(len(LAPLACE_LENGTHS), LAPLACE_LENGTHS, seed=21)
    llm = _engine(laplace_packed, kv_cache_memory_bytes=256 << 20)
    try:
        served = _served(llm, prompts)
    finally:
        del llm
    ref, plain = LaplaceReference(laplace_packed), LaplaceReference(laplace_ckpt)
    assert ref.fp8 and "lm_head" in ref.fp8
    errs, cos, agree = [], [], 0
    for prompt, (tokens, logits) in zip(prompts, served):
        want = _laplace_logits(ref, prompt, tokens)
        errs.append(_check(f"Laplace, prompt of {len(prompt)}", len(prompt), tokens, logits, want))
        cos.append(_cosine(logits, _laplace_logits(plain, prompt, tokens)))
        agree += sum(a == b for a, b in zip(tokens, plain.greedy(prompt, STEPS).tokens))
    print(
        f"\nLaplace packed vs FP8 reference, max |logit diff| by prompt length: {_fmt(LAPLACE_LENGTHS, errs)}; "
        f"vs unquantized: logits cosine min {min(cos):.4f}, greedy tokens equal {agree}/{STEPS * len(prompts)}"
    )
    assert min(cos) > 0.9, cos


def test_trinity_packed_equals_fp8_reference(trinity_dirs: tuple[Path, Path]) -> None:
    mla, packed = trinity_dirs
    prompts = random_prompts(len(TRINITY_LENGTHS), TRINITY_LENGTHS, seed=22)
    llm = _engine(packed, kv_cache_memory_bytes=256 << 20)
    try:
        served = _served(llm, prompts)
        alone = _served(llm, prompts[:1])[0]
    finally:
        del llm
    plain = load_hf_model(mla)
    ref = patch_afmoe_fp8(copy.deepcopy(plain), *load_packed(packed))
    errs, cos, agree = [], [], 0
    for prompt, (tokens, logits) in zip(prompts, served):
        want = _hf_logits(ref, prompt, tokens)
        errs.append(_check(f"MLA-Trinity, prompt of {len(prompt)}", len(prompt), tokens, logits, want))
        cos.append(_cosine(logits, _hf_logits(plain, prompt, tokens)))
        agree += sum(a == b for a, b in zip(tokens, hf_greedy(plain, prompt, STEPS)["tokens"]))
    assert alone[0] == served[0][0], "batched and alone differ"
    print(
        f"\nMLA-Trinity packed vs FP8 reference, max |logit diff| by prompt length: {_fmt(TRINITY_LENGTHS, errs)}; "
        f"vs unquantized: logits cosine min {min(cos):.4f}, greedy tokens equal {agree}/{STEPS * len(prompts)}"
    )
    assert min(cos) > 0.9, cos


def _spread_14(tensors: dict[str, torch.Tensor], module: str, row: int) -> None:
    """Row `row` of `module`: every block at the row's top exponent, block 3 (nonzero) 14 octaves below."""
    s = tensors[module + ".weight_scale"]
    s[row] = s[row].max()
    s[row, 3] -= 14
    tensors[module + ".weight_packed"][row, 48:64] = 0x11


def test_bf16_opt_in_served_unquantized_and_reported(
    trinity_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """Two matrices whose rows span 14 octaves (a dense MLP's gate_proj, one expert's up_proj): refused without the
    opt-in; with VLLM_TRN_ALLOW_BF16=1 served, each reported, and the fused parameter holding it (layer 0's
    gate_up_proj, layer 1's w13 stack) computed unquantized: logits equal to a reference that does the same."""
    from safetensors.torch import load_file, save_file

    mla, packed = trinity_dirs
    bad = shutil.copytree(packed, tmp_path / "packed-spread")
    dense, expert = "model.layers.0.mlp.gate_proj", "model.layers.1.mlp.experts.3.up_proj"
    f = str(bad / "model.safetensors")
    t = load_file(f)
    _spread_14(t, dense, 7)
    _spread_14(t, expert, 5)
    save_file(t, f)
    with pytest.raises(
        CheckpointFormatError, match=rf"model.safetensors: tensor {dense}.weight_packed: row 7.*14 octaves"
    ):
        list(packed_weights(bad, lambda m: True, keep_bf16=False))

    monkeypatch.setenv("VLLM_TRN_ALLOW_BF16", "1")
    prompts = random_prompts(2, [7, 30], seed=23)
    llm = _engine(bad, kv_cache_memory_bytes=256 << 20)
    try:
        served = _served(llm, prompts)
    finally:
        del llm
    log = capfd.readouterr()
    log = log.out + log.err
    for matrix in (dense, expert):
        assert f"tensor {matrix}.weight_packed: loaded as bfloat16 (exact)" in log, f"{matrix} not reported"
    assert "model.layers.0.mlp.gate_up_proj: held in bf16" in log
    assert "model.layers.1.mlp.experts.w13_weight: held in bf16" in log, log[-3000:]

    weights, fp8 = load_packed(bad)
    unquantized = {dense, dense.replace("gate", "up")} | {
        f"model.layers.1.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj")
    }
    assert unquantized <= fp8
    ref = patch_afmoe_fp8(load_hf_model(mla), weights, fp8 - unquantized)
    for prompt, (tokens, logits) in zip(prompts, served):
        _check(f"bf16 opt-in, prompt of {len(prompt)}", len(prompt), tokens, logits, _hf_logits(ref, prompt, tokens))
