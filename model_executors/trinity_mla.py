"""MLA-Trinity: Arcee Trinity-Mini (AFMoE) with a latent cache on its global-attention layers.

Spec: docs/models.md §1 and §3. Everything but the global layers' attention is vLLM's own
AFMoE (sandwich norms, muP embedding scale, per-head q/k RMSNorm, RoPE + sliding window on the
sliding layers, sigmoid output gate, dense first layers, sigmoid-routed MoE with `expert_bias`
for selection only, renormalised weights x route_scale, unscaled shared expert). On layers whose
`layer_types` entry is `full_attention`, `k_proj`/`v_proj` are replaced by `kv_a_proj` (the
r-wide latent, the only thing cached) and `kv_b_proj` (keys of all KV heads, then values).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.afmoe import (
    AfmoeAttention,
    AfmoeDecoderLayer,
    AfmoeForCausalLM,
    AfmoeMLP,
    AfmoeMoE,
)
from vllm.model_executor.models.interfaces import EagleModelMixin
from vllm.model_executor.models.utils import AutoWeightsLoader, extract_layer_index, make_layers, maybe_prefix
from vllm.sequence import IntermediateTensors

from vllm_trn_plugin.model_executors.latent_attention import TrinityLatentAttention
from vllm_trn_plugin.model_executors.latent_cache import reserve_key_scale_budget
from vllm_trn_plugin.model_executors.mxfp4_fp8 import check_all_loaded, other_ranks_experts, packed_weights
from vllm_trn_plugin.model_executors.mxfp4_fp8_config import TrnMxfp4Fp8Config


def is_latent_layer(config, layer_idx: int) -> bool:  # noqa: ANN001
    return config.layer_types[layer_idx] == "full_attention"


class TrinityMLADecoderLayer(AfmoeDecoderLayer):
    """vLLM's AFMoE decoder layer (its forward is reused as is) with latent attention on global layers."""

    def __init__(
        self,
        config,  # noqa: ANN001  (AfmoeConfig + kv_lora_rank)
        cache_config: CacheConfig | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        enable_eplb: bool = False,
    ) -> None:
        nn.Module.__init__(self)  # AfmoeDecoderLayer.__init__ would register a full K/V cache
        self.hidden_size = config.hidden_size
        self.layer_idx = extract_layer_index(prefix)
        if is_latent_layer(config, self.layer_idx):
            self.self_attn = TrinityLatentAttention(config, prefix=f"{prefix}.self_attn")
        else:
            self.self_attn = AfmoeAttention(
                config=config,
                layer_idx=self.layer_idx,
                hidden_size=config.hidden_size,
                num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads,
                max_position_embeddings=getattr(config, "max_position_embeddings", 131072),
                head_dim=config.head_dim,
                rms_norm_eps=config.rms_norm_eps,
                cache_config=cache_config,
                quant_config=quant_config,
                prefix=f"{prefix}.self_attn",
            )
        self.moe_enabled = self.layer_idx >= config.num_dense_layers
        if self.moe_enabled:
            self.mlp = AfmoeMoE(
                config=config, quant_config=quant_config, prefix=f"{prefix}.mlp", enable_eplb=enable_eplb
            )
        else:
            self.mlp = AfmoeMLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                hidden_act=config.hidden_act,
                quant_config=quant_config,
                prefix=f"{prefix}.mlp",
            )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class TrinityMLAModel(nn.Module, EagleModelMixin):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        if getattr(config, "kv_lora_rank", None) is None:
            raise ValueError("TrinityMLAForCausalLM: config.json needs `kv_lora_rank` (the latent width)")
        reserve_key_scale_budget(vllm_config)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: TrinityMLADecoderLayer(
                config,
                vllm_config.cache_config,
                vllm_config.quant_config,
                prefix=prefix,
                enable_eplb=vllm_config.parallel_config.enable_eplb,
            ),
            prefix=f"{prefix}.layers",
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        if self.config.mup_enabled:
            x = x * (self.config.hidden_size**0.5)
        residual = None
        # EAGLE3 drafts read the residual stream after the layers vLLM names (set_aux_hidden_state_layers)
        aux = self._maybe_add_hidden_state([], 0, x, residual)
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual)
            self._maybe_add_hidden_state(aux, i + 1, x, residual)
        x = self.norm(x, residual)[0]
        return (x, aux) if aux else x


class TrinityMLAForCausalLM(AfmoeForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.model_dir = vllm_config.model_config.model
        self.model = TrinityMLAModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=self.quant_config)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.num_moe_layers = config.num_hidden_layers - config.num_dense_layers
        self.num_expert_groups = config.n_group
        moes = [layer.mlp for layer in self.model.layers if layer.moe_enabled]
        self.moe_layers = [m.experts for m in moes]
        if moes:
            m = moes[0]
            self.num_logical_experts = m.n_logical_experts
            self.num_physical_experts = m.n_physical_experts
            self.num_local_physical_experts = m.n_local_physical_experts
            self.num_routed_experts = m.n_routed_experts
            self.num_shared_experts = m.n_shared_experts
            self.num_redundant_experts = m.n_redundant_experts

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Latent layers' attention tensors load by name; everything else through vLLM's AFMoE mapping.

        A packed checkpoint is read by the plugin's own streaming reader instead of vLLM's iterator
        (its errors name the file; MXFP4 matrices arrive expanded to FP8 rows).
        """
        packed = isinstance(self.quant_config, TrnMxfp4Fp8Config)
        if packed:  # under expert parallelism another rank's experts are not even read
            moe = {i: layer.mlp.experts for i, layer in enumerate(self.model.layers) if layer.moe_enabled}
            weights = packed_weights(self.model_dir, self.quant_config.is_mxfp4, skip=other_ranks_experts(moe))
        params = dict(self.named_parameters())
        latent_prefixes = tuple(
            f"model.layers.{i}.self_attn."
            for i in range(self.config.num_hidden_layers)
            if is_latent_layer(self.config, i)
        )
        loaded: set[str] = set()

        def rest() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not name.startswith(latent_prefixes):
                    yield name, tensor
                    continue
                if name.endswith((".k_proj.weight", ".v_proj.weight")):
                    raise ValueError(
                        f"checkpoint tensor {name}: a latent (full-attention) layer has kv_a_proj/kv_b_proj, "
                        "not k_proj/v_proj; convert the checkpoint (vllm-trn convert-mla) first"
                    )
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name} has no place in TrinityMLAForCausalLM")
                param = params[name]
                loader = getattr(param, "weight_loader", None)
                if loader is None and param.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {name}: shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
                    )
                try:  # vLLM's parallel loaders keep this rank's part, and assert that it fits
                    (loader or default_weight_loader)(param, tensor)
                except AssertionError as e:
                    raise ValueError(
                        f"checkpoint tensor {name}: shape {tuple(tensor.shape)} does not fit the model's "
                        f"{tuple(param.shape)} on each tensor-parallel rank"
                    ) from e
                loaded.add(name)

        loaded |= AutoWeightsLoader(self).load_weights(rest(), mapper=self.hf_to_vllm_mapper)
        if packed:  # vLLM checks completeness only for unquantized models
            check_all_loaded(self, loaded)
        for layer in self.model.layers:
            if isinstance(layer.self_attn, TrinityLatentAttention):
                layer.self_attn.finish_loading()
        return loaded
