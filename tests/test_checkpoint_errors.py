"""A bad checkpoint fails the load with an error naming the tensor, never a silent wrong model.

The model is built and loaded by vLLM's own default loader in a child process, so the
pytest process never initialises vLLM's distributed state.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

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
