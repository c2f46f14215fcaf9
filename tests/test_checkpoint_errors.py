"""A bad checkpoint fails the load with an error naming the tensor, never a silent wrong model; a checkpoint tool
never overwrites what it did not create and leaves nothing behind when it fails.

The model is built and loaded by vLLM's own default loader in a child process, so the
pytest process never initialises vLLM's distributed state.
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import load_in_child
from vllm_trn_plugin.demo import write_laplace_demo, write_trinity_demo
from vllm_trn_plugin.loaders.packed import pack


def test_bad_tensors_are_named(tmp_path) -> None:
    def variant(writer, name: str, edit=None) -> str:  # noqa: ANN001
        d = writer(tmp_path / name, dtype=torch.float32)
        if edit is not None:
            t = load_file(str(d / "model.safetensors"))
            edit(t)
            save_file(t, str(d / "model.safetensors"))
        return str(d)

    laplace = partial(write_laplace_demo, num_hidden_layers=2)
    latent = "model.layers.3.self_attn."  # the demo's full-attention layer
    # The first checkpoint's config sets up vLLM's parallel groups: the MoE one needs its EP group.
    goods = [variant(write_trinity_demo, "trinity-good"), variant(laplace, "laplace-good")]
    cases = {
        variant(laplace, "missing", lambda t: t.pop("model.layers.1.mixer.aug_balance")): (
            "model.layers.1.mixer.aug_balance"
        ),
        variant(laplace, "unknown", lambda t: t.update({"model.layers.0.mixer.k_proj.weight": torch.zeros(2, 2)})): (
            "model.layers.0.mixer.k_proj.weight"
        ),
        variant(laplace, "shape", lambda t: t.update({"model.layers.0.mixer.conv1d.weight": torch.zeros(256, 1, 3)})): (
            "model.layers.0.mixer.conv1d.weight"
        ),
        # An unconverted AFMoE layer where the latent belongs.
        variant(
            write_trinity_demo, "trinity-kv", lambda t: t.update({latent + "k_proj.weight": torch.zeros(512, 512)})
        ): (latent + "k_proj.weight"),
        variant(write_trinity_demo, "trinity-missing", lambda t: t.pop(latent + "kv_b_proj.weight")): (
            latent + "kv_b_proj.weight"
        ),
        variant(
            write_trinity_demo,
            "trinity-shape",
            lambda t: t.update({latent + "kv_a_proj.weight": torch.zeros(128, 512)}),
        ): (latent + "kv_a_proj.weight"),
        variant(  # kv_b_proj is sliced per tensor-parallel rank by the plugin's own loader
            write_trinity_demo,
            "trinity-kv-b-shape",
            lambda t: t.update({latent + "kv_b_proj.weight": torch.zeros(1024, 128)}),
        ): (latent + "kv_b_proj.weight"),
    }

    # Packed checkpoints (vllm-trn pack of the demos): every broken file is named with its tensor (and row).
    def packed(writer, name: str, edit=None) -> str:  # noqa: ANN001
        d = pack(variant(writer, name + "-src"), tmp_path / name).dst
        if edit is not None:
            f = str(d / "model.safetensors")
            t = load_file(f)
            edit(t)
            save_file(t, f)
        return str(d)

    def truncate(d: str) -> str:
        f = Path(d) / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size * 2 // 3])
        return d

    def nan_scale(t: dict) -> None:
        t[mlp + "weight_scale"][5, 1] = 0xFF

    def spread_14(t: dict) -> None:
        s = t[mlp + "weight_scale"]
        s[7] = s[7].max()  # every block of row 7 at the top exponent, then one block 14 octaves below
        s[7, 3] -= 14
        t[mlp + "weight_packed"][7, 48:64] = 0x11  # block 3 holds nonzero codes (0.5)

    expert = "model.layers.1.mlp.experts.3.up_proj."
    mlp = "model.layers.0.mlp.gate_proj."  # Trinity demo's dense layer
    goods += [packed(write_trinity_demo, "trinity-packed"), packed(laplace, "laplace-packed")]
    packed_cases = {
        packed(write_trinity_demo, "p-nan", nan_scale): ("model.safetensors", mlp + "weight_packed", "row 5"),
        packed(write_trinity_demo, "p-spread", spread_14): ("model.safetensors", mlp + "weight_packed", "row 7", "14"),
        packed(write_trinity_demo, "p-no-scale", lambda t: t.pop(expert + "weight_scale")): (
            "model.safetensors",
            expert + "weight_packed",
        ),
        packed(
            write_trinity_demo,
            "p-no-expert",
            lambda t: [t.pop(expert + k) for k in ("weight_packed", "weight_scale", "bias")],
        ): ("model.layers.1.mlp.experts", "w13_weight", "(3, 'w3')"),
        packed(laplace, "p-dtype", lambda t: t.update({"lm_head.weight_scale": t["lm_head.weight_scale"].double()})): (
            "model.safetensors",
            "lm_head.weight_scale",
        ),
        truncate(packed(laplace, "p-truncated")): ("model.safetensors", "truncated"),
    }
    cases.update({k: v[0] for k, v in packed_cases.items()})
    results = load_in_child([*goods, *cases])
    for good in goods:
        assert results[good] == "loaded", results[good]
    for ckpt, tensor_name in cases.items():
        assert tensor_name in results[ckpt], f"{ckpt}: error does not name {tensor_name}: {results[ckpt]}"
    for ckpt, parts in packed_cases.items():
        for part in parts:
            assert part in results[ckpt], f"{ckpt}: error does not name {part!r}: {results[ckpt]}"


# ---- No tool overwrites what it did not create; a failed write leaves nothing behind ------------------------------


def _files(d: Path) -> dict[str, bytes]:
    """Every file under `d` (hidden ones included) by relative path, with its bytes."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _small_laplace(d: Path) -> Path:
    return write_laplace_demo(d, dtype=torch.float32, num_hidden_layers=1)


def test_demo_refuses_a_non_empty_destination(tmp_path: Path) -> None:
    from vllm_trn_plugin.cli import main

    ckpt = _small_laplace(tmp_path / "ckpt")
    (ckpt / "README.md").write_text("my notes\n")
    before = _files(ckpt)
    with pytest.raises(SystemExit, match=f"vllm-trn demo: .*{re.escape(str(ckpt))}"):
        main(["demo", "laplace", str(ckpt), "--seed", "1"])  # `vllm-trn demo laplace DIR`: a message, no traceback
    assert _files(ckpt) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no partial sibling either

    other = tmp_path / "other"  # anything at all in the directory makes it someone else's
    other.mkdir()
    (other / "notes.txt").write_text("x")
    with pytest.raises(FileExistsError, match=re.escape(str(other))):
        _small_laplace(other)
    assert _files(other) == {"notes.txt": b"x"}

    empty = tmp_path / "empty"  # an empty directory (make serve's DEMO made by hand) is fine
    empty.mkdir()
    assert (_small_laplace(empty) / "config.json").is_file()


def test_pack_refuses_a_non_empty_destination(tmp_path: Path) -> None:
    src = _small_laplace(tmp_path / "src")
    (src / "README.md").write_text("the source's readme\n")
    project = tmp_path / "project"  # `vllm-trn pack SRC .` inside a project
    project.mkdir()
    (project / "README.md").write_text("the project's readme\n")
    (project / "LICENSE").write_text("the project's licence\n")
    before = _files(project)
    with pytest.raises(FileExistsError, match=re.escape(str(project))):
        pack(src, project)
    assert _files(project) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project", "src"]


def test_pack_copies_only_the_checkpoint_side_files(tmp_path: Path) -> None:
    src = _small_laplace(tmp_path / "src")
    (src / "generation_config.json").write_text('{"max_new_tokens": 8}\n')
    strays = ["pytorch_model.bin", "consolidated.00.pt", "model.gguf", "README.md", "LICENSE", "modeling_x.py"]
    for name in strays:
        (src / name).write_bytes(b"unquantized weights or someone's file")
    report = pack(src, tmp_path / "dst")
    side = ["chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert report.files == side
    assert sorted(_files(tmp_path / "dst")) == sorted([*side, "config.json", "model.safetensors"])
    for name in side:
        assert (tmp_path / "dst" / name).read_bytes() == (src / name).read_bytes()


def test_failed_pack_leaves_nothing(tmp_path: Path) -> None:
    # A NaN in the last matrix pack quantizes, found after several shards are on disk.
    src = write_laplace_demo(tmp_path / "src", dtype=torch.float32, num_hidden_layers=3)
    t = load_file(str(src / "model.safetensors"))
    t["model.layers.2.mlp.down_proj.weight"][5, 7] = float("nan")
    save_file(t, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.2.mlp.down_proj.weight"):
        pack(src, tmp_path / "packed", shard_bytes=100_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no DST, no partial sibling, no shard file


def test_interrupted_demo_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_trn_plugin.demo as demo
    from vllm_trn_plugin.loaders.io import Checkpoint

    # Ctrl-C after the weights and config.json are written, while the tokenizer is.
    real = demo.write_byte_tokenizer

    def interrupted(out: Path) -> None:
        real(out)
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "write_byte_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _small_laplace(tmp_path / "demo")
    assert not any(tmp_path.iterdir())

    # An interrupted write into an existing empty directory leaves it as it was: empty.
    (tmp_path / "empty").mkdir()
    with pytest.raises(KeyboardInterrupt):
        _small_laplace(tmp_path / "empty")
    assert [p.name for p in tmp_path.iterdir()] == ["empty"] and not any((tmp_path / "empty").iterdir())

    monkeypatch.setattr(demo, "write_byte_tokenizer", real)
    with Checkpoint(_small_laplace(tmp_path / "empty")) as ckpt:  # and the same call then succeeds
        assert ckpt.entries


def test_interrupted_convert_mla_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_trn_plugin.tools.convert_mla as tool
    from vllm_trn_plugin.demo import write_afmoe_demo

    src = write_afmoe_demo(tmp_path / "src", seed=2, dtype=torch.float32)

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    # Ctrl-C in the full-attention layer's fit, after the embedding and earlier layers are in shards on disk.
    monkeypatch.setattr(tool, "fit_latent", interrupted)
    calib = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with pytest.raises(KeyboardInterrupt):
        tool.convert_mla(src, tmp_path / "mla", latent=64, calib=calib, shard_bytes=100_000, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_destination_filled_during_the_write_is_not_replaced(tmp_path: Path) -> None:
    from vllm_trn_plugin.loaders.io import StagedCheckpoint

    dst = tmp_path / "dst"
    with pytest.raises(FileExistsError, match=re.escape(str(dst))):
        with StagedCheckpoint(dst) as out:
            (out / "config.json").write_text("{}")
            dst.mkdir()  # someone else's file appears at the destination meanwhile
            (dst / "theirs.txt").write_text("x")
    assert _files(dst) == {"theirs.txt": b"x"} and [p.name for p in tmp_path.iterdir()] == ["dst"]
