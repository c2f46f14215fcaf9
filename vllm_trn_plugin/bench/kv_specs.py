"""A model's KV cache specs as vLLM's model runner collects them, for cache sizing without an engine."""

from __future__ import annotations

from typing import Any


def layer_specs(vc: Any) -> tuple[dict[str, Any], list[Any]]:
    """The KV cache spec of every attention layer of the model built under the vLLM config `vc`, as
    GPUModelRunner.get_kv_cache_spec makes it (KV sharing aside), and every attention layer's backend."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    layers = get_layers_from_vllm_config(vc, AttentionLayerBase)
    specs = {}
    for name, layer in layers.items():
        spec = layer.get_kv_cache_spec(vc)
        if spec:
            if isinstance(spec, AttentionSpec):
                spec = customize_attention_spec(layer.get_attn_backend(), spec)
            specs[name] = spec
    return specs, [layer.get_attn_backend() for layer in layers.values()]
