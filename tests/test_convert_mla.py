"""`vllm-trn convert-mla`: AFMoE -> MLA-Trinity by whitened joint SVD + least-squares refit (convert_mla.py).

References are independent of the tool: transformers' `AfmoeForCausalLM` on the original checkpoint and on the
converted one (loaded with k_proj/v_proj = kv_b_proj @ kv_a_proj, which is what MLA computes),
and the test-side plain SVD conversion `convert_to_mla` as the baseline. Errors are measured on held-out token
sequences, never the calibration ones.

Random checkpoints have nearly isotropic layer inputs, where whitening has nothing to find; real models do not
(their activations have outlier channels). So the reduced-rank checkpoint gets a log-normal input-norm weight on its
full-attention layer (channel scales spread over ~e^+-2), the property whitening exists for.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import random_prompts, served_greedy_logits
from tests.references.afmoe import (
    clear_model_cache,
    convert_to_mla,
    load_hf_model,
    make_random_afmoe,
    teacher_forced_logits,
)
from vllm_trn_plugin.cli import main as cli
from vllm_trn_plugin.loaders.io import Checkpoint, CheckpointFormatError
from vllm_trn_plugin.loaders.packed import iter_checkpoint
from vllm_trn_plugin.tools.afmoe_forward import (
    Geometry,
    attention_residual,
    attention_weights,
    embed,
    mlp_forward,
    mlp_residual,
    rms_norm,
)
from vllm_trn_plugin.tools.calibration import load_calibration
from vllm_trn_plugin.tools.convert_mla import convert_mla

SEQ = 128  # > the sliding window (64): the sliding mask is exercised
CALIB = torch.randint(0, 256, (16, SEQ), generator=torch.Generator().manual_seed(7))
HELD_OUT = torch.randint(0, 256, (4, SEQ), generator=torch.Generator().manual_seed(8))
FULL_LAYER = 3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _split_shards(ckpt: Path) -> None:
    """Rewrite model.safetensors as two shards with an index (the tools read sharded sources)."""
    f = ckpt / "model.safetensors"
    tensors = load_file(str(f))
    names = sorted(tensors)
    half = len(names) // 2
    files = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, part in files.items():
        save_file({n: tensors[n] for n in part}, str(ckpt / fname), {"format": "pt"})
    weight_map = {n: fname for fname, part in files.items() for n in part}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    f.unlink()


@pytest.fixture(scope="module")
def rank256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """[k_proj; v_proj] of rank 256 on the full layer (Trinity's latent width is exact), stored in two shards."""
    ckpt = make_random_afmoe(tmp_path_factory.mktemp("rank256") / "orig", seed=3, full_kv_rank=256)
    _split_shards(ckpt)
    return ckpt


@pytest.fixture(scope="module")
def anisotropic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = make_random_afmoe(tmp_path_factory.mktemp("aniso") / "orig", seed=1)
    f = ckpt / "model.safetensors"
    t = load_file(str(f))
    g = torch.Generator().manual_seed(5)
    t[f"model.layers.{FULL_LAYER}.input_layernorm.weight"] = torch.exp(torch.randn(512, generator=g))
    save_file(t, str(f), {"format": "pt"})
    return ckpt


@torch.no_grad()
def _logits(ckpt: Path) -> torch.Tensor:
    out = load_hf_model(ckpt)(input_ids=HELD_OUT).logits.double()
    clear_model_cache()
    return out


def _rel_mse(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).pow(2).mean() / ref.pow(2).mean())


@torch.no_grad()
def model_logits(src: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [S, L, vocab] of an unquantized AFMoE / MLA-Trinity checkpoint by the tools' layer forward."""
    with Checkpoint(src) as ckpt:
        geo = Geometry.from_config(ckpt.config, str(ckpt.config_path))
        h = embed(geo, ckpt, tokens)
        for i in range(geo.num_layers):
            w = attention_weights(ckpt, geo, i)
            h = attention_residual(geo, i, w, h)
            h = mlp_residual(geo, i, w, h, lambda x, i=i: mlp_forward(geo, i, ckpt, x))
        h = rms_norm(h, ckpt.get("model.norm.weight"), geo.eps)
        return h @ ckpt.f32("lm_head.weight").T


def test_layer_forward_equals_transformers(rank256: Path) -> None:
    """The calibration forward (plain torch, one layer at a time) computes transformers' AFMoE."""
    ours = model_logits(rank256, HELD_OUT[:2]).double()
    with torch.no_grad():
        ref = load_hf_model(rank256)(input_ids=HELD_OUT[:2]).logits.double()
    clear_model_cache()
    assert float((ours - ref).abs().max()) < 1e-4 * float(ref.abs().max()), float((ours - ref).abs().max())


def test_exact_rank_reproduces_logits(rank256: Path, tmp_path: Path) -> None:
    """convert-mla at the exact rank (256) through the CLI, calibration from a text file: same logits."""
    text = tmp_path / "calib.txt"
    rng = np.random.default_rng(0)
    words = ["".join(chr(c) for c in rng.integers(97, 123, rng.integers(2, 9))) for _ in range(3000)]
    text.write_text(" ".join(words))
    dst = tmp_path / "mla"
    cli(
        ["convert-mla", str(rank256), str(dst), "--latent", "256", "--calib", str(text)]
        + ["--calib-tokens", "1024", "--seq-len", str(SEQ)]
    )

    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["kv_lora_rank"] == 256 and cfg["architectures"] == ["TrinityMLAForCausalLM"]
    names = {name: t for name, t in iter_checkpoint(dst)}
    p = f"model.layers.{FULL_LAYER}.self_attn."
    assert names[p + "kv_a_proj.weight"].shape == (256, 512) and names[p + "kv_b_proj.weight"].shape == (1024, 256)
    assert p + "k_proj.weight" not in names and p + "v_proj.weight" not in names
    assert p + "k_norm.weight" in names  # the key norm is kept
    assert (dst / "tokenizer.json").is_file()

    ref, got = _logits(rank256), _logits(dst)
    err = float((got - ref).abs().max())
    print(f"\nexact rank 256: max |logit diff| {err:.2e} (logits up to {float(ref.abs().max()):.1f})")
    assert err < 1e-3


def test_afmoe_demo_converts_exactly(tmp_path: Path) -> None:
    """`vllm-trn demo afmoe` writes an original AFMoE checkpoint transformers loads without a missing or unexpected
    tensor; written with `kv_rank` 256, its conversion at latent 256 computes the original's logits (float32)."""
    from transformers import AfmoeForCausalLM

    from vllm_trn_plugin.demo import write_afmoe_demo

    cli(["demo", "afmoe", str(tmp_path / "plain"), "--dtype", "float32"])
    _, info = AfmoeForCausalLM.from_pretrained(str(tmp_path / "plain"), output_loading_info=True)
    assert not any(info.values()), info
    orig = write_afmoe_demo(tmp_path / "orig", seed=2, kv_rank=256)
    assert json.loads((orig / "config.json").read_text())["architectures"] == ["AfmoeForCausalLM"]
    dst = convert_mla(orig, tmp_path / "mla", latent=256, calib=CALIB[:4], progress=False).dst
    ref, got = _logits(orig), _logits(dst)
    err = float((got - ref).abs().max())
    print(f"\ndemo afmoe at exact rank 256: max |logit diff| {err:.2e} (logits up to {float(ref.abs().max()):.1f})")
    assert err < 1e-3


def test_reduced_rank_whitened_refit_beats_plain_svd(anisotropic: Path, tmp_path: Path) -> None:
    """On held-out sequences: lower logit error than a plain SVD at every width, falling as the latent widens."""
    ref = _logits(anisotropic)
    ours, plain = {}, {}
    for r in (64, 128, 256):
        report = convert_mla(anisotropic, tmp_path / f"w{r}", latent=r, calib=CALIB, progress=False)
        assert report.layers[0].layer == FULL_LAYER and report.calib_tokens == CALIB.numel()
        ours[r] = _rel_mse(_logits(tmp_path / f"w{r}"), ref)
        plain[r] = _rel_mse(_logits(convert_to_mla(anisotropic, tmp_path / f"p{r}", kv_lora_rank=r)), ref)
    print(
        "\nheld-out logits, relative MSE (whitened SVD + refit / plain SVD): "
        + ", ".join(f"r={r}: {ours[r]:.2e} / {plain[r]:.2e}" for r in ours)
    )
    for r in ours:
        assert ours[r] < 0.5 * plain[r], (r, ours[r], plain[r])
    assert ours[64] > ours[128] > ours[256]


@pytest.mark.vllm
def test_reduced_rank_output_serves(anisotropic: Path, tmp_path: Path) -> None:
    """convert-mla's output at a reduced latent (128) in real vLLM (float32, eager, the latent cache on the full
    layer): teacher-forced along the served tokens, transformers reading the same files (k/v = kv_b_proj kv_a_proj)
    picks the same tokens and gives the same logits."""
    dst = convert_mla(anisotropic, tmp_path / "mla128", latent=128, calib=CALIB, progress=False).dst
    prompts = random_prompts(2, [9, 90], seed=31)  # 90 > the sliding window (64)
    served = served_greedy_logits(dst, prompts, 8, 259)
    model = load_hf_model(dst)
    errs = []
    for prompt, (tokens, got) in zip(prompts, served):
        ref = teacher_forced_logits(model, prompt, tokens)
        assert ref.argmax(-1).tolist() == tokens
        errs.append(float((got - ref).abs().max()))
    clear_model_cache()
    print(f"\nlatent 128 served vs transformers on the same files: max |logit diff| {max(errs):.2e}")
    assert max(errs) < 1e-3, errs


def test_bad_inputs_fail_clearly(rank256: Path, anisotropic: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--latent 513: must be in \[1, 512\]"):
        convert_mla(anisotropic, tmp_path / "a", latent=513, calib=CALIB, progress=False)

    short = tmp_path / "short.json"
    short.write_text(json.dumps([[1, 2, 3]] * 10))
    with pytest.raises(ValueError, match=r"short.json: holds 30 calibration tokens, 256 needed"):
        convert_mla(anisotropic, tmp_path / "b", latent=64, calib=short, calib_tokens=256, seq_len=128)

    oov = tmp_path / "oov.npy"
    np.save(oov, np.full(256, 300, dtype=np.int64))
    with pytest.raises(ValueError, match=r"oov.npy: token 0 is id 300, outside the vocabulary \[0, 259\)"):
        convert_mla(anisotropic, tmp_path / "c", latent=64, calib=oov, calib_tokens=256, seq_len=128)

    broken = tmp_path / "broken"
    broken.mkdir()
    t = load_file(str(anisotropic / "model.safetensors"))
    del t[f"model.layers.{FULL_LAYER}.self_attn.v_proj.weight"]
    save_file(t, str(broken / "model.safetensors"))
    (broken / "config.json").write_text((anisotropic / "config.json").read_text())
    with pytest.raises(
        CheckpointFormatError, match=rf"tensor model.layers.{FULL_LAYER}.self_attn.v_proj.weight is missing"
    ):
        convert_mla(broken, tmp_path / "d", latent=64, calib=CALIB, progress=False)

    mla = tmp_path / "mla"
    convert_to_mla(anisotropic, mla, kv_lora_rank=64)
    with pytest.raises(ValueError, match=r"config.json: field 'kv_lora_rank' is already set"):
        convert_mla(mla, tmp_path / "e", latent=64, calib=CALIB, progress=False)


def test_calibration_token_files_agree(tmp_path: Path) -> None:
    """.json (list of lists), .npy and .pt hold the same stream; it is cut into --seq-len sequences in order."""
    docs = [list(range(i * 10, i * 10 + 10)) for i in range(5)]
    flat = [t for d in docs for t in d]
    (tmp_path / "t.json").write_text(json.dumps(docs))
    np.save(tmp_path / "t.npy", np.array(flat, dtype=np.int32))
    torch.save([torch.tensor(d) for d in docs], tmp_path / "t.pt")
    want = torch.tensor(flat[:48]).view(3, 16)
    for name in ("t.json", "t.npy", "t.pt"):
        got = load_calibration(tmp_path / name, tokenizer_dir=tmp_path, num_tokens=50, seq_len=16, vocab_size=259)
        assert torch.equal(got, want), name
    (tmp_path / "f.json").write_text(json.dumps([0.5, 1.5]))
    with pytest.raises(ValueError, match="f.json: expected token ids"):
        load_calibration(tmp_path / "f.json", tokenizer_dir=tmp_path, num_tokens=2, seq_len=1, vocab_size=259)
