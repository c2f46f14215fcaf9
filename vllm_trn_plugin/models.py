"""The plugin's models, one row each; everything that names them reads this table (registration, the Neuron
entry, the packed format's quantization method, the gate, the engine checks) and names its ops, every trn:: op
the plugin registers (tests/test_engine_checks.py holds the two to each other). Plain data: importing it loads
nothing (classes are "module:Class" paths, resolved by whoever builds them)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class PluginModel:
    architecture: str  # config.json `architectures`
    vllm_class: str  # the model vLLM's ModelRegistry builds (model_executors/)
    neuron_class: str  # the same model behind vLLM Neuron's model contract (vllm_trn_plugin/neuron/)
    engine_checks: str  # its vLLM config hook: refusals, splitting ops (engine_checks.py)
    splitting_ops: tuple[str, ...]  # its opaque ops whose work depends on runtime metadata or data
    kernel_ops: tuple[
        str, ...
    ]  # its kernel ops (kernels/dispatch.py): the NKI kernel on Neuron, never in a Neuron graph


MODELS: dict[str, PluginModel] = {
    m.architecture: m
    for m in (
        PluginModel(
            "LaplaceForCausalLM",
            "vllm_trn_plugin.model_executors.laplace:LaplaceForCausalLM",
            "vllm_trn_plugin.neuron.laplace:LaplaceNeuronModel",
            "vllm_trn_plugin.engine_checks:LaplaceEngineChecks",
            ("trn::laplace_mixer",),
            ("trn::gla_decode_step", "trn::fp8_linear"),
        ),
        PluginModel(
            "TrinityMLAForCausalLM",
            "vllm_trn_plugin.model_executors.trinity_mla:TrinityMLAForCausalLM",
            "vllm_trn_plugin.neuron.trinity_mla:TrinityMLANeuronModel",
            "vllm_trn_plugin.engine_checks:TrinityMLAEngineChecks",
            ("trn::latent_attention", "trn::fp8_experts"),
            ("trn::latent_decode", "trn::fp8_experts", "trn::fp8_linear"),
        ),
    )
}


def resolve(path: str) -> object:
    """The object a "module:Name" path names (imports the module)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
