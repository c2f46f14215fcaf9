"""FP8 layer methods for packed MXFP4 checkpoints (the `trn-mxfp4-fp8` method, model_executors/mxfp4_fp8_config.py).

The layers hold what the loader produces (loaders/mxfp4.py: exact MXFP4 -> FP8 rows):

- MLP / shared-expert linears: `weight` FP8 [out, in], `weight_scale` fp32 [out],
  `bias_correction` fp32 [out];
- routed experts: `w13_weight` FP8 [E, 2I, H] (gate rows, then up rows), `w2_weight` FP8 [E, H, I],
  their `*_weight_scale` [E, rows] and `*_bias_correction` [E, rows]; after loading, the FP8 stacks are held in the
  FP8 expert kernel's layout (`fp8_expert.to_kernel_layout`, [E, 128, rows/128, cols/128, 128]: K-major 128-row
  tiles, read by the kernel in long contiguous runs; the torch path reads it bit for bit);
- LM head: `weight` FP8 [vocab, hidden], `weight_scale` fp32 [vocab].

Under tensor parallelism each rank holds its part of every FP8 matrix, as vLLM's layers shard them: a
column-parallel matrix (gate/up, the LM head's vocabulary rows) its rows with their scales and biases, a
row-parallel one (down_proj, the experts' w2) its columns under the whole rows' scales (a row's power-of-two
scale holds every part of it exactly) and the bias correction on rank 0 only, so that the all-reduce adds it
once. Under expert parallelism a rank holds whole experts, those vLLM's expert map gives it.

Every one computes kernels/fp8.fp8_linear (per-token FP8 activations, FP8 x FP8, fp32
accumulation, both scales on the accumulator's output, then the bias). Everything else (attention,
norms, embeddings, routers) is unquantized. On the CPU platform each FP8 matrix also gets a compute copy at load
(`fp8_compute`: FBGEMM's packed fp16 form, 2 bytes per weight beside the FP8 byte; docs/fp8.md), which the products
are computed from instead of converting the weight per call; VLLM_TRN_FP8_RESIDENCY=fp8 keeps the FP8 bytes only
(for hosts short of memory: each call then converts its matrix in bounded row chunks). Device platforms hold the
FP8 weights only; their FP8 GEMM reads them.

A matrix that cannot be exact in FP8 (a row spanning more than 13 octaves) stops the load, unless the
user opts in with VLLM_TRN_ALLOW_BF16=1: then the loader decodes it exactly to bf16 and the parameter
holding it (a layer's fused weight, or one expert stack: w13 or w2 of one MoE layer) is held in bf16
(its FP8 parts dequantized exactly: FP8 x a power-of-two scale fits bf16) and computed unquantized
(fp32 math, no activation rounding, then the bias). Each such matrix and parameter is logged as a warning.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import Parameter
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.linear import LinearMethodBase, RowParallelLinear
from vllm.model_executor.utils import set_weight_attrs
from vllm.platforms import current_platform

from vllm_trn_plugin.envs import ALLOW_BF16, allow_bf16, fp8_residency
from vllm_trn_plugin.kernels import dispatch
from vllm_trn_plugin.kernels.fp8 import FP8_DTYPE, fp8_compute_copy
from vllm_trn_plugin.kernels.fp8_expert import (
    TILE,
    ExpertWeights,
    expert_compute_copies,
    in_kernel_layout,
    to_kernel_layout,
)
from vllm_trn_plugin.loaders.io import CheckpointFormatError
from vllm_trn_plugin.loaders.mxfp4 import ExpandedMatrix
from vllm_trn_plugin.loaders.packed import QUANT_NAME, Part, iter_checkpoint

logger = init_logger(__name__)


def _fp8_param(shape: tuple[int, ...], dtype: torch.dtype, **attrs: Any) -> Parameter:
    # NaN-free but recognisable: a parameter the checkpoint never filled is caught by the loader's check.
    p = Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(p, attrs)
    return p


def _to_bf16(weight: torch.Tensor, scale: torch.Tensor, where: str) -> torch.Tensor:
    """FP8 rows times their power-of-two scales, in bf16; checked exact (a scale below bf16's range would not be)."""
    w = weight.float() * scale.unsqueeze(-1)
    out = w.to(torch.bfloat16)
    if not torch.equal(out.float(), w):
        raise CheckpointFormatError(f"{where}: FP8 rows do not convert to bf16 exactly (row scale out of range)")
    return out


def _bf16_report(where: str, matrices: list[str], param: torch.Tensor) -> None:
    logger.warning(
        "%s: held in bf16 and computed unquantized (%s=1), %.1f MiB, because of %s",
        where,
        ALLOW_BF16,
        param.numel() * 2 / 2**20,
        ", ".join(matrices),
    )


def _tracking(
    loader: Callable[..., Any],
    seen: set[tuple[str, Any]],
    name: str,
    bf16_parts: dict[Any, torch.Tensor],
    skip: bool = False,
) -> Callable[..., Any]:
    """vLLM's `loader` for parameter `name`, recording what arrived; `skip`: arrived, but this rank keeps zeros."""

    def load(param: Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        shard = args[0] if args else kwargs.get("loaded_shard_id")
        if name == "weight" and loaded_weight.dtype == torch.bfloat16 and param.dtype == FP8_DTYPE:
            # Never into the FP8 parameter (the copy would round it): into a bf16 one of the same shape, which vLLM's
            # loader fills with this rank's part as it would the FP8 one. Merged at the end.
            part = Parameter(torch.zeros(param.shape, dtype=torch.bfloat16), requires_grad=False)
            set_weight_attrs(part, {a: getattr(param, a) for a in ("input_dim", "output_dim") if hasattr(param, a)})
            loader(part, loaded_weight, *args, **kwargs)
            bf16_parts[shard] = part.data
            seen.add(("weight_scale", shard))  # a bf16 matrix has no scale to wait for
        elif not skip:
            loader(param, loaded_weight, *args, **kwargs)
        seen.add((name, shard))

    return load


def _check_complete(layer: torch.nn.Module, seen: set, expected: dict[str, set]) -> None:
    where = getattr(layer, "layer_name", None) or getattr(layer, "prefix", None) or type(layer).__name__
    for name, parts in expected.items():
        missing = sorted(str(p) for p in parts if (name, p) not in seen)
        if missing:
            raise CheckpointFormatError(
                f"{where}.{name}: never loaded for {missing} (a tensor is missing from the checkpoint)"
            )


class Fp8RowLinearMethod(LinearMethodBase):
    """FP8 rows with their scales and the bias-correction vector (MLPs, shared experts)."""

    params = ("weight", "weight_scale", "bias_correction")

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        out = sum(output_partition_sizes)
        self.seen: set[tuple[str, Any]] = set()
        shards = set(range(len(output_partition_sizes))) if len(output_partition_sizes) > 1 else {None}
        self.expected = {n: shards for n in self.params}
        self.bf16_parts: dict[Any, torch.Tensor] = {}
        self.shard_rows = {
            shard: (sum(output_partition_sizes[:i]), n)
            for i, (shard, n) in enumerate(zip(sorted(shards, key=lambda x: x or 0), output_partition_sizes))
        }
        loader = extra_weight_attrs["weight_loader"]
        # A row-parallel layer's outputs are partial sums, all-reduced: its bias correction belongs to one rank.
        bias_elsewhere = isinstance(layer, RowParallelLinear) and get_tensor_model_parallel_rank() > 0
        for name in self.params:
            weight = name == "weight"
            layer.register_parameter(
                name,
                _fp8_param(
                    (out, input_size_per_partition) if weight else (out,),
                    FP8_DTYPE if weight else torch.float32,
                    **({"input_dim": 1} if weight else {}),
                    output_dim=0,
                    weight_loader=_tracking(
                        loader, self.seen, name, self.bf16_parts, skip=bias_elsewhere and name == "bias_correction"
                    ),
                ),
            )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._merge_bf16_parts(layer)
        layer.fp8_compute = compute_copy(layer.weight.data)

    def _merge_bf16_parts(self, layer: torch.nn.Module) -> None:
        if not self.bf16_parts:
            return
        where = getattr(layer, "prefix", None) or type(layer).__name__
        w = _to_bf16(layer.weight.data, layer.weight_scale.data, where)
        for shard, part in self.bf16_parts.items():
            start, n = self.shard_rows[shard]
            w[start : start + n] = part[start : start + n]
        layer.weight.data = w
        layer.weight_scale.data.fill_(1.0)
        _bf16_report(where, [f"shard {s}" for s in self.bf16_parts], w)
        self.bf16_parts = {}

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        b = getattr(layer, "bias_correction", None)
        compute = getattr(layer, "fp8_compute", None)
        y = dispatch.fp8_linear(x.reshape(-1, x.shape[-1]), layer.weight, layer.weight_scale, b, compute)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], -1)


class Fp8LMHeadMethod(Fp8RowLinearMethod):
    """FP8 LM head: the same FP8 x FP8 math, no bias correction. Never held in bf16: its checkpoint rows are FP8
    values with one scale each, exact however many octaves a row spans, so the reader never decodes one to bf16."""

    params = ("weight", "weight_scale")

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the FP8 LM head is not an input embedding (the models do not tie them)")


class Fp8RowMoEMethod(FusedMoEMethodBase):
    """Routed experts on FP8 rows: per expert, gate/up as one FP8 matmul, SiLU(gate) x up, down, weighted sum."""

    def create_weights(
        self,
        layer: RoutedExperts,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        if not self.moe.is_act_and_mul:
            raise ValueError(f"{QUANT_NAME}: experts without a gated activation are not supported")
        E, H, I = num_experts, hidden_size, intermediate_size_per_partition
        self.layer = layer  # its expert map (expert parallelism) places the checkpoint's experts
        self.seen: set[tuple[str, Any]] = set()
        self.expected: dict[str, set] = {}
        self.bf16_parts: dict[tuple[str, int, str], torch.Tensor] = {}
        for prefix, (rows, cols), shards in (("w13_", (2 * I, H), ("w1", "w3")), ("w2_", (H, I), ("w2",))):
            for name, shape, dtype in (
                ("weight", (E, rows, cols), FP8_DTYPE),
                ("weight_scale", (E, rows), torch.float32),
                ("bias_correction", (E, rows), torch.float32),
            ):
                layer.register_parameter(
                    prefix + name, _fp8_param(shape, dtype, weight_loader=self._loader(prefix + name, I))
                )
                self.expected[prefix + name] = {(e, sh) for e in range(E) for sh in shards}

    def _rank_part(self, t: torch.Tensor, param_name: str, shard_id: str, where: str) -> torch.Tensor:
        """This tensor-parallel rank's part of one expert's checkpoint tensor: w1/w3 split by rows (their scales and
        biases with them), w2 by columns (under the whole rows' scales), w2's bias correction on rank 0 only."""
        tp, rank = self.moe.tp_size, self.moe.tp_rank
        if tp == 1:
            return t
        dim = 0 if shard_id in ("w1", "w3") else 1
        if shard_id == "w2" and param_name != "w2_weight":
            return t if param_name == "w2_weight_scale" or rank == 0 else torch.zeros_like(t)
        if t.shape[dim] % tp:
            raise CheckpointFormatError(
                f"checkpoint tensor {where}: {t.shape[dim]} {'rows' if dim == 0 else 'columns'} do not split "
                f"across --tensor-parallel-size {tp}"
            )
        n = t.shape[dim] // tp
        return t.narrow(dim, rank * n, n)

    def _loader(self, param_name: str, I: int) -> Callable[..., bool]:
        def load(
            param: Parameter,
            loaded_weight: torch.Tensor,
            weight_name: str,
            shard_id: str,
            expert_id: int,
            return_success: bool = False,
        ) -> bool:
            expert_map = self.layer.expert_map
            local = expert_id if expert_map is None else int(expert_map[expert_id])
            if local < 0:
                return False  # another rank's expert (expert parallelism)
            loaded_weight = self._rank_part(loaded_weight, param_name, shard_id, weight_name)
            dst = param.data[local]
            if shard_id in ("w1", "w3"):
                dst = dst.narrow(0, 0 if shard_id == "w1" else I, I)
            if dst.shape != loaded_weight.shape:
                raise CheckpointFormatError(
                    f"checkpoint tensor {weight_name} (expert {expert_id}, {shard_id}): shape "
                    f"{tuple(loaded_weight.shape)}, {param_name} expects {tuple(dst.shape)}"
                )
            if loaded_weight.dtype == torch.bfloat16 and dst.dtype == FP8_DTYPE:  # opt-in; merged at the end
                self.bf16_parts[(param_name, local, shard_id)] = loaded_weight
                # a bf16 matrix has no scale to wait for
                self.seen.add((param_name.replace("weight", "weight_scale"), (local, shard_id)))
            else:
                dst.copy_(loaded_weight)
            self.seen.add((param_name, (local, shard_id)))
            return True

        return load

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        where = getattr(layer, "layer_name", None) or type(layer).__name__
        I = layer.w2_weight.shape[-1]
        for prefix in ("w13_", "w2_"):
            parts = {k: v for k, v in self.bf16_parts.items() if k[0] == prefix + "weight"}
            if not parts:
                continue
            weight, scale = getattr(layer, prefix + "weight"), getattr(layer, prefix + "weight_scale")
            w = torch.empty(weight.shape, dtype=torch.bfloat16)
            for e in range(w.shape[0]):  # one expert at a time: no fp32 copy of the whole stack
                w[e] = _to_bf16(weight.data[e], scale.data[e], f"{where}.{prefix}weight[{e}]")
            for (_, e, shard), part in parts.items():
                w[e].narrow(0, I if shard == "w3" else 0, part.shape[0]).copy_(part)
            weight.data = w
            scale.data.fill_(1.0)
            _bf16_report(f"{where}.{prefix}weight", [f"expert {e} {shard}" for _, e, shard in parts], w)
        self.bf16_parts = {}
        # FP8 stacks go into the FP8 expert kernel's layout (fp8_expert.to_kernel_layout: each 128-row tile stored
        # K-major, so the kernel's DMAs read long contiguous runs instead of one byte per descriptor); the torch
        # path reads it too, bit for bit. Once: a stack already tiled (this runs again on the Neuron path) or not
        # made of 128 x 128 tiles stays as it is.
        for prefix in ("w13_", "w2_"):
            weight = getattr(layer, prefix + "weight")
            w = weight.data
            if w.dtype == FP8_DTYPE and not in_kernel_layout(w) and w.shape[1] % TILE == 0 and w.shape[2] % TILE == 0:
                weight.data = to_kernel_layout(w)
        layer.fp8_compute = None
        if current_platform.is_cpu() and fp8_residency() == "copy":
            layer.fp8_compute = expert_compute_copies(ExpertWeights(*(getattr(layer, n).data for n in _EXPERT_PARAMS)))

    def get_fused_moe_quant_config(self, layer: RoutedExperts) -> None:
        return None

    def apply(
        self,
        layer: RoutedExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        if layer.expert_map is not None:  # expert parallelism: local ids, -1 for another rank's experts
            topk_ids = layer.expert_map[topk_ids.long()].to(topk_ids.dtype)
        return dispatch.fp8_experts(
            x,
            topk_weights,
            topk_ids,
            *(getattr(layer, n) for n in _EXPERT_PARAMS),
            layer.expert_map is None,
            getattr(layer, "fp8_compute", None),
        )


_EXPERT_PARAMS = (
    "w13_weight",
    "w13_weight_scale",
    "w13_bias_correction",
    "w2_weight",
    "w2_weight_scale",
    "w2_bias_correction",
)


def compute_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The CPU's compute copy of a quantized layer's matrix (fp8.fp8_compute_copy), made once at load: None on
    a device platform (its FP8 GEMM reads the FP8 weight) and under FP8-only residency (VLLM_TRN_FP8_RESIDENCY=fp8:
    no copy, each call converts the matrix in row chunks)."""
    if not current_platform.is_cpu() or fp8_residency() != "copy":
        return None
    return fp8_compute_copy(weight)


@dataclass(frozen=True)
class RankPart:
    """A rank's place under tensor parallelism, for `packed_weights`: `rank` of `size`; `experts`: routed experts are
    split over the same ranks too (vLLM's MoE shards them so only without expert and data parallelism)."""

    rank: int
    size: int
    experts: bool


def tensor_parallel_part() -> RankPart | None:
    """This process's `RankPart` from vLLM's state (None without tensor parallelism). Without a current vLLM
    config the routed experts are kept whole: expanding all of an expert costs time, splitting it wrongly would
    cost correctness."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    size = parallel_state.get_tensor_model_parallel_world_size()
    if size <= 1:
        return None
    config = get_current_vllm_config_or_none()
    pc = config.parallel_config if config is not None else None
    experts = pc is not None and not pc.enable_expert_parallel and pc.data_parallel_size == 1
    return RankPart(parallel_state.get_tensor_model_parallel_rank(), size, experts)


# The MLP matrices of both models (dense, shared experts, routed experts), the only ones stored as MXFP4
# (loaders/packed.DEFAULT_MATRIX_PATTERN): gate/up are column-parallel (MergedColumnParallelLinear, the experts'
# w1/w3), down is row-parallel (RowParallelLinear, the experts' w2).
_SPLIT_MATRIX = re.compile(r".+\.mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj)\.weight")


def rank_part_of(tp: RankPart) -> Callable[[str, tuple[int, ...]], Part | None]:
    """For `iter_checkpoint`'s `part`: the rows (gate/up) or input columns (down) of an MLP matrix that rank `tp.rank`
    keeps, the same contiguous `1/size` slice vLLM's weight loaders (and `Fp8RowMoEMethod._rank_part`) narrow to;
    None (expand it all, let the loader narrow and check) for anything else, including a dimension that does not
    split evenly (the loader then raises its own error, as without this)."""

    def part(name: str, shape: tuple[int, ...]) -> Part | None:
        m = _SPLIT_MATRIX.fullmatch(name)
        if m is None or len(shape) != 2 or ((m.group(1) or "").startswith("experts") and not tp.experts):
            return None
        dim = 1 if m.group(2) == "down_proj" else 0
        if shape[dim] % tp.size:
            return None
        n = shape[dim] // tp.size
        span = (tp.rank * n, tp.rank * n + n)
        return (None, span) if dim == 1 else (span, None)

    return part


def packed_weights(
    model_dir: str | Path,
    quantized: Callable[[str], bool],
    *,
    keep_bf16: bool | None = None,
    skip: Callable[[str], bool] | None = None,
    tp: RankPart | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The packed checkpoint as the models' load_weights expect it, streamed tensor by tensor.

    `<m>.weight` MXFP4 -> `<m>.weight` (FP8) and `<m>.weight_scale` (fp32 per row); `<m>.bias` of a
    quantized `<m>` -> `<m>.bias_correction`; the FP8 LM head -> `lm_head.weight`, `lm_head.weight_scale`.
    A matrix that cannot be exact in FP8 stops the load unless `keep_bf16` (default: VLLM_TRN_ALLOW_BF16=1);
    then it comes as `<m>.weight` in bf16 (exact decode) without a scale, and the layer methods hold it in bf16.
    Tensors whose checkpoint name `skip` accepts are not read (another rank's experts).

    Under tensor parallelism (`tp`, default: `tensor_parallel_part()` from vLLM's state) each MLP matrix is expanded
    only where this rank keeps it (`rank_part_of`): it still arrives whole-size, as vLLM's weight loaders expect,
    but only their part of it is written (see `iter_checkpoint`'s `part`), so a rank's expansion work is 1/size.
    """
    if not Path(model_dir).is_dir():
        raise ValueError(f"{QUANT_NAME}: packed checkpoints are read from a local directory, got {model_dir!r}")
    keep = allow_bf16() if keep_bf16 is None else keep_bf16
    tp = tensor_parallel_part() if tp is None else tp
    part = rank_part_of(tp) if tp is not None and tp.size > 1 else None
    if part is not None:
        logger.info(
            "%s: tensor-parallel rank %d of %d expands only its part of each MLP matrix (routed experts: %s)",
            QUANT_NAME,
            tp.rank,
            tp.size,
            "split" if tp.experts else "whole",
        )
    for name, t in iter_checkpoint(model_dir, allow_bf16=keep, skip=skip, part=part):
        module, _, leaf = name.rpartition(".")
        if isinstance(t, ExpandedMatrix):
            yield name, t.weight
            if t.is_fp8:
                yield f"{module}.weight_scale", t.row_scale.reshape(t.weight.shape[:-1])
        elif leaf == "bias" and quantized(module):
            yield f"{module}.bias_correction", t
        else:
            yield name, t


def other_ranks_experts(moe_layers: dict[int, Any]) -> Callable[[str], bool] | None:
    """For `packed_weights`' `skip`: the routed experts of `moe_layers` (layer index -> vLLM's MoE layer) that
    this rank does not hold under expert parallelism (their expert map's -1 entries); None without one."""
    remote = {}
    for i, layer in moe_layers.items():
        if layer.expert_map is not None:
            remote[i] = {e for e, local in enumerate(layer.expert_map.tolist()) if local < 0}
    if not remote:
        return None
    pattern = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")

    def skip(name: str) -> bool:
        m = pattern.match(name)
        return m is not None and int(m.group(2)) in remote.get(int(m.group(1)), ())

    return skip


def check_all_loaded(model: torch.nn.Module, loaded: set[str]) -> None:
    """Every parameter filled, and every shard / expert of each FP8 parameter (vLLM itself checks completeness
    only for unquantized models, and only per parameter).

    The FP8 layers' parameters are judged by their methods' own bookkeeping, not by `loaded`: a matrix that came
    in bf16 needs no scale, so a parameter such as a bf16 down_proj's `weight_scale` is complete though the
    checkpoint never named it."""
    tracked: set[str] = set()
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, (Fp8RowLinearMethod, Fp8RowMoEMethod)):
            _check_complete(module, method.seen, method.expected)
            tracked |= {f"{prefix}.{name}" for name in method.expected}
    missing = sorted(set(dict(model.named_parameters())) - loaded - tracked)
    if missing:
        raise CheckpointFormatError(
            f"{type(model).__name__}: the checkpoint has no tensor for {len(missing)} parameter(s): "
            f"{', '.join(missing[:8])}"
        )
