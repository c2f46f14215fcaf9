"""The packed MXFP4 checkpoint format as a vLLM quantization method (`trn-mxfp4-fp8`).

A checkpoint in the packed format (docs/packed-format.md: compressed-tensors `mxfp4-pack-quantized`
declared in config.json) of one of this plugin's models is claimed by `TrnMxfp4Fp8Config`: vLLM
asks every registered method whether it overrides the declared one, and this one answers only for
the plugin's architectures, so other compressed-tensors models keep vLLM's own method. The layer
methods live in model_executors/mxfp4_fp8.py (imported when the model is built, not at plugin
registration).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from vllm_trn_plugin.loaders.packed import LM_HEAD, PACKED_FORMAT, declares_packed

QUANT_NAME = "trn-mxfp4-fp8"
ARCHITECTURES = ("TrinityMLAForCausalLM", "LaplaceForCausalLM")
# vLLM fuses these checkpoint matrices into one layer; a fused layer is FP8 only if all its parts are.
FUSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj")}


class TargetMatcher:
    """compressed-tensors target semantics: `re:<regex>` matched at the start of the module name, else equality.

    A class, not a closure: vLLM pickles the quantization config into its engine process.
    """

    def __init__(self, targets: list[str]) -> None:
        self.regexes = [re.compile(t.removeprefix("re:")) for t in targets if t.startswith("re:")]
        self.names = {t for t in targets if not t.startswith("re:")}

    def __call__(self, name: str) -> bool:
        return name in self.names or any(r.match(name) for r in self.regexes)


@register_quantization_config(QUANT_NAME)
class TrnMxfp4Fp8Config(QuantizationConfig):
    def __init__(self, mxfp4_targets: list[str], fp8_lm_head: bool, ignore: list[str]) -> None:
        super().__init__()
        self.is_mxfp4 = TargetMatcher(mxfp4_targets)
        self.fp8_lm_head = fp8_lm_head
        self.ignored = TargetMatcher(ignore)

    def get_name(self) -> str:
        return QUANT_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TrnMxfp4Fp8Config:
        mxfp4, head = [], False
        for name, group in (config.get("config_groups") or {}).items():
            fmt = group.get("format") or config.get("format")
            if fmt == PACKED_FORMAT:
                mxfp4 += group.get("targets") or []
            elif fmt == "float-quantized" and LM_HEAD in (group.get("targets") or []):
                head = True
            else:
                raise ValueError(
                    f"quantization_config.config_groups.{name}: format {fmt!r} is not served by {QUANT_NAME}"
                )
        return cls(mxfp4, head, config.get("ignore") or [])

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        archs = getattr(hf_config, "architectures", None) or []
        if user_quant in (None, QUANT_NAME, "compressed-tensors") and declares_packed(hf_quant_cfg):
            if any(a in ARCHITECTURES for a in archs):
                return QUANT_NAME
        return None

    def quantized(self, prefix: str) -> bool:
        """Is the module `prefix` (vLLM's name; fused layers resolve to their checkpoint parts) MXFP4?"""
        head, _, leaf = prefix.rpartition(".")
        parts = [f"{head}.{p}" for p in FUSED_PARTS.get(leaf, (leaf,))]
        flags = {self.is_mxfp4(p) and not self.ignored(p) for p in parts}
        if len(flags) > 1:
            raise ValueError(f"quantization_config: {prefix} fuses {parts}, which must be all MXFP4 or none")
        return flags.pop()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

        from vllm_trn_plugin.model_executors.mxfp4_fp8 import Fp8LMHeadMethod, Fp8RowLinearMethod, Fp8RowMoEMethod

        if isinstance(layer, ParallelLMHead):
            return Fp8LMHeadMethod() if self.fp8_lm_head else UnquantizedEmbeddingMethod()
        if isinstance(layer, LinearBase):
            return Fp8RowLinearMethod() if self.quantized(prefix) else UnquantizedLinearMethod()
        if isinstance(layer, RoutedExperts):
            if not self.quantized(f"{prefix}.0.gate_proj"):
                return None  # vLLM's unquantized experts
            return Fp8RowMoEMethod(layer.moe_config)
        return None
