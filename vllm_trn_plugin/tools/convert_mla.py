"""`vllm-trn convert-mla`: AFMoE (Trinity) -> MLA-Trinity by a whitened joint SVD and a least-squares refit.

On every full-attention layer, `k_proj` and `v_proj` (each [kv, hidden], kv = Hkv x head_dim) become
`kv_a_proj` [r, hidden] (the cached latent) and `kv_b_proj` [2 kv, r] (keys of KV heads 0..Hkv-1,
then values), fitted to that layer's real inputs X (the input-normed hidden states of the
calibration tokens, produced by the already-converted layers before it):

1. Whitening. C = X^T X / N is the inputs' second moment; an error E in the projection costs
   E[||E x||^2] = ||E C^1/2||_F^2 on this data, so the rank-r factorisation that minimises output
   error is the SVD of W C^1/2, not of W. With damping (C_d = C + damp * mean(diag C) * I, so that
   directions the calibration never exercised are not amplified) and S = C_d^1/2 (symmetric):
2. Joint SVD of the stacked target W~ = [D_k W_k; W_v] S = U Sigma V^T, where D_k scales each KV
   head's key rows by 1 / rms of its keys on X: the kept key norm divides every key by its rms, so
   key errors count in the units the model will see. kv_a_proj = V_r^T S^-1: the latent's
   coordinates are decorrelated and of unit variance on the calibration data (good for a bf16 or
   FP8 cache).
3. Least-squares refit of kv_b_proj given the latent as stored (kv_a_proj rounded to the checkpoint
   dtype), on the undamped statistics: values B_v = W_v C A^T (A C A^T)^-1; keys per KV head h with
   each token weighted by 1 / ms(k_h) (the key norm divides that token's key error by rms(k_h)):
   B_k,h = W_k,h C_h A^T (A C_h A^T)^-1, C_h = sum_n x_n x_n^T / (N ms(k_n,h)).
   The per-head key RMSNorm (`k_norm`) is kept unchanged: served keys are k_norm(B_k,h c).

At exact rank (r = rank of [W_k; W_v], at most min(2 kv, hidden)) the factorisation reproduces W,
so the converted model computes the original's logits. The tool streams: one layer's tensors are
read (safetensors, lazily) and written (shards of `shard_bytes`) at a time; the calibration hidden
states [tokens, hidden] float32 are the only thing that stays in memory. Layers after the last
full-attention layer are copied without running them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_trn_plugin.loaders.io import SHARD_BYTES, Checkpoint, CheckpointFormatError
from vllm_trn_plugin.tools.afmoe_forward import (
    Geometry,
    ToolReport,
    ToolRun,
    attention_residual,
    attention_weights,
    kv_projection,
    layer_prefix,
    mlp_forward,
    mlp_residual,
    rms_norm,
)

__all__ = ["ConvertReport", "LatentFit", "convert_mla", "fit_latent", "max_latent"]

DEFAULT_DAMP = 0.01
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


@dataclass
class LatentFit:
    """One layer's factorisation and its error on the calibration data (relative mean-square, float64)."""

    layer: int
    kv_a: torch.Tensor  # [r, hidden], checkpoint dtype
    kv_b: torch.Tensor  # [2 kv, r]
    energy_kept: float  # fraction of the whitened target's energy in the top r singular values
    key_error: float  # sum_h E[||k_h - k'_h||^2 / ms(k_h)] / sum_h E[||k_h||^2 / ms(k_h)]: normalised keys
    value_error: float  # E||v - v'||^2 / E||v||^2


@dataclass(kw_only=True)
class ConvertReport(ToolReport):
    latent: int
    layers: list[LatentFit] = field(default_factory=list)


def max_latent(geo: Geometry) -> int:
    """The largest rank [k_proj; v_proj] can have: min(2 x Hkv x head_dim, hidden)."""
    return min(2 * geo.kv_width, geo.hidden)


class _Stats:
    """Running second moments of one layer's attention inputs: C and the key-norm-weighted C_h per KV head."""

    def __init__(self, geo: Geometry, w_k: torch.Tensor) -> None:
        D = geo.hidden
        self.geo, self.w_k = geo, w_k
        self.n = 0
        self.c = torch.zeros(D, D, dtype=torch.float64)
        self.c_h = torch.zeros(geo.num_kv_heads, D, D, dtype=torch.float64)
        self.ms_sum = torch.zeros(geo.num_kv_heads, dtype=torch.float64)

    def add(self, x: torch.Tensor) -> None:
        """x [L, hidden] float32."""
        geo = self.geo
        self.n += x.shape[0]
        self.c += (x.T @ x).double()
        ms = (x @ self.w_k.T).view(-1, geo.num_kv_heads, geo.head_dim).pow(2).mean(-1) + geo.eps  # [L, Hkv]
        self.ms_sum += ms.double().sum(0)
        for h in range(geo.num_kv_heads):
            xw = x * ms[:, h : h + 1].rsqrt()
            self.c_h[h] += (xw.T @ xw).double()


def _sym_solve(g: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """rhs @ g^-1 for symmetric positive (semi)definite g, with a relative ridge for latents the data never spans."""
    ridge = 1e-12 * float(torch.diagonal(g).mean().clamp(min=1e-300))
    eye = torch.eye(g.shape[0], dtype=g.dtype)
    return torch.linalg.solve(g + ridge * eye, rhs.T).T


def fit_latent(
    geo: Geometry,
    layer: int,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    stats: _Stats,
    r: int,
    *,
    damp: float = DEFAULT_DAMP,
    dtype: torch.dtype = torch.float32,
) -> LatentFit:
    """Whitened joint SVD + least-squares refit (module docstring, steps 1-3) from accumulated statistics."""
    Hkv, hd, kv = geo.num_kv_heads, geo.head_dim, geo.kv_width
    n = max(stats.n, 1)
    c = stats.c / n
    c_h = stats.c_h / n
    wk, wv = w_k.double(), w_v.double()

    c_d = c + damp * float(torch.diagonal(c).mean()) * torch.eye(c.shape[0], dtype=c.dtype)
    lam, q = torch.linalg.eigh(c_d)
    lam = lam.clamp(min=float(lam.max()) * 1e-12)
    s = (q * lam.sqrt()) @ q.T
    s_inv = (q * lam.rsqrt()) @ q.T

    key_rms = (stats.ms_sum / n).sqrt()  # [Hkv]
    target = torch.cat([(wk.view(Hkv, hd, -1) / key_rms[:, None, None]).reshape(kv, -1), wv]) @ s
    _, sigma, vh = torch.linalg.svd(target, full_matrices=False)
    energy = float(sigma[:r].pow(2).sum() / sigma.pow(2).sum().clamp(min=1e-300))
    kv_a = (vh[:r] @ s_inv).to(dtype)
    a = kv_a.double()

    b_v = _sym_solve(a @ c @ a.T, wv @ c @ a.T)
    b_k = torch.empty(kv, r, dtype=torch.float64)
    key_num = key_den = 0.0
    for h in range(Hkv):
        rows = slice(h * hd, (h + 1) * hd)
        b_k[rows] = _sym_solve(a @ c_h[h] @ a.T, wk[rows] @ c_h[h] @ a.T)
        err = wk[rows] - b_k[rows] @ a
        key_num += float(torch.trace(err @ c_h[h] @ err.T))
        key_den += float(torch.trace(wk[rows] @ c_h[h] @ wk[rows].T))
    kv_b = torch.cat([b_k, b_v]).to(dtype)
    err_v = wv - kv_b[kv:].double() @ a
    value_error = float(torch.trace(err_v @ c @ err_v.T) / torch.trace(wv @ c @ wv.T).clamp(min=1e-300))
    return LatentFit(layer, kv_a, kv_b, energy, key_num / max(key_den, 1e-300), value_error)


def _check_source(ckpt: Checkpoint, geo: Geometry, latent: int) -> None:
    where = str(ckpt.config_path)
    if geo.kv_lora_rank is not None:
        raise ValueError(f"{where}: field 'kv_lora_rank' is already set: this checkpoint is MLA-Trinity already")
    if ckpt.config.get("quantization_config"):
        raise ValueError(f"{where}: field 'quantization_config' is set: convert the unquantized checkpoint")
    full = [i for i in range(geo.num_layers) if geo.is_full(i)]
    if not full:
        raise ValueError(f"{where}: field 'layer_types' has no full_attention layer to convert")
    top = max_latent(geo)
    if not 1 <= latent <= top:
        raise ValueError(
            f"--latent {latent}: must be in [1, {top}], the largest rank [k_proj; v_proj] can have "
            f"(min(2 x {geo.num_kv_heads} KV heads x {geo.head_dim}, hidden {geo.hidden}))"
        )
    shapes = {}
    for i in full:
        p = layer_prefix(i) + "self_attn."
        for m in ("k_proj", "v_proj"):
            shapes[f"{p}{m}.weight"] = (geo.kv_width, geo.hidden)
            if f"{p}{m}.bias" in ckpt.entries:
                raise CheckpointFormatError(f"{ckpt.where(p + m + '.bias')}: biases have no place in the MLA format")
    ckpt.require(list(shapes), shapes)
    ckpt.require(["model.embed_tokens.weight"], {"model.embed_tokens.weight": (geo.vocab, geo.hidden)})


@torch.no_grad()
def convert_mla(
    src_dir: str | Path,
    dst_dir: str | Path,
    *,
    latent: int,
    calib: str | Path | torch.Tensor,
    calib_tokens: int = 65536,
    seq_len: int = 2048,
    damp: float = DEFAULT_DAMP,
    shard_bytes: int = SHARD_BYTES,
    progress: bool = True,
) -> ConvertReport:
    """Write the MLA-Trinity checkpoint of an AFMoE checkpoint (module docstring for the math).

    `calib`: a calibration file (see `calibration.load_calibration`) or token ids [S, L] already cut.
    Every other tensor is copied unchanged; config.json gains `kv_lora_rank` and
    `architectures: ["TrinityMLAForCausalLM"]`; tokenizer files are copied.
    """
    check = functools.partial(_check_source, latent=latent)
    run = ToolRun("convert-mla", src_dir, dst_dir, check, calib, calib_tokens, seq_len, shard_bytes, progress)
    with run:
        ckpt, geo, writer = run.ckpt, run.geo, run.writer
        report = ConvertReport(dst=run.dst, latent=latent, calib_tokens=run.tokens.numel())
        for name in ckpt.entries:
            if not name.startswith("model.layers."):
                writer.add(name, ckpt.get(name))
        h = run.hidden_states()
        last_full = max(i for i in range(geo.num_layers) if geo.is_full(i))
        for i in run.layers(report):
            p = layer_prefix(i)
            skip: set[str] = set()
            if geo.is_full(i):
                w = attention_weights(ckpt, geo, i)
                w_k, w_v = w.pop("k_proj"), w.pop("v_proj")
                stats = _Stats(geo, w_k)
                for s in range(h.shape[0]):
                    stats.add(rms_norm(h[s], w["input_layernorm"], geo.eps))
                dtype = _DTYPES.get(ckpt.entries[p + "self_attn.k_proj.weight"].dtype, torch.float32)
                fit = fit_latent(geo, i, w_k, w_v, stats, latent, damp=damp, dtype=dtype)
                report.layers.append(fit)
                writer.add(p + "self_attn.kv_a_proj.weight", fit.kv_a)
                writer.add(p + "self_attn.kv_b_proj.weight", fit.kv_b)
                skip = {p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"}
                w["kv_a_proj"], w["kv_b_proj"] = fit.kv_a.float(), fit.kv_b.float()
                run.bar.set_postfix(layer=i, key_err=f"{fit.key_error:.2e}", value_err=f"{fit.value_error:.2e}")
            for name in ckpt.names(p):
                if name not in skip:
                    writer.add(name, ckpt.get(name))
            if i < last_full:
                if not geo.is_full(i):
                    w = attention_weights(ckpt, geo, i)
                h = attention_residual(geo, i, w, h, kv_projection(geo, w))
                h = mlp_residual(geo, i, w, h, lambda x, i=i: mlp_forward(geo, i, ckpt, x))
        mla = {"architectures": ["TrinityMLAForCausalLM"], "model_type": "afmoe", "kv_lora_rank": latent}
        run.finish(report, {**ckpt.config, **mla})
    return report
