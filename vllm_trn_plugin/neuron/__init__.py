"""The Trainium entry: the plugin's models presented through vLLM Neuron's model contract.

vLLM Neuron's runner (vllm-neuron 0.29, GA in Neuron SDK 2.34) builds a model with
``Model.from_configs(hf_config, neuron_config)``, asks ``get_kv_spec()``, binds the caches it allocates with
``bind_kv_cache()``, loads with ``load_weights(checkpoint_path, device, cache_dir)`` and calls ``forward(input_ids,
positions, attn_metadata, sampling_positions, sampling_params, ...)`` with padded, bucketed shapes, compiled one graph
per bucket. The classes here implement that contract over the plugin's own vLLM models (no second copy of the model
math); the contract as read from vllm-neuron's sources and the SDK docs is in ``contract.py`` and docs/trainium.md.
Nothing here imports vllm_neuron: the runner passes plain tensors and dicts, and the spec classes it reads are
mirrored in ``contract.py``.

The class for each ``architectures`` name the runner resolves: ``neuron_class`` in vllm_trn_plugin/models.py.
"""

from __future__ import annotations
