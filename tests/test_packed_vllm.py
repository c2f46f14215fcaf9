"""Both models served by real vLLM from packed MXFP4 checkpoints (`vllm-trn pack`), against an independent FP8 forward.

The reference (tests/references/packed.py) decodes the packed files itself in float64 and applies the FP8 math
(activations rounded per token to Trainium2 FP8, FP8 weights with their row scales, bias): for Laplace inside the
float64 per-token recurrence of tests/references/laplace.py, for MLA-Trinity inside transformers'
AfmoeForCausalLM. Logits are compared along the path vLLM took (teacher forcing), so one near-tie cannot hide
the rest of a sequence. Against the unquantized model the packed one can only be close: that agreement is
printed (run with -s) and bounded below.

Rounding activations to FP8 (3 mantissa bits) turns float32 noise into jumps: an input that the engine (float32,
chunked prefill, oneDNN GEMMs) and the reference (float64) hold a few ulps apart, close to an FP8 rounding midpoint,
rounds to neighbouring FP8 values 2^-4 apart, and the recurrent state / the KV cache carries that forward; which
flips happen depends on the CPU's GEMM kernels. The reference shows the same jumps when its own activations are
perturbed by 1e-7 (relative) before rounding, so MLA-Trinity's reference is the run nearest to the served one among
the exact run and four perturbed ones (`nearest_reference_run`: each an equally valid FP8 forward), within FLIP_TOL
(docs/packed-format.md, "Serving tests and FP8 rounding flips", has the sizes seen). The checks are: Laplace's
one-token prompt, too few roundings to flip, equal to EXACT_TOL at its first step; every short prompt's logits
within FLIP_TOL at every step (the quantization itself moves logits by several units against the unquantized model,
a wiring error by more); clear argmaxes chosen; long prompts the same function (cosine); every FP8 matrix the engine
holds exactly the checkpoint's values (FP8 x row scale: `_check_shards`, at TP 1 too); and op-level exactness in
tests/test_fp8_expert.py.

What FLIP_TOL catches, measured (planted in the served MLA-Trinity's row scales after load, through
LLM.apply_model; prompts of 7 and 40 tokens, 12 steps; max |logit diff| vs the nearest of the five reference runs):
correctly wired 0.33 and 0.49; layer 0 down_proj's row scales one 32-row block off (every row's scale from the row 32
below) 8.9 and 6.0; rows 0-31 and 32-63 of layer 0's gate_up_proj swapped 3.7 and 1.1, of one routed expert's w13
2.6 and 3.7; one row's scale one exponent step up (2x): layer 0 down_proj 2.8 and 4.9, layer 0 up_proj 2.6 and 0.67,
a shared expert's down_proj 3.5 and 0.54, an LM head row 5.4 and 5.7, each failed by at least one prompt; but one
routed expert's w2 row (layer 2, expert 5, row 3) 2x: 0.33 and 0.43, inside the flips, which no tolerance separates
from the correct wiring's 0.49. That one the exact check of the held FP8 values catches, as it catches any scale
placed on the wrong row. `test_trinity_packed_equals_fp8_reference` plants the block shift and that 2x row and
asserts that its checks reject them.
"""

from __future__ import annotations

import copy
import functools
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import cosine, greedy_logits, random_prompts, raw_logits_llm, worker_functions_allowed
from tests.references.afmoe import (
    convert_to_mla,
    hf_greedy,
    load_hf_model,
    make_random_afmoe,
    teacher_forced_logits,
)
from tests.references.laplace import LaplaceReference
from tests.references.packed import load_packed, nearest_reference_run, patch_afmoe_fp8
from vllm_trn_plugin.kernels.fp8 import fp8_compute_copy
from vllm_trn_plugin.loaders.io import CheckpointFormatError
from vllm_trn_plugin.loaders.packed import pack
from vllm_trn_plugin.model_executors.mxfp4_fp8 import packed_weights

pytestmark = pytest.mark.vllm

VOCAB = 259
STEPS = 12
LAPLACE_LENGTHS = [1, 37, 300]  # 300 > the 256-token budget: chunked prefill
TRINITY_LENGTHS = [7, 40, 150]  # 150 > the sliding window (64)
SHORT = 40  # prompts up to this long: logits within FLIP_TOL of the reference's
FLIP_TOL = 1.0  # a few FP8 rounding flips (see above)
EXACT_TOL = 1e-4
LONG_COSINE = 0.99


def _served(llm, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:  # noqa: ANN001
    return greedy_logits(llm, prompts, STEPS, VOCAB)


def _check(what: str, prompt_len: int, tokens: list[int], got: torch.Tensor, ref: torch.Tensor) -> float:
    """Served logits equal the reference's along the served path (short prompts; long ones: same function);
    each token is the reference argmax unless tied."""
    err = float((got - ref).abs().max())
    if prompt_len > SHORT:
        assert cosine(got, ref) > LONG_COSINE, f"{what}: logits cosine {cosine(got, ref):.4f} vs the FP8 reference"
        return err
    assert err < FLIP_TOL, f"{what}: max |logit diff| {err:.2e} vs the FP8 reference"
    if prompt_len == 1:  # four layers' worth of roundings: too few to flip
        first = float((got[0] - ref[0]).abs().max())
        assert first < EXACT_TOL, f"{what}: prefill logits differ by {first:.2e} from the FP8 reference"
    for i, tok in enumerate(tokens):
        top2 = torch.topk(ref[i], 2).values
        if float(top2[0] - top2[1]) >= 2 * FLIP_TOL:
            assert tok == int(ref[i].argmax()), f"{what}: step {i} chose {tok}, reference argmax {int(ref[i].argmax())}"
    return err


def _fmt(lengths: list[int], errs: list[float]) -> str:
    return ", ".join(f"{n}: {e:.1e}" for n, e in zip(lengths, errs))


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
    llm = raw_logits_llm(laplace_packed, VOCAB, enforce_eager=False)  # the FP8 layers under torch.compile too
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
        cos.append(cosine(logits, _laplace_logits(plain, prompt, tokens)))
        agree += sum(a == b for a, b in zip(tokens, plain.greedy(prompt, STEPS).tokens))
    print(
        f"\nLaplace packed vs FP8 reference, max |logit diff| by prompt length: {_fmt(LAPLACE_LENGTHS, errs)}; "
        f"vs unquantized: logits cosine min {min(cos):.4f}, greedy tokens equal {agree}/{STEPS * len(prompts)}"
    )
    assert min(cos) > 0.9, cos


# Wiring errors planted in a served engine's row scales (see the module docstring): one that the logits bound
# rejects (every row's scale of a matrix taken from the row one 32-row block below) and one inside the FP8 flips that
# only the exact check of the held values rejects (one routed expert's row scale one exponent step up).
BLOCK_SHIFT = ("model.layers.0.mlp.down_proj.weight_scale", None)
ROW_2X = ("model.layers.2.mlp.experts.routed_experts.w2_weight_scale", (5, 3))


def _plant(model: torch.nn.Module, param: str, row: tuple[int, ...] | None, undo: bool = False) -> None:
    """Run in the worker (LLM.apply_model): `row` None: the row scales of `param` shifted by one 32-row block; else that
    row's scale doubled. `undo` takes it back exactly (the scales are powers of two)."""
    s = dict(model.named_parameters())[param].data
    if row is None:
        s.copy_(torch.roll(s, 32 if undo else -32, dims=-1))
    else:
        s[row] *= 0.5 if undo else 2.0


def _compute_forms(model: torch.nn.Module) -> dict[str, set[torch.dtype]]:
    """Run in the worker (LLM.apply_model): the dtypes of the compute copies each FP8 layer holds (fp8_compute)."""
    out = {}
    for name, module in model.named_modules():
        copies = getattr(module, "fp8_compute", None)
        if copies is not None:
            flat = [copies] if isinstance(copies, torch.Tensor) else [c for part in copies for c in part]
            out[name] = {c.dtype for c in flat}
    return out


def _check_compute_forms(forms: dict[str, set[torch.dtype]]) -> None:
    # bf16: the AVX-512 BF16 kernel's copy; uint8: FBGEMM's handle (kernels/fp8.fp8_compute_copy)
    want = fp8_compute_copy(torch.ones(32, 32).to(torch.float8_e4m3fn)).dtype
    assert "lm_head" in forms and len(forms) >= 8, forms
    assert {n: f for n, f in forms.items() if f != {want}} == {}, f"compute copies not all {want}"


def test_packed_bf16_engine_computes_from_the_fast_exact_copies(trinity_dirs: tuple[Path, Path]) -> None:
    """A bf16 engine, as users serve, holds the same compute copies as a plain process picks (vLLM loads the weights
    under bf16 as torch's default dtype, which once made the FBGEMM probe fail and every layer fall back to fp32
    copies: twice the memory and slower, docs/fp8.md has the figures) and decodes through them without error."""
    from vllm import LLM, SamplingParams

    with worker_functions_allowed():
        llm = LLM(
            str(trinity_dirs[1]),
            dtype="bfloat16",
            max_model_len=256,
            max_num_seqs=2,
            seed=0,
            kv_cache_memory_bytes=64 << 20,
            enforce_eager=True,
        )
        try:
            forms = llm.apply_model(_compute_forms)[0]
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            out = llm.generate([{"prompt_token_ids": [5, 9, 2]}], params, use_tqdm=False)
        finally:
            del llm
    _check_compute_forms(forms)
    assert len(out[0].outputs[0].token_ids) == 4


def test_trinity_packed_equals_fp8_reference(trinity_dirs: tuple[Path, Path]) -> None:
    """Served logits within FLIP_TOL of the reference's, every FP8 matrix held exactly; and both checks shown to
    matter on the same engine: a planted block shift of row scales fails the logits bound, a planted 2x row scale
    that stays inside it fails the exact check. Every FP8 layer computes from the copy this CPU multiplies fastest
    exactly (the AVX-512 BF16 kernel's bf16 copy or FBGEMM's fp16 handle: 2 bytes per weight, not fp32's 4)."""
    mla, packed = trinity_dirs
    prompts = random_prompts(len(TRINITY_LENGTHS), TRINITY_LENGTHS, seed=22)
    with worker_functions_allowed():
        llm = raw_logits_llm(packed, VOCAB)
        try:
            served = _served(llm, prompts)
            alone = _served(llm, prompts[:1])[0]
            held = llm.apply_model(_fp8_shards)
            forms = llm.apply_model(_compute_forms)[0]
            llm.apply_model(functools.partial(_plant, param=ROW_2X[0], row=ROW_2X[1]))
            held_2x = llm.apply_model(_fp8_shards)
            llm.apply_model(functools.partial(_plant, param=ROW_2X[0], row=ROW_2X[1], undo=True))
            llm.apply_model(functools.partial(_plant, param=BLOCK_SHIFT[0], row=BLOCK_SHIFT[1]))
            llm.reset_prefix_cache()
            shifted = _served(llm, prompts[:1])[0]
        finally:
            del llm
    _check_compute_forms(forms)
    plain = load_hf_model(mla)
    weights, fp8 = load_packed(packed)
    compared = _check_shards(held, weights, 1, False)
    with pytest.raises(AssertionError, match="rank 0 expert 5 w2"):
        _check_shards(held_2x, weights, 1, False)
    ref = patch_afmoe_fp8(copy.deepcopy(plain), weights, fp8)
    errs, cos, agree = [], [], 0
    for prompt, (tokens, logits) in zip(prompts, served):
        want = nearest_reference_run(logits, functools.partial(teacher_forced_logits, ref, prompt, tokens))
        errs.append(_check(f"MLA-Trinity, prompt of {len(prompt)}", len(prompt), tokens, logits, want))
        cos.append(cosine(logits, teacher_forced_logits(plain, prompt, tokens)))
        agree += sum(a == b for a, b in zip(tokens, hf_greedy(plain, prompt, STEPS)["tokens"]))
    assert alone[0] == served[0][0], "batched and alone differ"
    tokens, logits = shifted
    want = nearest_reference_run(logits, functools.partial(teacher_forced_logits, ref, prompts[0], tokens))
    planted = float((logits - want).abs().max())
    with pytest.raises(AssertionError, match=r"max \|logit diff\|"):
        _check("planted block shift", len(prompts[0]), tokens, logits, want)
    print(
        f"\nMLA-Trinity packed vs FP8 reference, max |logit diff| by prompt length: {_fmt(TRINITY_LENGTHS, errs)}; "
        f"vs unquantized: logits cosine min {min(cos):.4f}, greedy tokens equal {agree}/{STEPS * len(prompts)}; "
        f"{compared} FP8 matrices held exactly; planted block shift of row scales: {planted:.1e} (rejected), "
        "planted 2x row scale: rejected by the exact check"
    )
    assert min(cos) > 0.9, cos


def _spread_14(tensors: dict[str, torch.Tensor], module: str, row: int) -> None:
    """Row `row` of `module`: every block at the row's top exponent, block 3 (nonzero) 14 octaves below."""
    s = tensors[module + ".weight_scale"]
    s[row] = s[row].max()
    s[row, 3] -= 14
    tensors[module + ".weight_packed"][row, 48:64] = 0x11


def _head_row_14(tensors: dict[str, torch.Tensor], row: int) -> None:
    """Row `row` of the FP8 LM head: one value 2^-8, at least 14 octaves below the row's top (the packer puts it in
    (120, 240]). FP8 E4M3 itself reaches 2^-9, so one row scale holds it exactly: no bf16 is needed there."""
    w = tensors["lm_head.weight"].float()
    w[row, 0] = 2.0**-8
    assert float(w[row].abs().max()) >= 2.0**6, "LM head row top not where the packer puts it"
    tensors["lm_head.weight"] = w.to(torch.float8_e4m3fn)


def _with_spread_rows(packed: Path, dst: Path, rows: dict[str, int], head_row: int) -> Path:
    from safetensors.torch import load_file, save_file

    bad = shutil.copytree(packed, dst)
    f = str(bad / "model.safetensors")
    t = load_file(f)
    for module, row in rows.items():
        _spread_14(t, module, row)
    _head_row_14(t, head_row)
    save_file(t, f)
    return bad


def _check_refused(bad: Path, rows: dict[str, int]) -> None:
    """Without the opt-in the load stops at the first such matrix, naming it, its row and the switch."""
    with pytest.raises(CheckpointFormatError, match=r"14 octaves.*VLLM_TRN_ALLOW_BF16=1") as e:
        list(packed_weights(bad, lambda m: True, keep_bf16=False))
    named = [m for m, r in rows.items() if f"model.safetensors: tensor {m}.weight_packed: row {r}:" in str(e.value)]
    assert named, str(e.value)


def _serve_opt_in(
    bad: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> tuple[list[tuple[list[int], torch.Tensor]], str]:
    monkeypatch.setenv("VLLM_TRN_ALLOW_BF16", "1")
    llm = raw_logits_llm(bad, VOCAB)
    try:
        served = _served(llm, prompts)
    finally:
        del llm
    log = capfd.readouterr()
    return served, log.out + log.err


def _check_reports(log: str, matrices: list[str], params: list[str]) -> None:
    """The reader names every matrix, the layers every parameter held in bf16, and the FP8 LM head is not one."""
    for matrix in matrices:
        assert f"tensor {matrix}.weight_packed: loaded as bfloat16 (exact)" in log, f"{matrix} not reported"
    held = {line.split(": held in bf16")[0].split()[-1] for line in log.splitlines() if ": held in bf16" in line}
    assert sorted(held) == sorted(params), sorted(held)


def test_bf16_opt_in_laplace_every_placement(
    laplace_packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """Rows spanning 14 octaves in a W3 (down_proj: no FP8 partner), in both halves of another layer's gate/up pair,
    in one half of a third layer's, and in the FP8 LM head: refused without the opt-in (the head alone loads, in
    FP8); with VLLM_TRN_ALLOW_BF16=1 served, each matrix and parameter reported, the parameters holding them computed
    unquantized and the LM head still FP8: logits equal to the float64 reference doing the same (the one-token
    prompt's first step exactly)."""
    rows = {
        "model.layers.0.mlp.down_proj": 7,
        "model.layers.1.mlp.gate_proj": 3,
        "model.layers.1.mlp.up_proj": 11,
        "model.layers.2.mlp.up_proj": 5,
    }
    bad = _with_spread_rows(laplace_packed, tmp_path / "laplace-spread", rows, head_row=65)
    _check_refused(bad, rows)
    head_only = _with_spread_rows(laplace_packed, tmp_path / "laplace-head-row", {}, head_row=65)
    head = dict(packed_weights(head_only, lambda m: True, keep_bf16=False))["lm_head.weight"]
    assert head.dtype == torch.float8_e4m3fn, f"the FP8 LM head with a 14-octave row loads as {head.dtype}"
    prompts = random_prompts(3, [1, 7, 30], seed=24)
    served, log = _serve_opt_in(bad, prompts, monkeypatch, capfd)
    _check_reports(
        log,
        list(rows),
        ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.gate_up_proj", "model.layers.2.mlp.gate_up_proj"],
    )

    ref = LaplaceReference(bad)
    unquantized = set(rows) | {"model.layers.2.mlp.gate_proj"}
    assert unquantized <= ref.fp8 and "lm_head" in ref.fp8
    ref.fp8 -= unquantized
    for prompt, (tokens, logits) in zip(prompts, served):
        want = _laplace_logits(ref, prompt, tokens)
        _check(f"Laplace bf16 opt-in, prompt of {len(prompt)}", len(prompt), tokens, logits, want)


def test_bf16_opt_in_served_unquantized_and_reported(
    trinity_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """Rows spanning 14 octaves in the dense MLP's gate, up and down (no FP8 partner left), a shared expert's gate (its
    up stays FP8) and another's down, one routed expert's up and another layer's expert's down, and the FP8 LM head:
    refused without the opt-in; with VLLM_TRN_ALLOW_BF16=1 served, each matrix and parameter reported (the fused
    gate_up_proj / down_proj, the w13 / w2 stack of the MoE layer), those computed unquantized and the LM head
    still FP8: logits equal to the reference (transformers' AFMoE) doing the same."""
    mla, packed = trinity_dirs
    rows = {
        "model.layers.0.mlp.gate_proj": 7,
        "model.layers.0.mlp.up_proj": 2,
        "model.layers.0.mlp.down_proj": 9,
        "model.layers.1.mlp.shared_experts.gate_proj": 4,
        "model.layers.1.mlp.experts.3.up_proj": 5,
        "model.layers.2.mlp.shared_experts.down_proj": 6,
        "model.layers.2.mlp.experts.5.down_proj": 1,
    }
    bad = _with_spread_rows(packed, tmp_path / "packed-spread", rows, head_row=65)
    _check_refused(bad, rows)
    prompts = random_prompts(2, [7, 30], seed=23)
    served, log = _serve_opt_in(bad, prompts, monkeypatch, capfd)
    _check_reports(
        log,
        list(rows),
        [
            "model.layers.0.mlp.gate_up_proj",
            "model.layers.0.mlp.down_proj",
            "model.layers.1.mlp.shared_experts.gate_up_proj",
            "model.layers.1.mlp.experts.w13_weight",
            "model.layers.2.mlp.shared_experts.down_proj",
            "model.layers.2.mlp.experts.w2_weight",
        ],
    )

    weights, fp8 = load_packed(bad)
    unquantized = (
        {f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
        | {f"model.layers.1.mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj")}
        | {f"model.layers.1.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj")}
        | {"model.layers.2.mlp.shared_experts.down_proj"}
        | {f"model.layers.2.mlp.experts.{e}.down_proj" for e in range(8)}
    )
    assert unquantized <= fp8 and "lm_head" in fp8
    ref = patch_afmoe_fp8(copy.deepcopy(load_hf_model(mla)), weights, fp8 - unquantized)
    for prompt, (tokens, logits) in zip(prompts, served):
        want = nearest_reference_run(logits, functools.partial(teacher_forced_logits, ref, prompt, tokens))
        _check(f"bf16 opt-in, prompt of {len(prompt)}", len(prompt), tokens, logits, want)


# Tensor and expert parallelism (two CPU workers over gloo). Each engine is checked against the reference doing its
# own rounding (patch_afmoe_fp8's `tp`): a tensor-parallel rank rounds its own slice of each down_proj input, so TP=2
# and TP=1 are different FP8 forwards; under expert parallelism (EP=2) the routed experts are whole on one rank.
LAYOUTS = {
    "TP=2": (dict(tensor_parallel_size=2), dict(tp=2)),
    "EP=2": (dict(tensor_parallel_size=2, enable_expert_parallel=True), dict(tp=2, expert_tp=1)),
}


def _fp8_shards(model: torch.nn.Module) -> dict:
    """Run in each worker (LLM.apply_model): the rank's FP8 matrices as the values they hold (FP8 x row scale, exact
    in float32), their bias corrections, and which experts it holds."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from vllm_trn_plugin.kernels.fp8_expert import from_kernel_layout, in_kernel_layout

    def value(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        if in_kernel_layout(w):  # an FP8 expert stack as loaded: the kernel's tiled layout (fp8_expert.py)
            w = from_kernel_layout(w)
        return w.float() * s.float().unsqueeze(-1)

    out: dict = {"rank": get_tensor_model_parallel_rank()}
    for name, module in model.named_modules():
        if hasattr(module, "w13_weight"):
            out[name] = {
                "w13": value(module.w13_weight, module.w13_weight_scale),
                "w2": value(module.w2_weight, module.w2_weight_scale),
                "b13": module.w13_bias_correction.clone(),
                "b2": module.w2_bias_correction.clone(),
                "map": None if module.expert_map is None else module.expert_map.tolist(),
            }
        elif getattr(module, "weight", None) is not None and module.weight.dtype == torch.float8_e4m3fn:
            b = getattr(module, "bias_correction", None)
            out[name] = {"w": value(module.weight, module.weight_scale), "b": None if b is None else b.clone()}
    return out


def _check_shards(ranks: list[dict], weights: dict[str, torch.Tensor], tp: int, ep: bool) -> int:
    """Each rank's FP8 values are exactly its part of the checkpoint's (decoded independently, float64): gate/up and
    LM head rows, down_proj columns (bias correction on rank 0 only), experts' w1/w3 rows and w2 columns, or under
    expert parallelism whole experts, those the expert map gives the rank. Returns the matrices compared."""
    compared = 0

    def part(t: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        n = t.shape[dim] // tp
        return t.narrow(dim, rank * n, n)

    def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        nonlocal compared
        assert got.shape == want.shape and torch.equal(got.double(), want.double()), what
        compared += 1

    for shard in ranks:
        r = shard["rank"]
        for name, held in shard.items():
            if name == "rank":
                continue
            if name == "lm_head":  # vocabulary-parallel, each rank's part padded as vLLM pads it (zero rows)
                n = held["w"].shape[0]
                head = weights["lm_head.weight"]
                rows = torch.nn.functional.pad(head, (0, 0, 0, n * tp - head.shape[0]))[r * n : (r + 1) * n]
                same(held["w"], rows, f"rank {r} LM head rows")
            elif name.endswith(".gate_up_proj"):
                m = name.removesuffix(".gate_up_proj")
                g, u = (weights[f"{m}.{p}_proj.weight"] for p in ("gate", "up"))
                same(held["w"], torch.cat([part(g, 0, r), part(u, 0, r)]), f"rank {r} {name}")
                bias = torch.cat([part(weights[f"{m}.{p}_proj.bias"], 0, r) for p in ("gate", "up")])
                same(held["b"], bias, f"rank {r} {name} bias correction")
            elif name.endswith(".down_proj"):
                same(held["w"], part(weights[f"{name}.weight"], 1, r), f"rank {r} {name} columns")
                bias = weights[f"{name}.bias"] if r == 0 else torch.zeros_like(weights[f"{name}.bias"])
                same(held["b"], bias, f"rank {r} {name} bias correction (rank 0 only)")
            elif "w13" in held:
                name = name[: name.index(".experts") + len(".experts")]
                experts = (
                    [e for e, local in enumerate(held["map"]) if local >= 0] if ep else range(held["w13"].shape[0])
                )
                assert not ep or len(experts) == held["w13"].shape[0], (r, held["map"])
                for i, e in enumerate(experts):
                    p = f"{name}.{e}"
                    g, u, d = (weights[f"{p}.{x}_proj.weight"] for x in ("gate", "up", "down"))
                    k = 1 if ep else tp
                    rank = 0 if ep else r
                    rows = torch.cat([g.chunk(k)[rank], u.chunk(k)[rank]])
                    same(held["w13"][i], rows, f"rank {r} expert {e} w13")
                    same(held["w2"][i], d.chunk(k, dim=1)[rank], f"rank {r} expert {e} w2")
                    b2 = weights[f"{p}.down_proj.bias"]
                    same(held["b2"][i], b2 if ep or r == 0 else torch.zeros_like(b2), f"rank {r} expert {e} w2 bias")
            else:
                raise AssertionError(f"rank {r}: unexpected FP8 module {name}")
    return compared


@pytest.fixture(scope="module")
def trinity_biased(trinity_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packed checkpoint with random bias-correction vectors (RTN packing writes zeros), so that where each
    rank adds them is seen: a row-parallel one added on every rank would count tp times."""
    from safetensors.torch import load_file, save_file

    dst = shutil.copytree(trinity_dirs[1], tmp_path_factory.mktemp("trinity-biased") / "packed")
    g = torch.Generator().manual_seed(25)
    for f in dst.glob("*.safetensors"):
        t = load_file(str(f))
        for name in [n for n in t if n.endswith(".bias") and n.removesuffix(".bias") + ".weight_packed" in t]:
            t[name] = (torch.randn(t[name].shape, generator=g) * 0.05).to(t[name].dtype)
        save_file(t, str(f), {"format": "pt"})
    return dst


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trinity_packed_sharded_equals_its_fp8_reference(
    trinity_dirs: tuple[Path, Path], trinity_biased: Path, layout: str
) -> None:
    """A packed checkpoint (with nonzero bias corrections) at tensor parallelism 2 (experts split by their
    intermediate rows) and at expert parallelism 2 (experts whole, four per rank): each rank holds exactly its part
    of the FP8 rows and of the bias corrections, and the served logits are the reference's doing the same rounding,
    within the FP8-flip bound of the test above (same prompts and checks)."""
    mla, packed = trinity_dirs[0], trinity_biased
    engine_kw, rounding = LAYOUTS[layout]
    prompts = random_prompts(len(TRINITY_LENGTHS), TRINITY_LENGTHS, seed=22)
    with worker_functions_allowed():
        llm = raw_logits_llm(packed, VOCAB, kv_cache_memory_bytes=128 << 20, **engine_kw)
        try:
            ranks = llm.apply_model(_fp8_shards)
            served = _served(llm, prompts)
        finally:
            del llm
    weights, fp8 = load_packed(packed)
    assert all(weights[n].abs().max() > 0 for n in weights if n.endswith("down_proj.bias")), "biases must be nonzero"
    compared = _check_shards(ranks, weights, 2, "enable_expert_parallel" in engine_kw)
    ref = patch_afmoe_fp8(copy.deepcopy(load_hf_model(mla)), weights, fp8, **rounding)
    errs = []
    for prompt, (tokens, logits) in zip(prompts, served):
        want = nearest_reference_run(logits, functools.partial(teacher_forced_logits, ref, prompt, tokens))
        errs.append(_check(f"MLA-Trinity {layout}, prompt of {len(prompt)}", len(prompt), tokens, logits, want))
    print(
        f"\nMLA-Trinity packed at {layout}: {compared} per-rank FP8 matrices exact; max |logit diff| vs its FP8 "
        f"reference by prompt length: {_fmt(TRINITY_LENGTHS, errs)}"
    )
