"""`vllm-trn quantize`: the MXFP4 recipe with error compensation, written in the packed format.

Every MLP / expert matrix (dense MLPs, shared experts, routed experts: `loaders.packed.DEFAULT_MATRIX_PATTERN`)
becomes MXFP4 with a bf16 bias-correction vector; the LM head becomes per-row FP8; attention
(including `o_proj`), router, norms and embeddings are copied unchanged. The recipe:

1. Sequential calibration: layer by layer, each layer's inputs are the calibration hidden states
   produced by the layers already quantized, with FP8 activation rounding on (every quantized
   matrix sees its input rounded per token to Trainium2 FP8, as `kernels/fp8_expert` serves it).
   Inside an MLP, down_proj is fitted to the inputs the quantized gate_proj / up_proj produce.
2. GPTQ with activation order and Hessian-weighted block exponents (`gptq.py`), 128-column blocks,
   1% damping; the Hessian of each matrix is built from its served (FP8-rounded) inputs;
   gate_proj and up_proj share one (same inputs) and are solved as one stacked matrix. All routed
   experts of a layer come from one calibration pass and are solved as batches of `expert_batch`
   matrices through one column loop.
3. Bias correction: b = (W - Q) mean(x~) over the calibration inputs x~ the matrix sees, so the mean
   output error on those inputs is zero; bf16, 2 bytes per output row (8 KB per Trinity-Mini expert).
4. Round-to-nearest fallback: a routed expert with fewer than `rtn_threshold` calibration tokens
   (default 16384; always, for one no token reached) gets plain RTN (`quantize_rtn`'s rounding) and a zero
   bias: its Hessian and mean would be estimated from too few tokens. Dense MLPs and shared experts see every token.

Every row respects the exact FP8 expansion rule (block exponents within 13 octaves, `loaders.mxfp4.limit_spread`),
so the result loads without `VLLM_TRN_ALLOW_BF16`. Streaming as in `convert_mla`: one layer's tensors at a
time, the calibration hidden states [tokens, hidden] float32 in memory, shards written as they fill.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_trn_plugin.kernels.fp8 import quantize_per_token
from vllm_trn_plugin.loaders.io import SHARD_BYTES, Checkpoint, CheckpointFormatError, ShardWriter
from vllm_trn_plugin.loaders.mxfp4 import (
    BLOCK_SIZE,
    E8M0_BIAS,
    limit_spread,
    pack_codes,
    quantize_codes,
    round_to_grid,
    rtn_exponents,
)
from vllm_trn_plugin.loaders.packed import (
    DEFAULT_MATRIX_PATTERN,
    LM_HEAD,
    quantization_config,
    write_fp8_lm_head,
    write_mxfp4,
)
from vllm_trn_plugin.tools.afmoe_forward import (
    MLP_CHUNK_TOKENS,
    Geometry,
    ToolReport,
    ToolRun,
    attention_residual,
    attention_weights,
    layer_prefix,
    mlp_forward,
    rms_norm,
    route,
)
from vllm_trn_plugin.tools.gptq import gptq

__all__ = ["QuantizeOptions", "QuantizeReport", "quantize"]

_BIAS_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class QuantizeOptions:
    """The recipe's switches (the defaults are the recipe; the others exist to measure each part)."""

    rtn_threshold: int = 16384  # routed experts with fewer calibration tokens get RTN
    block: int = 128  # GPTQ lazy-update block (columns)
    damp: float = 0.01  # GPTQ damping, relative to mean(diag H)
    act_order: bool = True
    hessian_scales: bool = True
    bias_correction: bool = True
    fp8_activations: bool = True  # calibrate on FP8-rounded inputs, as served
    gptq: bool = True  # False: RTN for every matrix (the baseline)
    expert_batch: int = 16  # routed experts solved per batched column loop (memory: see docs)
    measure: bool = False  # also compute each layer's MLP output error against the unquantized MLP


@dataclass(kw_only=True)
class QuantizeReport(ToolReport):
    gptq: list[str] = field(default_factory=list)  # MXFP4 module names solved by GPTQ
    rtn: list[str] = field(default_factory=list)  # RTN fallback (too few tokens) or RTN everywhere
    expert_tokens: dict[int, list[int]] = field(default_factory=dict)  # layer -> calibration tokens per expert
    layer_error: dict[int, float] = field(default_factory=dict)  # with `measure`: relative MLP output MSE
    fp8: list[str] = field(default_factory=list)


@dataclass
class _Unit:
    """One gate/up/down triple (a dense MLP, the shared expert or a routed expert) and the tokens it sees."""

    prefix: str  # e.g. "model.layers.3.mlp.experts.17."
    tok: torch.Tensor | None  # indices into the layer's tokens; None = all
    weight: torch.Tensor | None  # routing weight per token (routed experts), None = 1


class _Inputs:
    """Per-token inputs of one matrix kind as the served FP8 matmul sees them (`quantize_per_token`: FP8 values,
    1 byte each, and a float32 scale per token), built from `fn` of each row chunk (the float32 activations of
    all tokens never exist at once); `chunks` gives values x scale in float32, MLP_CHUNK_TOKENS rows at a time."""

    def __init__(
        self, chunks: Iterable[torch.Tensor], fp8: bool, fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        self.fp8 = fp8
        values, scales = [], []
        for c in chunks:
            y = c if fn is None else fn(c)
            if fp8:
                v, sc = quantize_per_token(y)
                values.append(v)
                scales.append(sc)
            else:
                values.append(y)
        self.values = values[0] if len(values) == 1 else torch.cat(values)
        self.scale = (scales[0] if len(scales) == 1 else torch.cat(scales)) if fp8 else None

    def chunks(self, tok: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
        """The inputs of tokens `tok` (None: all) in float32, MLP_CHUNK_TOKENS rows at a time."""
        n = self.values.shape[0] if tok is None else tok.numel()
        for r in range(0, max(n, 1), MLP_CHUNK_TOKENS):  # no token: one empty chunk
            rows = slice(r, r + MLP_CHUNK_TOKENS) if tok is None else tok[r : r + MLP_CHUNK_TOKENS]
            v = self.values[rows]
            yield v.float() * self.scale[rows][:, None] if self.fp8 else v


class _Layer:
    """Quantizes the MLP units of one layer and accumulates their served output."""

    def __init__(
        self, ckpt: Checkpoint, writer: ShardWriter, opts: QuantizeOptions, report: QuantizeReport, x: torch.Tensor
    ) -> None:
        self.ckpt, self.writer, self.opts, self.report = ckpt, writer, opts, report
        self.x = _Inputs(x.split(MLP_CHUNK_TOKENS), opts.fp8_activations)
        self.out = torch.zeros_like(x)

    def run(self, units: list[_Unit], solve: bool) -> None:
        """Quantize units with the same shapes as one batch: GPTQ (`solve`) or RTN."""
        if not units:
            return
        get = self.ckpt.f32
        w_gu = torch.stack(
            [torch.cat([get(u.prefix + "gate_proj.weight"), get(u.prefix + "up_proj.weight")]) for u in units]
        )
        inter = w_gu.shape[1] // 2
        q_gu, e_gu, b_gu = self._quantize(w_gu, lambda k: self.x.chunks(units[k].tok), solve)
        del w_gu
        hs = []
        for k, u in enumerate(units):

            def act(c: torch.Tensor, k: int = k) -> torch.Tensor:
                gu = c @ q_gu[k].T + b_gu[k].float()
                return F.silu(gu[:, :inter]) * gu[:, inter:]

            hs.append(_Inputs(self.x.chunks(u.tok), self.opts.fp8_activations, act))
        w_d = torch.stack([get(u.prefix + "down_proj.weight") for u in units])
        q_d, e_d, b_d = self._quantize(w_d, lambda k: hs[k].chunks(), solve)
        del w_d
        for k, u in enumerate(units):
            r = 0
            for c in hs[k].chunks():
                y = c @ q_d[k].T + b_d[k].float()
                rows = slice(r, r + c.shape[0])
                if u.tok is None:
                    self.out[rows] += y
                else:
                    self.out.index_add_(0, u.tok[rows], y * u.weight[rows, None])
                r += c.shape[0]
            for name, q, e, b in (
                ("gate_proj", q_gu[k, :inter], e_gu[k, :inter], b_gu[k, :inter]),
                ("up_proj", q_gu[k, inter:], e_gu[k, inter:], b_gu[k, inter:]),
                ("down_proj", q_d[k], e_d[k], b_d[k]),
            ):
                self._write(u.prefix + name, q, e, b)
                (self.report.gptq if solve else self.report.rtn).append(u.prefix + name)

    def _quantize(
        self, w: torch.Tensor, inputs: Callable[[int], Iterator[torch.Tensor]], solve: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q float32 [E, out, in], exponents [E, out, in/32], bf16 bias [E, out]) of a batch of matrices;
        `inputs(k)` gives matrix k's served calibration inputs [n_k, in] in row chunks."""
        opts = self.opts
        if not solve:
            exp = limit_spread(rtn_exponents(w))
            q = round_to_grid(w, exp.repeat_interleave(BLOCK_SIZE, -1))
            return q, exp, torch.zeros(w.shape[:2], dtype=_BIAS_DTYPE)
        n_in = w.shape[-1]
        h = torch.zeros(w.shape[0], n_in, n_in)
        mean = torch.zeros(w.shape[0], n_in, dtype=torch.float64)
        for k in range(w.shape[0]):
            n = 0
            for x in inputs(k):
                h[k].addmm_(x.T, x)
                mean[k] += x.double().sum(0)
                n += x.shape[0]
            mean[k] /= max(n, 1)
        q, exp = gptq(
            w, h, block=opts.block, damp=opts.damp, act_order=opts.act_order, hessian_scales=opts.hessian_scales
        )
        del h
        if opts.bias_correction:
            bias = torch.einsum("eoi,ei->eo", w.double() - q.double(), mean).to(_BIAS_DTYPE)
        else:
            bias = torch.zeros(w.shape[:2], dtype=_BIAS_DTYPE)
        return q, exp, bias

    def _write(self, module: str, q: torch.Tensor, exp: torch.Tensor, bias: torch.Tensor) -> None:
        codes = pack_codes(quantize_codes(q, exp, exact=True))
        write_mxfp4(self.writer, module, codes, (exp + E8M0_BIAS).to(torch.uint8), bias)


def _check_source(ckpt: Checkpoint, geo: Geometry) -> None:
    where = str(ckpt.config_path)
    if ckpt.config.get("quantization_config"):
        raise ValueError(f"{where}: field 'quantization_config' is set: quantize needs an unquantized checkpoint")
    for name in ckpt.entries:
        module = name.removesuffix(".weight")
        if name.endswith(".bias") and re.fullmatch(DEFAULT_MATRIX_PATTERN, name.removesuffix(".bias")):
            raise CheckpointFormatError(f"{ckpt.where(name)}: an MLP bias is not supported (AFMoE has none)")
        if name.endswith(".weight") and re.fullmatch(DEFAULT_MATRIX_PATTERN, module):
            shape = ckpt.entries[name].shape
            if len(shape) != 2 or shape[-1] % BLOCK_SIZE:
                raise CheckpointFormatError(
                    f"{ckpt.where(name)}: shape {list(shape)}: MXFP4 needs a matrix whose input dimension is a "
                    f"multiple of {BLOCK_SIZE}"
                )
    if LM_HEAD + ".weight" not in ckpt.entries:
        raise CheckpointFormatError(f"{ckpt.root}: tensor {LM_HEAD}.weight is missing")


def _mlp_units(geo: Geometry, i: int, ckpt: Checkpoint, x: torch.Tensor) -> tuple[list[_Unit], list[_Unit]]:
    """(units seeing every token: the dense MLP or the shared expert; the routed experts) of layer i."""
    p = layer_prefix(i) + "mlp."
    if not geo.is_moe(i):
        return [_Unit(p, None, None)], []
    ids, weights = route(geo, x, ckpt.get(p + "router.gate.weight"), ckpt.get(p + "expert_bias"))
    shared = [_Unit(p + "shared_experts.", None, None)] if geo.num_shared else []
    routed = []
    for e in range(geo.num_experts):
        tok, k = (ids == e).nonzero(as_tuple=True)
        routed.append(_Unit(f"{p}experts.{e}.", tok, weights[tok, k]))
    return shared, routed


@torch.no_grad()
def quantize(
    src_dir: str | Path,
    dst_dir: str | Path,
    *,
    calib: str | Path | torch.Tensor,
    calib_tokens: int = 262144,
    seq_len: int = 2048,
    options: QuantizeOptions = QuantizeOptions(),
    lm_head: bool = True,
    shard_bytes: int = SHARD_BYTES,
    progress: bool = True,
) -> QuantizeReport:
    """Write the packed (MXFP4 + bias, FP8 head) checkpoint of an unquantized AFMoE / MLA-Trinity checkpoint."""
    opts = options
    run = ToolRun("quantize", src_dir, dst_dir, _check_source, calib, calib_tokens, seq_len, shard_bytes, progress)
    with run:
        ckpt, geo, writer = run.ckpt, run.geo, run.writer
        report = QuantizeReport(dst=run.dst, calib_tokens=run.tokens.numel())
        for name in ckpt.entries:
            if name.startswith("model.layers."):
                continue
            if lm_head and name == LM_HEAD + ".weight":
                write_fp8_lm_head(writer, ckpt.get(name), ckpt.where(name))
                report.fp8.append(LM_HEAD)
            else:
                writer.add(name, ckpt.get(name))
        h = run.hidden_states()
        for i in run.layers(report):
            p = layer_prefix(i)
            w = attention_weights(ckpt, geo, i)
            h = attention_residual(geo, i, w, h)
            x = rms_norm(h.view(-1, geo.hidden), w["pre_mlp_layernorm"], geo.eps)
            layer = _Layer(ckpt, writer, opts, report, x)
            full, routed = _mlp_units(geo, i, ckpt, x)
            layer.run(full, solve=opts.gptq)
            if routed:
                report.expert_tokens[i] = [int(u.tok.numel()) for u in routed]
            for by_gptq in (True, False):
                # An expert no calibration token reached has no Hessian: RTN whatever the threshold.
                solvable = [opts.gptq and u.tok.numel() >= max(opts.rtn_threshold, 1) for u in routed]
                group = [u for u, ok in zip(routed, solvable) if ok == by_gptq]
                step = max(1, opts.expert_batch)
                for b0 in range(0, len(group), step):
                    layer.run(group[b0 : b0 + step], solve=by_gptq)
            if opts.measure:
                ref = mlp_forward(geo, i, ckpt, x)
                report.layer_error[i] = float((layer.out - ref).pow(2).mean() / ref.pow(2).mean().clamp(min=1e-30))
                run.bar.set_postfix(layer=i, mlp_err=f"{report.layer_error[i]:.2e}")
            h = h + rms_norm(layer.out, w["post_mlp_layernorm"], geo.eps).view(h.shape)
            quantized = {n for n in ckpt.names(p) if re.fullmatch(DEFAULT_MATRIX_PATTERN, n.removesuffix(".weight"))}
            for name in ckpt.names(p):
                if name not in quantized:
                    writer.add(name, ckpt.get(name))
            del layer, x, w
        qc = quantization_config([f"re:^(?:{DEFAULT_MATRIX_PATTERN})$"], fp8_lm_head=bool(report.fp8))
        run.finish(report, {**ckpt.config, "quantization_config": qc})
    return report
