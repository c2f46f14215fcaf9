"""vLLM plugin for MLA-Trinity and Laplace 3B on AWS Trainium2 (and vLLM's CPU build).

`register()` is the `vllm.general_plugins` entry point: vLLM calls it in every process it
starts (API server, engine core, workers), so it is idempotent and imports nothing heavy.
"""

from __future__ import annotations

from vllm_trn_plugin.envs import neuron_runner_active
from vllm_trn_plugin.models import MODELS, resolve

_registered = False


def _init_cpu_amx() -> None:
    # vLLM's CPU bf16 kernels use AMX tiles; a spawned worker that never asked the kernel for
    # tile permission dies with SIGILL. Asking is per process, so it belongs here.
    import torch

    cpu = getattr(torch, "cpu", None)
    if cpu is not None and getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        torch._C._cpu._init_amx()


def register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import vllm_trn_plugin.model_executors.mxfp4_fp8_config  # noqa: F401  (registers the trn-mxfp4-fp8 method)
    from vllm_trn_plugin.configs import LaplaceConfig

    _init_cpu_amx()
    AutoConfig.register("laplace", LaplaceConfig, exist_ok=True)
    supported = set(ModelRegistry.get_supported_archs())
    neuron = neuron_runner_active()
    for arch, m in MODELS.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, m.neuron_class if neuron else m.vllm_class)
    # vLLM's config hooks for the two architectures: refusals and splitting ops (engine_checks.py); for
    # Laplace also vLLM's state-model settings (one state page per sequence, or with prefix caching a state
    # checkpoint per block of tokens).
    MODELS_CONFIG_MAP.update({arch: resolve(m.engine_checks) for arch, m in MODELS.items()})
    _registered = True
