"""The packed MXFP4 checkpoint format as a vLLM quantization method (`trn-mxfp4-fp8`).

A checkpoint in the packed format (docs/packed-format.md: compressed-tensors `mxfp4-pack-quantized`
declared in config.json, written by `vllm-trn pack`/`quantize` or by compressed-tensors itself) of one
of this plugin's models is claimed by `TrnMxfp4Fp8Config`: vLLM asks every registered method whether
it overrides the declared one, and this one answers only for the plugin's architectures, so other
compressed-tensors models keep vLLM's own method. The layer methods live in
model_executors/mxfp4_fp8.py (imported when the model is built, not at plugin registration).

Which layers are MXFP4 is read twice, and the two must agree: from the declaration, with vLLM's own
compressed-tensors matching (targets as module names, `re:` regexes or module classes such as
"Linear"; fused layers through the model's `packed_modules_mapping`; the `ignore` list), and from the
checkpoint's headers (a `<m>.weight_packed` + `<m>.weight_scale` pair). A disagreement stops the load
naming the tensor, and so does an MXFP4 matrix of a layer the models serve unquantized (attention,
routers, embeddings).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from vllm_trn_plugin.loaders.io import CheckpointFormatError
from vllm_trn_plugin.loaders.packed import (
    DEFAULT_MATRIX_PATTERN,
    LM_HEAD,
    PACKED_FORMAT,
    QUANT_NAME,
    StoredWeight,
    declares_packed,
    stored_weights,
)
from vllm_trn_plugin.models import MODELS

# The matrices the models serve in MXFP4: MLPs, shared and routed experts.
_SERVED_MXFP4 = re.compile(DEFAULT_MATRIX_PATTERN)


@register_quantization_config(QUANT_NAME)
class TrnMxfp4Fp8Config(QuantizationConfig):
    """Plain data only (targets, ignore list, what the checkpoint stores): vLLM pickles it into its engine process."""

    def __init__(self, mxfp4_targets: list[str], fp8_lm_head: bool, ignore: list[str]) -> None:
        super().__init__()
        self.mxfp4_targets = list(mxfp4_targets)
        self.fp8_lm_head = fp8_lm_head
        self.ignore = list(ignore)
        self.model_dir: str | None = None  # the checkpoint (maybe_update_config)
        self.stored: dict[str, StoredWeight] | None = None  # how it stores each module's weight, once read

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
        """The MXFP4 targets, whether the LM head is FP8, and the ignore list, from the declaration as vLLM's own
        compressed-tensors method parses it (each group's weights validated as compressed-tensors' QuantizationArgs);
        any other scheme is refused, naming its target."""
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsConfig,
        )

        parsed = CompressedTensorsConfig.from_config(config)
        mxfp4, head = [], False
        for target, scheme in parsed.target_scheme_map.items():
            fmt, w = scheme.get("format") or config.get("format"), scheme["weights"]
            is_mxfp4 = fmt == PACKED_FORMAT and (w.num_bits, w.type, w.group_size) == (4, "float", 32)
            if is_mxfp4:
                mxfp4.append(target)
            elif fmt == "float-quantized" and target == LM_HEAD and (w.num_bits, w.strategy) == (8, "channel"):
                head = True
            else:
                raise ValueError(
                    f"quantization_config: target {target!r} (format {fmt!r}, {w.num_bits}-bit weights): not served "
                    f"by {QUANT_NAME}, which serves MXFP4 matrices and a per-row FP8 {LM_HEAD}"
                )
        return cls(mxfp4, head, list(parsed.ignore or []))

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        archs = getattr(hf_config, "architectures", None) or []
        if user_quant in (None, QUANT_NAME, "compressed-tensors") and declares_packed(hf_quant_cfg):
            if any(a in MODELS for a in archs):
                return QUANT_NAME
        return None

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        # Read when the model is built, in the process that loads it: a bad checkpoint fails the load, not the config.
        self.model_dir = model_name

    def _stored(self) -> dict[str, StoredWeight]:
        """How the checkpoint stores each module's weight (headers only); refuses MXFP4 the models do not serve."""
        if self.stored is not None:
            return self.stored
        if self.model_dir is None or not Path(self.model_dir).is_dir():
            raise ValueError(
                f"{QUANT_NAME}: packed checkpoints are read from a local directory, got {self.model_dir!r}"
            )
        stored = stored_weights(self.model_dir)
        unserved = sorted(m for m, q in stored.items() if q.kind == "mxfp4" and not _SERVED_MXFP4.fullmatch(m))
        if unserved:
            q = stored[unserved[0]]
            what = "attention projection" if ".self_attn." in unserved[0] else "matrix"
            more = f" (and {len(unserved) - 1} more, e.g. {', '.join(unserved[1:4])})" if len(unserved) > 1 else ""
            raise CheckpointFormatError(
                f"{q.file}: tensor {q.tensor}: {what} {unserved[0]} is stored in MXFP4{more}; {QUANT_NAME} serves "
                "only MLP and expert matrices in MXFP4 (attention, routers and embeddings unquantized): write it "
                "unquantized and list it in quantization_config.ignore"
            )
        for module, q in stored.items():
            if q.kind == "fp8" and module != LM_HEAD:
                raise CheckpointFormatError(f"{q.file}: tensor {q.tensor}: {QUANT_NAME} serves only {LM_HEAD} in FP8")
        self.stored = stored
        return stored

    def is_mxfp4(self, module: str) -> bool:
        """Is checkpoint module `module` stored in MXFP4? (get_quant_method has checked that the declaration agrees.)"""
        q = self._stored().get(module)
        return q is not None and q.kind == "mxfp4"

    def _declared(self, layer: torch.nn.Module, name: str) -> str | None:
        """The target declaring checkpoint module `name` of `layer` MXFP4, None if it is ignored or unmatched: vLLM's
        compressed-tensors matching, as CompressedTensorsConfig.get_scheme_dict applies it."""
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
        from vllm.model_executor.layers.quantization.compressed_tensors.utils import (
            find_matched_target,
            should_ignore_layer,
        )

        fused = self.packed_modules_mapping
        if should_ignore_layer(name, ignore=self.ignore, fused_mapping=fused):
            return None
        targets = self.mxfp4_targets
        if isinstance(layer, RoutedExperts) and "Linear" in targets:
            # The experts are Linear modules in the checkpoint's model (vLLM's _add_fused_moe_to_target_scheme_map).
            targets = [*targets, "RoutedExperts"]
        return find_matched_target(name, layer, targets, fused)

    def _mxfp4(self, layer: torch.nn.Module, prefix: str, names: list[str], parts: list[str]) -> bool:
        """Is vLLM layer `prefix` MXFP4? Its declaration (checkpoint module `names`, as vLLM matches them) and how the
        checkpoint stores all its matrices `parts` must agree (a part missing from the file is left to the loader,
        which names the parameter it never filled)."""
        targets = [self._declared(layer, n) for n in names]
        if len({t is None for t in targets}) > 1:
            raise ValueError(f"quantization_config: {prefix} is one vLLM layer; declare {names} all MXFP4 or none")
        stored = self._stored()
        packed = [stored[p] for p in parts if p in stored and stored[p].kind == "mxfp4"]
        plain = [stored[p] for p in parts if p in stored and stored[p].kind != "mxfp4"]
        if packed and plain:
            raise CheckpointFormatError(
                f"{plain[0].file}: tensor {plain[0].tensor}: stored {plain[0].kind}, but {prefix} is one vLLM layer "
                f"over {len(parts)} checkpoint matrices and {len(packed)} of them are MXFP4: all or none"
            )
        if targets[0] is not None and plain:
            raise CheckpointFormatError(
                f"{plain[0].file}: tensor {plain[0].tensor}: stored {plain[0].kind}, but quantization_config declares "
                f"{prefix} MXFP4 (target {targets[0]!r}; list it in ignore, or store it as weight_packed/weight_scale)"
            )
        if targets[0] is None and packed:
            raise CheckpointFormatError(
                f"{packed[0].file}: tensor {packed[0].tensor}: stored in MXFP4, but quantization_config does not "
                f"declare {prefix} quantized (it is in ignore, or matches no target)"
            )
        return targets[0] is not None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

        from vllm_trn_plugin.model_executors.mxfp4_fp8 import Fp8LMHeadMethod, Fp8RowLinearMethod, Fp8RowMoEMethod

        if isinstance(layer, ParallelLMHead):
            head = self._stored().get(LM_HEAD)
            if head is not None and (head.kind == "fp8") != self.fp8_lm_head:
                declared = (
                    "declares it FP8 (a float-quantized group)" if self.fp8_lm_head else "declares it unquantized"
                )
                raise CheckpointFormatError(
                    f"{head.file}: tensor {head.tensor}: stored {head.kind}, but quantization_config {declared}"
                )
            return Fp8LMHeadMethod() if self.fp8_lm_head else UnquantizedEmbeddingMethod()
        if isinstance(layer, LinearBase):
            head, _, leaf = prefix.rpartition(".")
            parts = [f"{head}.{p}" for p in self.packed_modules_mapping.get(leaf, [leaf])]
            return Fp8RowLinearMethod() if self._mxfp4(layer, prefix, [prefix], parts) else UnquantizedLinearMethod()
        if isinstance(layer, RoutedExperts):
            names = [getattr(layer, f"ckpt_{p}_proj_name") for p in ("gate", "up", "down")]
            names = [n for n in names if n]
            parts = [f"{prefix}.{e}.{n}" for e in range(layer.global_num_experts) for n in names]
            # vLLM matches the experts by expert 0's names; the file must then hold every expert alike.
            if not self._mxfp4(layer, prefix, [f"{prefix}.0.{n}" for n in names], parts):
                return None  # vLLM's unquantized experts
            return Fp8RowMoEMethod(layer.moe_config)
        return None
