"""Plain-torch AFMoE / MLA-Trinity decoder layers: the calibration forward of the checkpoint tools.

`vllm-trn convert-mla` and `vllm-trn quantize` run the model one decoder layer at a time over the
calibration sequences, each layer's weights read from the checkpoint just before and dropped just
after, so that every layer sees the hidden states the already-converted (or already-quantized)
layers before it produce. The math is transformers' `AfmoeForCausalLM` (models/afmoe), in float32:

- embeddings x sqrt(hidden) (muP); per layer, sandwich norms:
  h = h + post_attention_norm(attn(input_norm(h))), h = h + post_mlp_norm(mlp(pre_mlp_norm(h)));
- attention: q = q_norm(q_proj x) per head, k = k_norm(k_proj x) (or, on an MLA layer,
  k_norm(W_k kv_a_proj x) with [W_k; W_v] = kv_b_proj), v = v_proj x (or W_v kv_a_proj x); RoPE
  (neox halves, positions 0..L-1) and a sliding window (key j visible from query i iff
  i - W < j <= i) on sliding layers only; softmax(q k^T / sqrt(head_dim)) v; output gate
  o * sigmoid(gate_proj x); o_proj;
- MLP: down(silu(gate x) * up x); MoE: sigmoid router scores, top-k of scores + expert_bias,
  the chosen scores renormalised and x route_scale, plus the unscaled shared expert.

`ToolRun` is the frame both tools share: the source read lazily (`loaders/io.Checkpoint`), its geometry, the
calibration tokens, the destination's shard writer, per-layer time, memory and progress.
`tests/test_convert_mla.py` checks this forward against transformers' model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vllm_trn_plugin.loaders.io import (
    SHARD_BYTES,
    Checkpoint,
    ShardWriter,
    StagedCheckpoint,
    copy_side_files,
    write_config,
)
from vllm_trn_plugin.tools.calibration import load_calibration

__all__ = [
    "Geometry",
    "LayerMeter",
    "Linear",
    "MLP_CHUNK_TOKENS",
    "ToolReport",
    "ToolRun",
    "attention",
    "attention_residual",
    "attention_weights",
    "embed",
    "kv_projection",
    "layer_prefix",
    "mlp_dense",
    "mlp_forward",
    "mlp_residual",
    "rms_norm",
    "route",
]

Linear = Callable[[torch.Tensor], torch.Tensor]
ATTENTION_CHUNK_TOKENS = 8192  # sequences per attention call: bounds the [tokens, heads x head_dim] temporaries
MLP_CHUNK_TOKENS = 16384  # tokens per MLP call: bounds the [tokens, intermediate] temporaries


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


class LayerMeter:
    """Wall time and peak resident memory of one layer's work (Linux: VmHWM, reset through /proc/self/clear_refs;
    elsewhere the peak is 0)."""

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the peak RSS to the current RSS
        except OSError:
            pass
        self.t0 = time.perf_counter()

    def stop(self) -> tuple[float, int]:
        seconds = time.perf_counter() - self.t0
        try:
            with open("/proc/self/status") as f:
                peak = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM")), 0)
        except OSError:
            peak = 0
        return seconds, peak


@dataclass(frozen=True)
class Geometry:
    """The AfmoeConfig fields the layer forward needs, from config.json through transformers' `AfmoeConfig` (which
    derives `layer_types`, the rope parameters and the defaults) and checked."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_dense_layers: int
    num_experts: int
    top_k: int
    route_scale: float
    eps: float
    rope_theta: float
    sliding_window: int | None
    mup: bool
    intermediate: int
    moe_intermediate: int
    num_shared: int
    vocab: int
    kv_lora_rank: int | None

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_full(self, i: int) -> bool:
        return self.layer_types[i] == "full_attention"

    def is_moe(self, i: int) -> bool:
        return i >= self.num_dense_layers

    @classmethod
    def from_config(cls, cfg: dict[str, Any], where: str) -> Geometry:
        """`cfg`: config.json's contents; `where` (the config file) prefixes every error."""
        from huggingface_hub.errors import StrictDataclassError
        from transformers import AfmoeConfig

        if cfg.get("model_type") != "afmoe":
            raise ValueError(
                f"{where}: model_type {cfg.get('model_type')!r}: the checkpoint tools take AFMoE (Trinity)"
            )
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
            if cfg.get(key) is None:
                raise ValueError(f"{where}: field {key!r} is missing")
        try:
            c = AfmoeConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        except (StrictDataclassError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a valid AfmoeConfig: {e}") from e
        n_layers = c.num_hidden_layers
        if len(c.layer_types) != n_layers or not set(c.layer_types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(f"{where}: field 'layer_types' must list {n_layers} sliding_attention/full_attention")
        rope = c.rope_parameters or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"{where}: field 'rope_parameters': rope_type {rope['rope_type']!r} is not supported (default)"
            )
        if rope.get("rope_theta") is None:
            raise ValueError(f"{where}: field 'rope_parameters.rope_theta' is missing")
        if c.hidden_act != "silu":
            raise ValueError(f"{where}: field 'hidden_act' is {c.hidden_act!r}; AFMoE uses silu")
        # transformers' router is fixed to these; a checkpoint asking for another one is not this model.
        for key, value in {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1}.items():
            if key in cfg and cfg[key] != value:
                raise ValueError(f"{where}: field {key!r} is {cfg[key]!r}; only {value!r} is implemented")
        rank = cfg.get("kv_lora_rank")
        return cls(
            hidden=c.hidden_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim or c.hidden_size // c.num_attention_heads,
            num_layers=n_layers,
            layer_types=tuple(c.layer_types),
            num_dense_layers=c.num_dense_layers or 0,
            num_experts=c.num_experts or 0,
            top_k=c.num_experts_per_tok or 0,
            route_scale=float(c.route_scale if c.route_scale is not None else 1.0),
            eps=float(c.rms_norm_eps),
            rope_theta=float(rope["rope_theta"]),
            sliding_window=c.sliding_window,
            mup=bool(c.mup_enabled),
            intermediate=c.intermediate_size,
            moe_intermediate=c.moe_intermediate_size,
            num_shared=c.num_shared_experts or 0,
            vocab=c.vocab_size,
            kv_lora_rank=None if rank is None else int(rank),
        )


@dataclass(kw_only=True)
class ToolReport:
    """What every tool run reports."""

    dst: Path
    calib_tokens: int
    shards: list[str] = field(default_factory=list)
    layer_seconds: dict[int, float] = field(default_factory=dict)  # per layer: its fit, calibration forward, ...
    layer_peak_rss: dict[int, int] = field(default_factory=dict)  # bytes, the process's peak during the layer
    seconds: float = 0.0


class ToolRun:
    """One run of checkpoint tool `desc` from `src` to `dst` (a context manager): opens the source lazily, reads its
    geometry, runs `check(ckpt, geo)`, loads the calibration tokens (`calib`, `calib_tokens`, `seq_len`: see
    `load_calibration`) and stages the destination (`StagedCheckpoint`: `dst` absent or empty), in that order, so that
    every refusal comes before anything is written. `writer` writes into the staging directory `out`. `layers` walks the
    decoder layers measuring each (and shows progress when `progress`); `finish` writes the last shard (shards of
    `shard_bytes`), config.json and the side files (tokenizer etc.) and puts the checkpoint in place at `dst`. Leaving
    the context without `finish` (an exception, Ctrl-C) removes the staging directory: `dst` is never half written."""

    def __init__(
        self,
        desc: str,
        src: str | Path,
        dst: str | Path,
        check: Callable[[Checkpoint, Geometry], None],
        calib: str | Path | torch.Tensor,
        calib_tokens: int,
        seq_len: int,
        shard_bytes: int = SHARD_BYTES,
        progress: bool = True,
    ) -> None:
        from tqdm.auto import tqdm

        self.t0 = time.perf_counter()
        self.src, self.dst = Path(src), Path(dst)
        self.ckpt = Checkpoint(self.src)
        staged: StagedCheckpoint | None = None
        try:
            self.geo = Geometry.from_config(self.ckpt.config, str(self.ckpt.config_path))
            check(self.ckpt, self.geo)
            self.tokens = load_calibration(
                calib, tokenizer_dir=self.src, num_tokens=calib_tokens, seq_len=seq_len, vocab_size=self.geo.vocab
            )
            staged = StagedCheckpoint(self.dst, self.src)
            self.out = staged.open()  # where this run writes until `finish` renames it to `dst`
            self.writer = ShardWriter(self.out, shard_bytes)
            self.bar = tqdm(total=self.geo.num_layers, desc=desc, unit="layer", disable=not progress)
        except BaseException:
            if staged is not None:
                staged.discard()
            self.ckpt.close()
            raise
        self.staged = staged

    def hidden_states(self) -> torch.Tensor:
        """The calibration hidden states at the first layer's input [sequences, length, hidden], float32."""
        return embed(self.geo, self.ckpt, self.tokens)

    def layers(self, report: ToolReport) -> Iterator[int]:
        """0 .. num_layers - 1; each layer's wall time and peak memory land in `report`."""
        for i in range(self.geo.num_layers):
            meter = LayerMeter()
            yield i
            report.layer_seconds[i], report.layer_peak_rss[i] = meter.stop()
            self.bar.update(1)

    def finish(self, report: ToolReport, config: dict[str, Any]) -> None:
        report.shards = self.writer.finish()
        write_config(self.out, config)
        copy_side_files(self.src, self.out)
        self.staged.commit()
        report.seconds = time.perf_counter() - self.t0

    def __enter__(self) -> ToolRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.staged.discard()  # nothing once `finish` has committed
        self.bar.close()
        self.ckpt.close()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, L, heads, d]; neox style: the two halves of each head rotate together."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos[:, None] + rotated * sin[:, None]


def _rope_tables(length: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(length, dtype=torch.float)[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


def attention(
    geo: Geometry,
    i: int,
    w: dict[str, torch.Tensor],
    x: torch.Tensor,
    kv: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Gated attention of layer i over sequences x [B, L, hidden] (the input norm already applied).

    `w` holds float32 q_proj, gate_proj, o_proj, q_norm, k_norm weights (short names); `kv(x)` returns
    the unnormalised keys and values [..., kv_width] (k_proj/v_proj, or the latent's up-projection).
    """
    B, L = x.shape[:2]
    H, Hkv, hd = geo.num_heads, geo.num_kv_heads, geo.head_dim
    q = rms_norm((x @ w["q_proj"].T).view(B, L, H, hd), w["q_norm"], geo.eps)
    k, v = kv(x)
    k = rms_norm(k.reshape(B, L, Hkv, hd), w["k_norm"], geo.eps)
    v = v.reshape(B, L, Hkv, hd)
    pos = torch.arange(L)
    mask = pos[None, :] <= pos[:, None]
    if not geo.is_full(i):
        cos, sin = _rope_tables(L, hd, geo.rope_theta)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if geo.sliding_window:
            mask &= pos[None, :] > pos[:, None] - geo.sliding_window
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=hd**-0.5, enable_gqa=True
    )
    o = o.transpose(1, 2).reshape(B, L, H * hd) * torch.sigmoid(x @ w["gate_proj"].T)
    return o @ w["o_proj"].T


def mlp_dense(x: torch.Tensor, gate: Linear, up: Linear, down: Linear) -> torch.Tensor:
    """down(silu(gate x) * up x), MLP_CHUNK_TOKENS rows of x at a time."""
    if x.shape[0] <= MLP_CHUNK_TOKENS:
        return down(F.silu(gate(x)) * up(x))
    return torch.cat([mlp_dense(c, gate, up, down) for c in x.split(MLP_CHUNK_TOKENS)])


def route(
    geo: Geometry, x: torch.Tensor, router: torch.Tensor, expert_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k expert ids [N, k], their weights [N, k]) for MoE inputs x [N, hidden] (router in float32)."""
    scores = torch.sigmoid(x.float() @ router.float().T)
    _, ids = torch.topk(scores + expert_bias.float(), k=geo.top_k, dim=1)
    top = scores.gather(1, ids)
    return ids, top / (top.sum(-1, keepdim=True) + 1e-20) * geo.route_scale


def attention_weights(ckpt: Checkpoint, geo: Geometry, i: int) -> dict[str, torch.Tensor]:
    """Layer i's attention and norm weights in float32 under short names (k/v or the latent pair by layer kind)."""
    p, D, H, hd = layer_prefix(i), geo.hidden, geo.num_heads, geo.head_dim
    shapes = {
        "input_layernorm": (D,),
        "post_attention_layernorm": (D,),
        "pre_mlp_layernorm": (D,),
        "post_mlp_layernorm": (D,),
        "self_attn.q_proj": (H * hd, D),
        "self_attn.gate_proj": (H * hd, D),
        "self_attn.o_proj": (D, H * hd),
        "self_attn.q_norm": (hd,),
        "self_attn.k_norm": (hd,),
    }
    if geo.is_full(i) and geo.kv_lora_rank is not None:
        shapes["self_attn.kv_a_proj"] = (geo.kv_lora_rank, D)
        shapes["self_attn.kv_b_proj"] = (2 * geo.kv_width, geo.kv_lora_rank)
    else:
        shapes["self_attn.k_proj"] = (geo.kv_width, D)
        shapes["self_attn.v_proj"] = (geo.kv_width, D)
    return {k.removeprefix("self_attn."): ckpt.f32(p + k + ".weight", s) for k, s in shapes.items()}


def kv_projection(
    geo: Geometry, w: dict[str, torch.Tensor]
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """x -> (keys, values) [L, kv_width] before the key norm: k_proj/v_proj, or kv_b_proj(kv_a_proj x)."""
    if "kv_a_proj" in w:
        a, b = w["kv_a_proj"], w["kv_b_proj"]
        return lambda x: (x @ a.T @ b.T).split(geo.kv_width, -1)
    return lambda x: (x @ w["k_proj"].T, x @ w["v_proj"].T)


def attention_residual(
    geo: Geometry, i: int, w: dict[str, torch.Tensor], h: torch.Tensor, kv: Callable | None = None
) -> torch.Tensor:
    """h [S, L, hidden] -> h + post_attention_norm(attn(input_norm(h))), a few sequences at a time."""
    kv = kv or kv_projection(geo, w)
    out = torch.empty_like(h)
    step = max(1, ATTENTION_CHUNK_TOKENS // h.shape[1])
    for s in range(0, h.shape[0], step):
        x = rms_norm(h[s : s + step], w["input_layernorm"], geo.eps)
        out[s : s + step] = h[s : s + step] + rms_norm(
            attention(geo, i, w, x, kv), w["post_attention_layernorm"], geo.eps
        )
    return out


def _plain(weight: torch.Tensor) -> Linear:
    return lambda x: x @ weight.float().T


def mlp_forward(geo: Geometry, i: int, ckpt: Checkpoint, x: torch.Tensor) -> torch.Tensor:
    """Layer i's unquantized MLP or MoE on x [N, hidden] (the pre-MLP norm already applied), float32."""
    p = layer_prefix(i) + "mlp."

    def dense(prefix: str) -> torch.Tensor:
        return mlp_dense(x, *(_plain(ckpt.get(f"{prefix}{m}.weight")) for m in ("gate_proj", "up_proj", "down_proj")))

    if not geo.is_moe(i):
        return dense(p)
    ids, weights = route(geo, x, ckpt.get(p + "router.gate.weight"), ckpt.get(p + "expert_bias"))
    out = dense(p + "shared_experts.") if geo.num_shared else torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, k = (ids == e).nonzero(as_tuple=True)
        mats = (_plain(ckpt.get(f"{p}experts.{e}.{m}.weight")) for m in ("gate_proj", "up_proj", "down_proj"))
        out.index_add_(0, tok, mlp_dense(x[tok], *mats) * weights[tok, k, None])
    return out


def mlp_residual(geo: Geometry, i: int, w: dict[str, torch.Tensor], h: torch.Tensor, mlp: Callable) -> torch.Tensor:
    """h [S, L, hidden] -> h + post_mlp_norm(mlp(pre_mlp_norm(h))), all tokens at once."""
    x = rms_norm(h.reshape(-1, geo.hidden), w["pre_mlp_layernorm"], geo.eps)
    return h + rms_norm(mlp(x), w["post_mlp_layernorm"], geo.eps).view(h.shape)


def embed(geo: Geometry, ckpt: Checkpoint, tokens: torch.Tensor) -> torch.Tensor:
    """Calibration hidden states [S, L, hidden] float32 at the first layer's input (muP scale applied)."""
    table = ckpt.get("model.embed_tokens.weight", (geo.vocab, geo.hidden))
    h = table[tokens].float()
    return h * geo.hidden**0.5 if geo.mup else h
