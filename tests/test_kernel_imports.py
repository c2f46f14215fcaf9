"""Imports point one way: building and running the models on the torch path loads no NKI code.

A fresh interpreter imports the plugin as vLLM's worker processes do (`register()`), the model modules and the
dispatch, runs every dispatched op once on small CPU tensors under VLLM_TRN_KERNELS=torch and then =auto, and
reports which of the plugin's kernel modules are loaded after each phase. Neither phase may load the NKI shim,
the emulator or any `*_nki` module. A last phase under =emulate runs the same calls through the kernels: it must
load them (so the check can see them) and agree with the torch path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, os, sys
import torch

import vllm_trn_plugin

vllm_trn_plugin.register()
import vllm_trn_plugin.model_executors.latent_attention  # noqa: F401
import vllm_trn_plugin.model_executors.laplace  # noqa: F401
import vllm_trn_plugin.model_executors.mxfp4_fp8  # noqa: F401
import vllm_trn_plugin.model_executors.trinity_mla  # noqa: F401
from vllm_trn_plugin.kernels import dispatch

g = torch.Generator().manual_seed(0)
fp8 = torch.float8_e4m3fn


def calls():
    B, H, dk, dv = 2, 2, 8, 16
    pool = torch.randn(4, H, dk, dv, generator=g)
    gla = dispatch.gla_decode_step(
        torch.randn(B, H, dk, generator=g), torch.randn(B, H, dk, generator=g), torch.randn(B, H, dv, generator=g),
        torch.randn(H, dk, generator=g), -torch.rand(H, generator=g), dk**-0.5, pool, torch.tensor([2, 0]),
    )
    H, Hkv, hd, r, bs = 2, 1, 8, 128, 16
    latent = dispatch.latent_decode(
        torch.randn(1, H, hd, generator=g), torch.ones(hd), torch.randn(Hkv, hd, r, generator=g) / 16,
        torch.randn(Hkv, hd, r, generator=g) / 16, torch.randn(2 * bs, r, generator=g), torch.ones(2 * bs, Hkv),
        torch.tensor([[1, 0]]), torch.tensor([20]), hd**-0.5, bs,
    )
    E, Hd, I = 2, 256, 256
    experts = dispatch.fp8_experts(
        torch.randn(1, Hd, generator=g), torch.ones(1, 1), torch.tensor([[1]]),
        (torch.randn(E, 2 * I, Hd, generator=g) * 30).to(fp8), torch.full((E, 2 * I), 1e-3), torch.zeros(E, 2 * I),
        (torch.randn(E, Hd, I, generator=g) * 30).to(fp8), torch.full((E, Hd), 1e-3), torch.zeros(E, Hd), True,
    )
    return [gla, pool, latent, experts]


def kernel_modules():
    return sorted(m for m in sys.modules if m.startswith("vllm_trn_plugin.kernels"))


report = {}
for mode in ("torch", "auto", "emulate"):
    os.environ["VLLM_TRN_KERNELS"] = mode
    g.manual_seed(0)
    report[mode] = {"outputs": [t.double().tolist() for t in calls()], "modules": kernel_modules()}
print(json.dumps(report))
"""


def _is_nki(module: str) -> bool:
    return module.endswith("_nki") or ".nki_shim" in module or ".nki_emu" in module


def test_torch_path_loads_no_nki_code() -> None:
    env = dict(os.environ, VLLM_TRN_KERNELS="auto")
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    for mode in ("torch", "auto"):
        loaded = report[mode]["modules"]
        assert "vllm_trn_plugin.kernels.dispatch" in loaded and "vllm_trn_plugin.kernels.latent_decode" in loaded
        assert [m for m in loaded if _is_nki(m)] == [], f"{mode}: the torch path loaded {loaded}"
    emulated = [m for m in report["emulate"]["modules"] if _is_nki(m)]
    for module in ("nki_shim", "nki_emu", "simple_gla_nki", "latent_decode_nki", "fp8_expert_nki"):
        assert f"vllm_trn_plugin.kernels.{module}" in emulated, emulated
    # The same calls through the kernels give the torch path's results (the kernels' tests bound them closely).
    for got, want in zip(report["emulate"]["outputs"], report["torch"]["outputs"], strict=True):
        assert _max_abs_diff(got, want) <= 1e-3 * max(_max_abs(want), 1.0)


def _max_abs(x: object) -> float:
    return max(map(_max_abs, x)) if isinstance(x, list) else abs(float(x))


def _max_abs_diff(a: object, b: object) -> float:
    if isinstance(a, list):
        return max(_max_abs_diff(x, y) for x, y in zip(a, b, strict=True))
    return abs(float(a) - float(b))
