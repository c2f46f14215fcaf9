"""Independent readings of packed checkpoints and the FP8 math the served models must compute.

`load_packed` is written from the format and kernel descriptions (docs/packed-format.md, docs/kernels.md),
not from the plugin's loader: MXFP4 codes are decoded by table lookup and powers of two in float64
(element 2j in the low nibble of byte j, sign bit 3, E8M0 scale 2^(e - 127) per 32 elements), the FP8
LM head is its float8 values times its row scale, and every quantized matrix multiplies an activation
rounded per token to Trainium2 FP8 (`ml_dtypes.float8_e4m3`, scale amax / 240), plus its bias.
`ct_decompress` reads the same files with compressed-tensors' own matching and decompressors.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch

from tests.references import read_safetensors_dir

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def load_packed(ckpt: str | Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every tensor of the checkpoint in float64 under its unpacked name, and the names of the FP8 modules."""
    tensors = read_safetensors_dir(Path(ckpt))
    out: dict[str, torch.Tensor] = {}
    fp8: set[str] = set()
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            m = name.removesuffix(".weight_packed")
            codes = t.to(torch.int64)
            c = torch.stack((codes & 15, codes >> 4), -1).reshape(codes.shape[0], -1)
            values = torch.where(c >= 8, -1.0, 1.0).double() * E2M1[c & 7]
            scale = torch.exp2(tensors[m + ".weight_scale"].double() - 127).repeat_interleave(32, -1)
            out[m + ".weight"] = values * scale
            fp8.add(m)
        elif name.endswith(".weight") and t.dtype == torch.float8_e4m3fn:
            m = name.removesuffix(".weight")
            out[name] = t.double() * tensors[m + ".weight_scale"].double().reshape(-1, 1)
            fp8.add(m)
        elif not name.endswith(".weight_scale"):
            out[name] = t.double()
    return out, fp8


def ct_decompress(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """Every matrix compressed-tensors finds quantized in `ckpt` (its own target matching on config.json's
    `quantization_config`, its own compressor for each group's format: MXFP4 codes and scales, FP8 weights and
    their channel scales), decompressed, by module name, in float64."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_quantizable_tensors

    qc = QuantizationConfig.model_validate(json.loads((Path(ckpt) / "config.json").read_text())["quantization_config"])
    tensors = read_safetensors_dir(Path(ckpt))
    out: dict[str, torch.Tensor] = {}
    for scheme in qc.config_groups.values():
        compressor = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
        names = compressor.compression_param_names(scheme)
        for module, _ in match_quantizable_tensors(tensors, qc.ignore, scheme.targets, param_targets=[names[0]]):
            parts = {p: tensors[f"{module}.{p}"] for p in names if f"{module}.{p}" in tensors}
            out[module] = compressor.decompress(parts, scheme)["weight"].double()
    return out


def expanded_values(m: Any) -> torch.Tensor:
    """The matrix a loaded `ExpandedMatrix` holds, in float64: its FP8 values times their row scales (exact), or
    its bf16 values."""
    if m.row_scale is None:
        return m.weight.double()
    return m.weight.double() * m.row_scale.double().unsqueeze(-1)


def fp8_activation(x: torch.Tensor) -> torch.Tensor:
    """x rounded per row (last dim) to Trainium2 FP8 with scale amax / 240, returned in float64."""
    x = x.double()
    amax = x.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 240.0, 1.0)
    q = (x / s).numpy().astype(ml_dtypes.float8_e4m3).astype(np.float64)
    return torch.from_numpy(q) * s


def fp8_static(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x rounded to Trainium2 FP8 with one fixed scale (a calibrated static scale), saturating at +-240 x scale as a
    static-scale cache must for a value past its calibration; returned in float64."""
    q = (x.double() / scale).clamp(-240.0, 240.0).numpy().astype(ml_dtypes.float8_e4m3).astype(np.float64)
    return torch.from_numpy(q) * scale


ACTIVATION_NOISE = 1e-7  # relative: how far a float32 forward may hold an activation from the float64 one


@contextlib.contextmanager
def perturbed_activations(seed: int, noise: float = ACTIVATION_NOISE) -> Iterator[None]:
    """While open, every activation is perturbed by `noise` (relative, Gaussian) before its FP8 rounding: an equally
    valid FP8 forward that lands on the other side of the rounding midpoints float32 noise can cross."""
    global fp8_activation
    exact, g = fp8_activation, torch.Generator().manual_seed(seed)

    def noisy(x: torch.Tensor) -> torch.Tensor:
        x = x.double()
        return exact(x * (1 + noise * torch.randn(x.shape, generator=g, dtype=torch.float64)))

    fp8_activation = noisy
    try:
        yield
    finally:
        fp8_activation = exact


def nearest_reference_run(served: torch.Tensor, reference: Callable[[], torch.Tensor], seeds: int = 4) -> torch.Tensor:
    """Of the reference's exact run and `seeds` perturbed ones (each a valid FP8 forward), the one nearest to the
    served logits: served and reference differ by a few FP8 rounding flips wherever float32 and float64 straddle a
    midpoint, and a flip moves logits by O(0.1-1) through the cache and the router."""
    runs = [reference()]
    for seed in range(seeds):
        with perturbed_activations(seed):
            runs.append(reference())
    return min(runs, key=lambda run: float((served - run).abs().max()))


def fp8_matmul(weights: dict[str, torch.Tensor], module: str, x: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """y = W Q(x) + b for a quantized module (x [..., in]); the bias is the checkpoint's bias-correction vector.

    `parts` > 1: the matrix split along its input as a row-parallel layer at that tensor-parallel size holds it,
    each rank rounding its own slice of x (its own per-token scale), the partial products summed (the all-reduce)."""
    w = weights[module + ".weight"]
    xs, ws = x.double().chunk(parts, dim=-1), w.chunk(parts, dim=-1)
    y = sum(fp8_activation(xp) @ wp.T for xp, wp in zip(xs, ws))
    bias = weights.get(module + ".bias")
    return y if bias is None else y + bias


def patch_afmoe_fp8(
    model: torch.nn.Module,
    weights: dict[str, torch.Tensor],
    fp8: set[str],
    tp: int = 1,
    expert_tp: int | None = None,
) -> torch.nn.Module:
    """transformers' AfmoeForCausalLM with each quantized MLP, shared expert, routed expert group and LM head replaced
    by the FP8 math on the packed checkpoint's matrices (in place; the router, attention and norms stay
    transformers'). A packed matrix left out of `fp8` is computed unquantized, with its bias correction.

    `tp`: the rounding a tensor-parallel engine of that size does: each down_proj's input rounded per rank slice
    (gate/up and the vocabulary-parallel LM head see the whole input, as at size 1). `expert_tp` (default `tp`):
    the same for the routed experts; 1 under expert parallelism, where each rank holds whole experts."""
    F = torch.nn.functional
    expert_tp = tp if expert_tp is None else expert_tp

    def linear(module: str, x: torch.Tensor, parts: int = 1) -> torch.Tensor:
        if module in fp8:
            return fp8_matmul(weights, module, x, parts)
        return x.double() @ weights[module + ".weight"].T + weights[module + ".bias"]  # served in bf16 (opt-in)

    def mlp(prefix: str, x: torch.Tensor, parts: int) -> torch.Tensor:
        h = F.silu(linear(f"{prefix}.gate_proj", x)) * linear(f"{prefix}.up_proj", x)
        return linear(f"{prefix}.down_proj", h, parts)

    def dense(prefix: str):  # noqa: ANN202
        return lambda x: mlp(prefix, x, tp).to(x.dtype)

    def routed(prefix: str):  # noqa: ANN202
        def forward(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(x.shape, dtype=torch.float64)
            for e in top_k_index.unique().tolist():
                tok, k = torch.where(top_k_index == e)
                y = mlp(f"{prefix}.{e}", x[tok], expert_tp)
                out.index_add_(0, tok, y * top_k_weights[tok, k, None].double())
            return out.to(x.dtype)

        return forward

    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}.mlp"
        if hasattr(layer.mlp, "experts"):
            if f"{p}.shared_experts.gate_proj.bias" in weights:
                layer.mlp.shared_experts.forward = dense(f"{p}.shared_experts")
            if f"{p}.experts.0.gate_proj.bias" in weights:
                layer.mlp.experts.forward = routed(f"{p}.experts")
        elif f"{p}.gate_proj.bias" in weights:
            layer.mlp.forward = dense(p)
    if "lm_head" in fp8:
        model.lm_head.forward = lambda x: fp8_matmul(weights, "lm_head", x).to(x.dtype)
    return model
