"""MLA-Trinity served from MXFP4 checkpoints written by compressed-tensors itself, as llm-compressor writes them.

The checkpoint: a random AFMoE (tests/references/afmoe.py) converted to MLA-Trinity, its tensors put back into torch
modules under the checkpoint's names (every matrix an `nn.Linear`, each expert its own, as llm-compressor unfuses
MoE experts to calibrate them; the embedding an `nn.Embedding`), then compressed-tensors' own lifecycle:
`apply_quantization_config` with its MXFP4A16 preset on targets ["Linear"] and a recipe's ignore list, each weight's
per-32-block scale from its min/max (`compute_dynamic_scales_and_zp`, what the recipes' memoryless min-max observer
computes for a weight), `ModelCompressor.compress_model` in format `mxfp4-pack-quantized` and
`ModelCompressor.update_config` for config.json (which, like llm-compressor's checkpoints, lists every ignored Linear
by its exact name). Nothing of the plugin's packer is involved; the files carry no bias-correction vectors.

The reference decompresses every MXFP4 matrix with compressed-tensors' own decompressor (the compressor its registry
holds for the declared format; its model-free `CompressedTensorsDequantizer` asks MXFP4 for an NVFP4 global scale
in 0.17 and cannot read these files) and computes transformers' AfmoeForCausalLM with those matrices under the FP8
numerics the plugin serves them with (tests/references/packed.py: per-token FP8 activations, float64 matmuls; attention,
router and norms transformers' own). Rounding activations to FP8 turns float32-vs-float64 noise into jumps: an input
near an FP8 rounding midpoint lands on either neighbour, the KV cache carries it on, and a near-tied router can turn
one such flip into a different expert; the reference with its own activations perturbed by 1e-7 (relative) before
rounding shows the same profile, step for step. So the reference is a set: the exact
run and four perturbed ones (`packed_reference.nearest_reference_run`), each an equally valid FP8 forward. A short
prompt's served logits must be within FLIP_TOL (test_packed_vllm's bound for a few unsampled flips) of one of them
at every step, each clear argmax of that run chosen; long prompts the same function (cosine). The quantization
itself moves logits by several units against the unquantized model, a wiring error by more.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tests.helpers import cosine, load_in_child, random_prompts, served_greedy_logits
from tests.references import packed as packed_reference
from tests.references import read_safetensors_dir
from tests.references.afmoe import convert_to_mla, load_hf_model, make_random_afmoe, teacher_forced_logits

pytestmark = pytest.mark.vllm

VOCAB = 259
STEPS = 12
LENGTHS = [7, 40, 150]  # 150 > the sliding window (64)
SHORT = 40
FLIP_TOL = 0.5
LONG_COSINE = 0.99
# llm-compressor's usual MoE recipe ignores the LM head and the router (`re:.*mlp.gate$` in most MoE models; AFMoE's
# transformers module is `mlp.router.gate`); attention stays quantized unless ignored too.
RECIPE_IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*router.gate$"]
SERVED_IGNORE = [*RECIPE_IGNORE, "re:.*self_attn.*"]  # the plugin serves attention unquantized


def _module_tree(tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The checkpoint's tensors as torch modules under their own names: each 2-D `<m>.weight` an nn.Linear (the
    embedding an nn.Embedding), every other tensor a parameter of a plain module."""
    root = nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        parent = root
        for p in path[:-1]:
            if getattr(parent, p, None) is None:
                parent.add_module(p, nn.Module())
            parent = getattr(parent, p)
        if leaf == "weight" and t.dim() == 2:
            m = nn.Embedding(*t.shape) if path[-1] == "embed_tokens" else nn.Linear(t.shape[1], t.shape[0], bias=False)
            m.weight = nn.Parameter(t.clone(), requires_grad=False)
            parent.add_module(path[-1], m)
        else:
            if getattr(parent, path[-1], None) is None:
                parent.add_module(path[-1], nn.Module())
            getattr(parent, path[-1]).register_parameter(leaf, nn.Parameter(t.clone(), requires_grad=False))
    return root


def write_ct_mxfp4(src: Path, dst: Path, ignore: list[str]) -> Path:
    """`src` (an unquantized checkpoint) in compressed-tensors' mxfp4-pack-quantized format, written by that library."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    model = _module_tree(read_safetensors_dir(src))
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore))
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is not None:
                scale, zero_point = compute_dynamic_scales_and_zp(module.weight, args, module)
                module.weight_scale.copy_(scale)
                module.weight_zero_point.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="mxfp4-pack-quantized")
    compressor.compress_model(model)
    dst.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(dst / "model.safetensors"))
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model.safetensors"):
            shutil.copy2(f, dst / f.name)
    compressor.update_config(str(dst))
    return dst


def ct_decompressed(ckpt: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every matrix compressed-tensors' own matching and decompressor find quantized in `ckpt`, float64 under
    `<m>.weight` with a zero `<m>.bias`, and their module names."""
    matrices = packed_reference.ct_decompress(ckpt)
    stored = {n.removesuffix(".weight_packed") for n in read_safetensors_dir(ckpt) if n.endswith(".weight_packed")}
    assert stored == set(matrices), "compressed-tensors' matching disagrees with what its compressor wrote"
    out: dict[str, torch.Tensor] = {}
    for module, w in matrices.items():
        # The packed format's bias-correction vector; compressed-tensors writes none, which is a zero one
        # (packed_reference.patch_afmoe_fp8 keys its FP8 layers on these vectors).
        out[f"{module}.weight"], out[f"{module}.bias"] = w, torch.zeros(w.shape[0], dtype=torch.float64)
    return out, set(matrices)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct-mxfp4")
    orig = make_random_afmoe(root / "orig", seed=5, full_kv_rank=256)
    mla = convert_to_mla(orig, root / "mla", kv_lora_rank=256)
    return {"mla": mla, "ct": write_ct_mxfp4(mla, root / "ct", SERVED_IGNORE)}


def test_compressed_tensors_checkpoint_served_like_its_decompressor(dirs: dict[str, Path]) -> None:
    """targets ["Linear"] + ignore: every MLP, shared-expert and routed-expert matrix MXFP4, served FP8 x FP8 with
    logits equal (up to FP8 flips) to transformers' AFMoE on compressed-tensors' decompressed matrices."""
    from vllm_trn_plugin.loaders.mxfp4 import ExpandedMatrix
    from vllm_trn_plugin.loaders.packed import iter_checkpoint

    ct = dirs["ct"]
    qc = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"] and qc["format"] == "mxfp4-pack-quantized"
    weights, quantized = ct_decompressed(ct)
    mlp = {m for m in quantized if ".mlp." in m}
    assert quantized == mlp and len(mlp) == 3 + 3 * (8 + 1) * 3, sorted(quantized)  # dense, 3 x (8 experts + shared)
    # The plugin's reader decodes each matrix exactly as compressed-tensors does (as FP8 rows and their scales).
    for name, t in iter_checkpoint(ct):
        if isinstance(t, ExpandedMatrix):
            assert torch.equal(packed_reference.expanded_values(t), weights[name]), name

    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=31)
    served = served_greedy_logits(ct, prompts, STEPS, VOCAB)
    plain = load_hf_model(dirs["mla"])
    ref = packed_reference.patch_afmoe_fp8(copy.deepcopy(plain), weights, quantized)
    errs, cos = [], []
    for prompt, (tokens, logits) in zip(prompts, served):
        what = f"prompt of {len(prompt)}"
        cos.append(cosine(logits, teacher_forced_logits(plain, prompt, tokens)))
        if len(prompt) > SHORT:
            want = teacher_forced_logits(ref, prompt, tokens)
            errs.append(float((logits - want).abs().max()))
            assert cosine(logits, want) > LONG_COSINE, f"{what}: logits cosine {cosine(logits, want):.4f}"
            continue
        reference = functools.partial(teacher_forced_logits, ref, prompt, tokens)
        want = packed_reference.nearest_reference_run(logits, reference)
        errs.append(float((logits - want).abs().max()))
        assert errs[-1] < FLIP_TOL, f"{what}: max |logit diff| {errs[-1]:.2e} vs the nearest FP8 reference run"
        for i, tok in enumerate(tokens):
            top2 = torch.topk(want[i], 2).values
            if float(top2[0] - top2[1]) >= 2 * FLIP_TOL:
                assert tok == int(want[i].argmax()), f"{what}: step {i} chose {tok}, reference {int(want[i].argmax())}"
    print(
        "\ncompressed-tensors MXFP4 served vs its decompressed FP8 reference (nearest run), max |logit diff| by prompt "
        "length: " + ", ".join(f"{n}: {e:.1e}" for n, e in zip(LENGTHS, errs)) + f"; vs unquantized: logits cosine "
        f"min {min(cos):.4f}"
    )
    assert min(cos) > 0.9, cos


def test_declared_schemes_other_than_mxfp4_and_fp8_head_are_refused() -> None:
    """The plugin's method takes the MXFP4 targets and the FP8 LM head from the declaration as vLLM parses it, and
    refuses any other scheme naming its target: MXFP4's format declared with 8-bit weights, FP8 rows for a matrix
    other than the LM head."""
    from vllm_trn_plugin.loaders.packed import quantization_config
    from vllm_trn_plugin.model_executors.mxfp4_fp8_config import TrnMxfp4Fp8Config

    parsed = TrnMxfp4Fp8Config.from_config(quantization_config(["re:.*mlp.*"], fp8_lm_head=True))
    assert (parsed.mxfp4_targets, parsed.fp8_lm_head, parsed.ignore) == (["re:.*mlp.*"], True, [])
    wide = quantization_config(["re:.*mlp.*"], fp8_lm_head=False)
    wide["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    other_fp8 = quantization_config(["re:.*mlp.*"], fp8_lm_head=True)
    other_fp8["config_groups"]["group_1"]["targets"] = ["model.layers.0.self_attn.o_proj"]
    for config, target in ((wide, "re:.*mlp.*"), (other_fp8, "model.layers.0.self_attn.o_proj")):
        with pytest.raises(ValueError, match=rf"target '{re.escape(target)}'.*not served by trn-mxfp4-fp8"):
            TrnMxfp4Fp8Config.from_config(config)


def test_unservable_or_disagreeing_checkpoints_are_named(dirs: dict[str, Path], tmp_path: Path) -> None:
    """The load stops naming the tensor when the usual recipe (attention not ignored) has quantized attention, which
    the plugin serves unquantized, and when config.json and the safetensors disagree on a layer: declared MXFP4 but
    stored plain, or stored MXFP4 but ignored. (vLLM's loader in a child process, as in test_checkpoint_errors.)"""

    def edited(name: str, ignore_edit) -> str:  # noqa: ANN001
        d = shutil.copytree(dirs["ct"], tmp_path / name)
        cfg = json.loads((d / "config.json").read_text())
        ignore_edit(cfg["quantization_config"]["ignore"])
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d)

    o_proj = "model.layers.0.self_attn.o_proj"
    down = "model.layers.0.mlp.down_proj"
    attn = str(write_ct_mxfp4(dirs["mla"], tmp_path / "ct-attn", RECIPE_IGNORE))
    cases = {
        attn: ["model.safetensors", "attention projection model.layers.0.self_attn.", "is stored in MXFP4"],
        edited("declared-plain", lambda ig: ig.remove(o_proj)): [
            f"model.safetensors: tensor {o_proj}.weight: stored plain",
            f"declares {o_proj} MXFP4",
        ],
        edited("ignored-packed", lambda ig: ig.append(down)): [
            f"model.safetensors: tensor {down}.weight_packed: stored in MXFP4",
            "it is in ignore",
        ],
    }
    good = str(dirs["ct"])  # first: it sets up vLLM's parallel groups, the MoE one included
    results = load_in_child([good, *cases])
    assert results[good] == "loaded", results[good]
    for ckpt, parts in cases.items():
        for part in parts:
            assert part in results[ckpt], f"{ckpt}: error does not name {part!r}: {results[ckpt]}"
