"""The Trainium entry: the plugin's models presented through vllm-neuron's "Beta" model contract.

vllm-neuron's Beta runner builds a model with ``Model.from_configs(hf_config, neuron_config)``, asks
``get_kv_spec()``, binds the caches it allocates with ``bind_kv_cache()``, loads with
``load_weights(checkpoint_path, device, cache_dir)`` and calls ``forward(input_ids, positions,
attn_metadata, sampling_positions, sampling_params, ...)`` with padded, bucketed shapes. The classes here
implement that contract over the plugin's own vLLM models (no second copy of the model math); the
contract as read from vllm-neuron, with its sources, is in ``contract.py``. Nothing here imports
vllm_neuron: the runner passes plain tensors and dicts, and the spec classes it reads are mirrored in
``contract.py``.

Classes, by the ``architectures`` name a Beta runner resolves:

- ``LaplaceForCausalLM`` -> ``vllm_trn_plugin.neuron.laplace:LaplaceBetaModel``
- ``TrinityMLAForCausalLM`` -> ``vllm_trn_plugin.neuron.trinity_mla:TrinityMLABetaModel``
"""

from __future__ import annotations

BETA_ARCHITECTURES = {
    "LaplaceForCausalLM": "vllm_trn_plugin.neuron.laplace:LaplaceBetaModel",
    "TrinityMLAForCausalLM": "vllm_trn_plugin.neuron.trinity_mla:TrinityMLABetaModel",
}
