"""The plugin entry point: discoverable by vLLM, idempotent, no trust_remote_code needed."""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from vllm_trn_plugin.configs import LaplaceConfig


def test_entry_point_is_installed() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("trn") == "vllm_trn_plugin:register"


def test_vllm_plugin_loader_registers_everything(tmp_path) -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    from vllm_trn_plugin import register
    from vllm_trn_plugin.demo import write_laplace_demo

    load_general_plugins()
    register()  # a second call (vLLM calls it once per process) changes nothing
    assert "LaplaceForCausalLM" in ModelRegistry.get_supported_archs()
    write_laplace_demo(tmp_path, dtype=torch.float32, num_hidden_layers=1)
    cfg = AutoConfig.from_pretrained(tmp_path)  # no trust_remote_code
    assert isinstance(cfg, LaplaceConfig) and cfg.architectures == ["LaplaceForCausalLM"]
    assert cfg.scale == pytest.approx(cfg.head_k_dim**-0.5)


def test_config_rejects_impossible_geometry() -> None:
    with pytest.raises(ValueError, match="num_decay_tiers"):
        LaplaceConfig(num_heads=16, num_decay_tiers=3)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        LaplaceConfig(tie_word_embeddings=True)


@pytest.mark.parametrize(
    "field,value",
    [("decay_t_min", -1.0), ("decay_t_min", 0), ("decay_t_max", -2048.0), ("decay_t_max", float("inf"))]
    + [("num_decay_tiers", -4), ("num_decay_tiers", 0), ("num_heads", 0)],
)
def test_config_refuses_decays_that_are_not_decays(tmp_path: Path, field: str, value: float) -> None:
    """A half-life <= 0 or infinite, or a tier or head count < 1: refused when the checkpoint's config.json is read,
    naming the field (a negative half-life used to serve, its state going non-finite after ~500 tokens; 0 was a bare
    ZeroDivisionError at build)."""
    from transformers import AutoConfig

    from vllm_trn_plugin import register
    from vllm_trn_plugin.demo import write_laplace_demo

    register()
    write_laplace_demo(tmp_path, dtype=torch.float32, num_hidden_layers=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ValueError, match=rf"laplace config: {field}="):
        AutoConfig.from_pretrained(tmp_path)
