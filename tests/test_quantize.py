"""`vllm-trn quantize`: MXFP4 GPTQ with bias correction, in the packed format (tools/quantize.py, tools/gptq.py).

The checks read the tool's output with the independent float64 reader of tests/references/packed.py (MXFP4 decoded by
table, FP8 activations by ml_dtypes' Trainium2 E4M3) inside transformers' `AfmoeForCausalLM`, and compare with the
unquantized model and with `vllm-trn pack` (round-to-nearest, the baseline). The checkpoint is a random MLA-Trinity
(convert-mla of a random AFMoE at its exact latent 256). Calibration is 64 x 128 tokens: 16 per input of the dense MLP,
~4 per input of an expert (top-2 of 8; at full size the default threshold means >= 8). With fewer, GPTQ fits the
calibration set and loses to round-to-nearest on held-out data (docs/checkpoint-tools.md). The RTN threshold is set
to fall among the experts' token counts; the default, 16384, is checked where it is defined.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import cosine, random_prompts, served_greedy_logits
from tests.references import read_safetensors_dir
from tests.references.afmoe import clear_model_cache, load_hf_model, make_random_afmoe, teacher_forced_logits
from tests.references.packed import (
    ct_decompress,
    expanded_values,
    fp8_activation,
    fp8_matmul,
    load_packed,
    patch_afmoe_fp8,
)
from vllm_trn_plugin.cli import main as cli
from vllm_trn_plugin.loaders.mxfp4 import (
    MAX_ROW_SPREAD,
    decode_mxfp4,
    expand_rows,
    limit_spread,
    pack_codes,
    quantize_codes,
    quantize_rtn,
    round_to_grid,
    rtn_exponents,
)
from vllm_trn_plugin.loaders.packed import declares_packed, iter_checkpoint
from vllm_trn_plugin.tools.convert_mla import convert_mla
from vllm_trn_plugin.tools.gptq import gptq
from vllm_trn_plugin.tools.quantize import QuantizeOptions

SEQ = 128
CALIB = torch.randint(0, 256, (64, SEQ), generator=torch.Generator().manual_seed(7))
HELD_OUT = torch.randint(0, 256, (4, SEQ), generator=torch.Generator().manual_seed(8))
THRESHOLD = 1024  # tokens: between the least and the most used experts of this calibration set
VOCAB = 259

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantize")
    orig = make_random_afmoe(root / "orig", seed=3, full_kv_rank=256)
    mla = convert_mla(orig, root / "mla", latent=256, calib=CALIB[:8], progress=False).dst  # exact: any data
    calib = root / "calib.pt"
    torch.save(CALIB, calib)
    gptq_dir, rtn_dir = root / "gptq", root / "rtn"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli(
            ["quantize", str(mla), str(gptq_dir), "--calib", str(calib), "--calib-tokens", str(CALIB.numel())]
            + ["--seq-len", str(SEQ), "--rtn-threshold", str(THRESHOLD), "--measure"]
        )
        log = out.getvalue()
        cli(["pack", str(mla), str(rtn_dir)])
    print(out.getvalue())
    (root / "quantize.log").write_text(log)
    return {"mla": mla, "gptq": gptq_dir, "rtn": rtn_dir, "log": root / "quantize.log"}


class _Stop(Exception):
    pass


def _mlp_inputs(model: torch.nn.Module, tokens: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    """The input of each listed layer's MLP block (after the pre-MLP norm), [tokens, hidden]; the forward stops
    at the last one."""
    seen: dict[int, torch.Tensor] = {}

    def capture(i: int, x: torch.Tensor) -> None:
        seen[i] = x.reshape(-1, x.shape[-1]).detach().clone()
        if i == max(layers):
            raise _Stop

    hooks = [
        model.model.layers[i].mlp.register_forward_pre_hook(lambda _m, args, i=i: capture(i, args[0])) for i in layers
    ]
    try:
        with torch.no_grad():
            model(input_ids=tokens)
    except _Stop:
        pass
    finally:
        for h in hooks:
            h.remove()
    return seen


def _rel_mse(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).pow(2).mean() / ref.double().pow(2).mean())


def test_output_loads_exactly_and_is_declared(dirs: dict[str, Path]) -> None:
    assert declares_packed(json.loads((dirs["gptq"] / "config.json").read_text())["quantization_config"])
    names = dict(iter_checkpoint(dirs["gptq"]))  # no VLLM_TRN_ALLOW_BF16: every row expands exactly to FP8
    assert names["lm_head.weight"].is_fp8
    assert names["model.layers.1.mlp.experts.0.down_proj.weight"].is_fp8
    assert names["model.layers.3.self_attn.kv_a_proj.weight"].dtype == torch.float32  # attention unquantized
    assert names["model.layers.3.self_attn.o_proj.weight"].dtype == torch.float32
    assert names["model.layers.1.mlp.router.gate.weight"].dtype == torch.float32


def test_gptq_beats_round_to_nearest_on_held_out_layer_output(dirs: dict[str, Path]) -> None:
    """Each layer's MLP block on the same held-out inputs (the unquantized model's): GPTQ's output error is lower
    than RTN's (FP8 activations in both)."""
    plain = load_hf_model(dirs["mla"])
    layers = [0, 1, 2, 3]  # 0: dense MLP, 1-3: shared + routed experts
    xs = _mlp_inputs(plain, HELD_OUT, layers)
    errs = {}
    for kind in ("gptq", "rtn"):
        model = patch_afmoe_fp8(copy.deepcopy(plain), *load_packed(dirs[kind]))
        with torch.no_grad():
            errs[kind] = [
                _rel_mse(model.model.layers[i].mlp(xs[i][None]), plain.model.layers[i].mlp(xs[i][None])) for i in layers
            ]
    clear_model_cache()
    print(
        "\nheld-out MLP output relative MSE, GPTQ / RTN: "
        + ", ".join(f"layer {i}: {g:.2e} / {r:.2e}" for i, g, r in zip(layers, errs["gptq"], errs["rtn"]))
    )
    for i, g, r in zip(layers, errs["gptq"], errs["rtn"]):
        assert g < 0.95 * r, (i, g, r)


def test_bias_correction_zeroes_mean_output_error_on_calibration(dirs: dict[str, Path]) -> None:
    """On the calibration tokens, through the quantized earlier layers (as the tool calibrates): the mean output
    error of each GPTQ matrix, W x~ - (Q x~ + b), is zero up to b's bf16 rounding; without b it is not."""
    weights, fp8 = load_packed(dirs["gptq"])
    model = patch_afmoe_fp8(copy.deepcopy(load_hf_model(dirs["mla"])), weights, fp8)
    orig, _ = load_packed(dirs["mla"])
    clear_model_cache()
    xs = _mlp_inputs(model, CALIB, [0, 1])
    layer1 = model.model.layers[1].mlp
    _, _, chosen = layer1.router(xs[1][None], layer1.expert_bias)
    counts = torch.bincount(chosen.reshape(-1), minlength=8)
    expert = int(torch.argmax(counts))  # the most used expert: solved by GPTQ
    assert counts[expert] >= THRESHOLD
    tok = (chosen == expert).any(-1)
    units = {
        "model.layers.0.mlp": xs[0],
        "model.layers.1.mlp.shared_experts": xs[1],
        f"model.layers.1.mlp.experts.{expert}": xs[1][tok],
    }
    for unit, x in units.items():
        h = torch.nn.functional.silu(fp8_matmul(weights, f"{unit}.gate_proj", x)) * fp8_matmul(
            weights, f"{unit}.up_proj", x
        )
        for proj, inp in (("gate_proj", x), ("up_proj", x), ("down_proj", h)):
            m = f"{unit}.{proj}"
            xq = fp8_activation(inp)
            err = xq @ (orig[m + ".weight"] - weights[m + ".weight"]).T  # W x~ - Q x~, per token
            bias = weights[m + ".bias"]
            before, after = err.mean(0), err.mean(0) - bias
            # Left: b's bf16 rounding (<= 2^-9 |b|) and the few FP8 rounding flips where this forward (transformers,
            # float64 MLPs) and the tool's (float32) hold an activation on either side of a rounding midpoint.
            ratio = float(after.norm() / before.norm())
            print(f"\n{m}: |mean error| {float(before.norm()):.2e} -> {float(after.norm()):.2e} with the bias")
            assert ratio < 0.05, (m, ratio)


def test_rtn_fallback_below_threshold(dirs: dict[str, Path]) -> None:
    """Experts under the threshold are plain round-to-nearest (quantize_rtn's codes and scales) with a zero bias;
    the others are GPTQ (codes differ, bias nonzero). The default threshold is 16384."""
    assert QuantizeOptions().rtn_threshold == 16384
    weights, _ = load_packed(dirs["mla"])
    packed = read_safetensors_dir(dirs["gptq"])
    fallback, solved = [], []
    for layer in (1, 2, 3):
        for e in range(8):
            m = f"model.layers.{layer}.mlp.experts.{e}.down_proj"
            codes, scales = quantize_rtn(weights[m + ".weight"].float())
            is_rtn = bool((packed[m + ".bias"] == 0).all())
            if is_rtn:
                assert torch.equal(packed[m + ".weight_packed"], codes) and torch.equal(
                    packed[m + ".weight_scale"], scales
                )
                fallback.append(m)
            else:
                assert not torch.equal(packed[m + ".weight_packed"], codes)
                solved.append(m)
    print(f"\n{len(fallback)} experts by RTN fallback, {len(solved)} by GPTQ (threshold {THRESHOLD} tokens)")
    assert fallback and solved


def test_compressed_tensors_decodes_every_packed_matrix_as_the_plugin(dirs: dict[str, Path]) -> None:
    """The files `vllm-trn quantize` and `vllm-trn pack` write, read by compressed-tensors itself (its target matching
    on config.json's declaration, its MXFP4 and FP8 decompressors): it finds exactly the stored quantized matrices,
    and each decodes bit for bit to the plugin's `decode_mxfp4` and to the loader's FP8 rows times their row scales
    (the LM head: its FP8 weight times its channel scales)."""
    for kind in ("gptq", "rtn"):
        ct = ct_decompress(dirs[kind])
        stored = read_safetensors_dir(dirs[kind])
        mxfp4 = {n.removesuffix(".weight_packed") for n in stored if n.endswith(".weight_packed")}
        assert set(ct) == mxfp4 | {"lm_head"} and len(mxfp4) == 3 + 3 * (8 + 1) * 3, (kind, sorted(set(ct) ^ mxfp4))
        loaded = dict(iter_checkpoint(dirs[kind]))
        for m in sorted(mxfp4):
            decoded = decode_mxfp4(stored[m + ".weight_packed"], stored[m + ".weight_scale"])
            assert torch.equal(decoded.double(), ct[m]), (kind, m)
            assert torch.equal(expanded_values(loaded[m + ".weight"]), ct[m]), (kind, m)
        assert torch.equal(expanded_values(loaded["lm_head.weight"]), ct["lm_head"]), kind


def test_far_blocks_are_clamped_to_loadable_rows() -> None:
    """A row whose natural block exponents span 20 octaves is written within 13 (the FP8 expansion's exactness
    rule), and GPTQ with act-order and Hessian-weighted exponents beats RTN on its layer output."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 16, 256, generator=g) * 0.05
    w[0, 3, 32:64] *= 2.0**-20  # one block 20 octaves below the rest of its row
    x = torch.randn(2, 1024, 256, generator=g) * torch.exp(torch.randn(256, generator=g))
    h = x.transpose(1, 2) @ x
    assert int(rtn_exponents(w[0, 3]).max() - rtn_exponents(w[0, 3]).min()) >= 20
    q, exp = gptq(w, h.clone())
    assert int(exp.amax(-1).sub(exp.amin(-1)).max()) <= MAX_ROW_SPREAD
    codes = pack_codes(quantize_codes(q, exp, exact=True))
    m = expand_rows(codes, (exp + 127).to(torch.uint8), file="test", tensor="w")
    assert m.is_fp8 and torch.equal(expanded_values(m), q.double())
    rtn_exp = limit_spread(rtn_exponents(w))
    rtn = round_to_grid(w, rtn_exp.repeat_interleave(32, -1))

    def err(qq: torch.Tensor) -> float:
        return sum(float(torch.trace((w[e] - qq[e]) @ h[e] @ (w[e] - qq[e]).T)) for e in range(2))

    assert err(q) < 0.75 * err(rtn), (err(q), err(rtn))


def test_token_chunks_change_nothing_but_rounding(
    dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At full scale the calibration activations pass through the MLPs MLP_CHUNK_TOKENS rows at a time (memory);
    with chunks of 1000 tokens (9 per layer here, uneven last chunk, experts' token lists split too) the output
    is the one-chunk output but for float32 summation order: every unquantized tensor and RTN matrix byte for
    byte, each layer's served MLP output error (computed from the chunked outputs) within 1%. GPTQ's codes are
    not compared: its error feedback carries any rounding difference in H forward, so many codes differ between the
    two summation orders, at equal error."""
    from vllm_trn_plugin.tools import afmoe_forward
    from vllm_trn_plugin.tools import quantize as quantize_mod

    for mod in (afmoe_forward, quantize_mod):
        monkeypatch.setattr(mod, "MLP_CHUNK_TOKENS", 1000)
    opts = QuantizeOptions(rtn_threshold=THRESHOLD, measure=True)
    report = quantize_mod.quantize(dirs["mla"], tmp_path / "chunked", calib=CALIB, options=opts, progress=False)
    a, b = read_safetensors_dir(dirs["gptq"]), read_safetensors_dir(tmp_path / "chunked")
    assert a.keys() == b.keys()
    for m in report.rtn:
        assert torch.equal(a[m + ".weight_packed"], b[m + ".weight_packed"]), m
    for name in a:
        if not name.endswith((".weight_packed", ".weight_scale", ".bias")):
            assert torch.equal(a[name], b[name]), name
    log = dirs["log"].read_text()
    one_chunk = {int(i): float(e) for i, e in re.findall(r"layer (\d+): MLP output error (\S+)", log)}
    print(f"\nlayer MLP output error, 1000-token chunks / one chunk: {report.layer_error} / {one_chunk}")
    assert report.rtn and report.gptq
    for i, err in report.layer_error.items():
        assert abs(err / one_chunk[i] - 1) < 0.01, (i, err, one_chunk[i])


@pytest.mark.vllm
def test_converted_and_quantized_checkpoint_serves(dirs: dict[str, Path]) -> None:
    """convert-mla -> quantize output in real vLLM: greedy tokens; logits equal (cosine) to the independent FP8
    reference reading of the same files (tests/references/packed.py) along the served path, and close to the
    unquantized converted model."""
    prompts = random_prompts(2, [9, 90], seed=31)
    steps = 8
    served = served_greedy_logits(dirs["gptq"], prompts, steps, VOCAB)
    plain = load_hf_model(dirs["mla"])
    fp8_ref = patch_afmoe_fp8(copy.deepcopy(plain), *load_packed(dirs["gptq"]))
    cos_ref, cos_plain = [], []
    for prompt, (tokens, got) in zip(prompts, served):
        assert len(tokens) == steps
        cos_ref.append(cosine(got, teacher_forced_logits(fp8_ref, prompt, tokens)))
        cos_plain.append(cosine(got, teacher_forced_logits(plain, prompt, tokens)))
    clear_model_cache()
    print(
        f"\nserved logits cosine vs the FP8 reference of the same files: {[f'{c:.4f}' for c in cos_ref]}; "
        f"vs the unquantized converted model: {[f'{c:.4f}' for c in cos_plain]}"
    )
    # FP8 activation rounding flips (see test_packed_vllm) keep the first from being exactly 1.
    assert min(cos_ref) > 0.99, cos_ref
    assert min(cos_plain) > 0.9, cos_plain  # as test_packed_vllm: quantization moves random models' logits this much
