"""Small random AFMoE (Trinity) checkpoints, their exact MLA-Trinity conversion, and a transformers reference.

- `make_random_afmoe` writes a random float32 `AfmoeForCausalLM` with Trinity-Mini's real attention geometry
  (head_dim 128, 32 query heads, 4 KV heads, [sliding x3, full] layers, RoPE on sliding layers only, muP, sandwich
  norms, q/k RMSNorm, gated attention output) and a scaled-down MLP/MoE, plus the project's byte tokenizer.
- `convert_to_mla` turns such a checkpoint into the MLA-Trinity format of docs/models.md §3 by an SVD of
  `[k_proj; v_proj]` on the full-attention layers.
- `hf_greedy` runs transformers' `AfmoeForCausalLM` greedily; it is the reference for both formats (an MLA
  checkpoint is loaded with `k_proj`/`v_proj` rebuilt as `kv_b_proj @ kv_a_proj`, which is exactly what MLA
  computes).

Geometry choice: hidden 512 (q_proj 512 -> 4096). `[k_proj; v_proj]` is then 1024 x 512, so its rank is at most
512 and the exact-rank latent is `min(2 * num_key_value_heads * head_dim, hidden_size)` = 512 wide, not 1024. For a
narrower exact latent (the real model's 256), build the checkpoint with `make_random_afmoe(..., full_kv_rank=256)`:
the full layers' `[k_proj; v_proj]` then has rank 256 by construction and `convert_to_mla(..., kv_lora_rank=256)`
is exact.

Config keys only vLLM reads (`score_func`, `route_norm`, `n_group`, `topk_group`) are written with the values
transformers hard-codes (sigmoid scores, renormalised top-k, one expert group), so both implementations compute
the same router.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.references import read_safetensors_dir

AFMOE_SMALL: dict[str, Any] = dict(
    vocab_size=259,  # the byte tokenizer: 256 bytes + 3 special tokens
    hidden_size=512,
    intermediate_size=1024,  # the dense first layer
    moe_intermediate_size=128,
    num_hidden_layers=4,  # layer_types: sliding, sliding, sliding, full (global_attn_every_n_layers=4)
    num_dense_layers=1,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    num_experts=8,
    num_experts_per_tok=2,
    num_shared_experts=1,
    route_scale=2.826,
    score_func="sigmoid",
    route_norm=True,
    n_group=1,
    topk_group=1,
    global_attn_every_n_layers=4,
    sliding_window=64,
    mup_enabled=True,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=None,
    eos_token_id=258,  # <|im_end|>
    pad_token_id=256,  # <|endoftext|>
)

LM_HEAD_STD = 3.0  # logits std ~3: greedy top-2 margins are rarely below 1e-3 nats
EXPERT_BIAS_STD = 0.1  # router scores sigmoid(N(0, 1)) have std ~0.2: the bias changes some selections
NORM_STD = 0.1  # every RMSNorm weight is 1 + 0.1 * randn


def _random_weights(model: torch.nn.Module, cfg: Any, seed: int, full_kv_rank: int | None) -> None:
    """Overwrite every parameter in place: unit-scale activations, non-trivial norms, nonzero expert bias."""
    g = torch.Generator().manual_seed(seed)
    hidden = cfg.hidden_size

    def randn(shape: torch.Size | tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).mul_(std).add_(mean).to(torch.float32)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # all RMSNorms, including q_norm / k_norm
                p.copy_(randn(p.shape, NORM_STD, 1.0))
            elif name.endswith("expert_bias"):
                p.copy_(randn(p.shape, EXPERT_BIAS_STD))
            elif name == "model.embed_tokens.weight":
                p.copy_(randn(p.shape, hidden**-0.5))  # x sqrt(hidden) by muP: unit-rms residual stream
            elif name == "lm_head.weight":
                p.copy_(randn(p.shape, LM_HEAD_STD * hidden**-0.5))
            elif p.dim() in (2, 3):  # Linear [out, in] and stacked experts [E, out, in]
                p.copy_(randn(p.shape, p.shape[-1] ** -0.5))
            else:
                raise ValueError(f"no init rule for {name} {tuple(p.shape)}")

        if full_kv_rank is not None:
            kv = cfg.num_key_value_heads * cfg.head_dim
            if not 0 < full_kv_rank <= min(2 * kv, hidden):
                raise ValueError(f"full_kv_rank={full_kv_rank} must be in [1, {min(2 * kv, hidden)}]")
            for i, kind in enumerate(cfg.layer_types):
                if kind != "full_attention":
                    continue
                attn = model.model.layers[i].self_attn
                # W = B A with var(W_ij) = r * (1/r) * (1/hidden): same scale as the full-rank layers.
                w = randn((2 * kv, full_kv_rank), full_kv_rank**-0.5) @ randn((full_kv_rank, hidden), hidden**-0.5)
                attn.k_proj.weight.copy_(w[:kv])
                attn.v_proj.weight.copy_(w[kv:])


def _check_router_keys(cfg: dict[str, Any]) -> None:
    """transformers' AFMoE router is fixed (sigmoid, renormalised, one group); vLLM reads these keys."""
    fixed = {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1}
    for key, value in fixed.items():
        if cfg.get(key) != value:
            raise ValueError(f"{key}={cfg.get(key)!r}: transformers' AfmoeForCausalLM only implements {value!r}")


def make_random_afmoe(out_dir: str | Path, seed: int = 0, *, full_kv_rank: int | None = None, **overrides: Any) -> Path:
    """Write a random float32 `AfmoeForCausalLM` checkpoint (config.json, model.safetensors, byte tokenizer).

    `overrides` replace entries of `AFMOE_SMALL` (AfmoeConfig keys). `full_kv_rank`, if given, makes
    `[k_proj; v_proj]` of every full-attention layer exactly that rank (so an MLA conversion at that
    `kv_lora_rank` is exact). Returns the directory.
    """
    from transformers import AfmoeConfig, AfmoeForCausalLM

    from vllm_trn_plugin.demo import write_byte_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    values = {**AFMOE_SMALL, **overrides}
    _check_router_keys(values)
    if values["vocab_size"] < 259:
        raise ValueError(f"vocab_size={values['vocab_size']}: the byte tokenizer needs at least 259")
    config = AfmoeConfig(**values)
    config.architectures = ["AfmoeForCausalLM"]
    model = AfmoeForCausalLM(config).to(torch.float32).eval()
    _random_weights(model, config, seed, full_kv_rank)
    model.save_pretrained(str(out))  # transformers 5 always writes safetensors
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg.update(architectures=["AfmoeForCausalLM"], model_type="afmoe", dtype="float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    write_byte_tokenizer(out)
    return out


def convert_to_mla(src_dir: str | Path, dst_dir: str | Path, kv_lora_rank: int | None = None) -> Path:
    """Convert an AFMoE checkpoint to MLA-Trinity (docs/models.md §3) by an SVD of `[k_proj; v_proj]` on full layers.

    W = [k_proj; v_proj] = U S Vh (float64); kv_b_proj = U[:, :r] * S[:r], kv_a_proj = Vh[:r]. The default
    r = min(2 * num_key_value_heads * head_dim, hidden_size) is W's largest possible rank, so the conversion
    is exact (kv_b_proj @ kv_a_proj == W up to rounding); a smaller r truncates. Every other tensor is copied
    unchanged; config.json gains `kv_lora_rank` and `architectures: ["TrinityMLAForCausalLM"]`. Returns dst_dir.
    """
    from safetensors.torch import save_file

    src, dst = Path(src_dir), Path(dst_dir)
    cfg = json.loads((src / "config.json").read_text())
    hidden, n_kv = cfg["hidden_size"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    kv = n_kv * head_dim
    max_rank = min(2 * kv, hidden)
    r = max_rank if kv_lora_rank is None else int(kv_lora_rank)
    if not 0 < r <= max_rank:
        raise ValueError(f"kv_lora_rank={r} must be in [1, {max_rank}] (= min(2 * Hkv * head_dim, hidden))")

    tensors = read_safetensors_dir(src)
    out: dict[str, torch.Tensor] = {}
    full = {i for i, kind in enumerate(cfg["layer_types"]) if kind == "full_attention"}
    for i in full:
        p = f"model.layers.{i}.self_attn."
        k, v = tensors.pop(p + "k_proj.weight"), tensors.pop(p + "v_proj.weight")
        if k.shape != (kv, hidden) or v.shape != (kv, hidden):
            raise ValueError(f"layer {i}: k_proj {tuple(k.shape)}, v_proj {tuple(v.shape)}; expected ({kv}, {hidden})")
        for bias in ("k_proj.bias", "v_proj.bias"):
            if p + bias in tensors:
                raise ValueError(f"layer {i}: {bias} has no place in the MLA format")
        w = torch.cat([k, v], 0).to(torch.float64)
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        out[p + "kv_a_proj.weight"] = vh[:r].to(k.dtype).contiguous()
        out[p + "kv_b_proj.weight"] = (u[:, :r] * s[:r]).to(k.dtype).contiguous()
    out.update(tensors)

    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in sorted(out.items())}, str(dst / "model.safetensors"), {"format": "pt"})
    cfg.update(architectures=["TrinityMLAForCausalLM"], model_type="afmoe", kv_lora_rank=r)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in src.iterdir():  # tokenizer files, chat template, generation_config.json
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model.safetensors"):
            shutil.copy2(f, dst / f.name)
    return dst


_MODELS: dict[str, Any] = {}


def clear_model_cache() -> None:
    _MODELS.clear()


def load_hf_model(model_dir: str | Path) -> Any:
    """transformers' AfmoeForCausalLM (float32, eager attention, eval) for an AFMoE or MLA-Trinity directory.

    An MLA-Trinity checkpoint is loaded with k_proj/v_proj = split(kv_b_proj @ kv_a_proj) on its latent layers
    (float64 product): the dense equivalent of the latent model. Cached per resolved directory.
    """
    from safetensors.torch import save_file
    from transformers import AfmoeForCausalLM

    key = str(Path(model_dir).resolve())
    if key in _MODELS:
        return _MODELS[key]
    cfg = json.loads((Path(key) / "config.json").read_text())
    if "kv_lora_rank" not in cfg:
        model = AfmoeForCausalLM.from_pretrained(key, dtype=torch.float32, attn_implementation="eager")
    else:
        kv = cfg["num_key_value_heads"] * (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        tensors = read_safetensors_dir(Path(key))
        for i, kind in enumerate(cfg["layer_types"]):
            if kind != "full_attention":
                continue
            p = f"model.layers.{i}.self_attn."
            a, b = tensors.pop(p + "kv_a_proj.weight"), tensors.pop(p + "kv_b_proj.weight")
            w = (b.to(torch.float64) @ a.to(torch.float64)).to(torch.float32)
            tensors[p + "k_proj.weight"], tensors[p + "v_proj.weight"] = w[:kv].contiguous(), w[kv:].contiguous()
        dense_cfg = {k: v for k, v in cfg.items() if k != "kv_lora_rank"}
        dense_cfg["architectures"] = ["AfmoeForCausalLM"]
        # Through a dense checkpoint on disk, so transformers maps the per-expert tensors as usual.
        with tempfile.TemporaryDirectory() as tmp:
            save_file(tensors, str(Path(tmp) / "model.safetensors"), {"format": "pt"})
            (Path(tmp) / "config.json").write_text(json.dumps(dense_cfg))
            model = AfmoeForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    _MODELS[key] = model
    return model


def _round_latent(latent: torch.Tensor, cache_dtype: str, scale: float | None = None) -> torch.Tensor:
    """Latents [..., r] (float64) as a latent cache of `cache_dtype` stores them: "fp8", Trainium2 FP8 with one scale
    per token (references.packed.fp8_activation), or with the one static `scale` given (references.packed.fp8_static);
    "bf16", bfloat16; "float64", unrounded."""
    from tests.references.packed import fp8_activation, fp8_static

    if cache_dtype == "bf16":
        return latent.to(torch.bfloat16).double()
    if cache_dtype == "float64":
        return latent
    if scale is not None:
        return fp8_static(latent, scale)
    return fp8_activation(latent.reshape(-1, latent.shape[-1])).reshape(latent.shape)


class _CachedLatentProjection(torch.nn.Module):
    """k_proj or v_proj of a latent layer as a latent cache of `cache_dtype` computes it: rows of kv_b_proj applied to
    the latent kv_a_proj x as the cache stores it, in float64. Keeps the exact latents of its last call (`latents`,
    before rounding)."""

    def __init__(self, kv_a: torch.Tensor, kv_b_rows: torch.Tensor, cache_dtype: str, scale: float | None) -> None:
        super().__init__()
        self.kv_a, self.kv_b_rows, self.cache_dtype, self.scale = kv_a.double(), kv_b_rows.double(), cache_dtype, scale
        self.latents: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.latents = x.double() @ self.kv_a.t()
        latent = _round_latent(self.latents, self.cache_dtype, self.scale)
        return (latent @ self.kv_b_rows.t()).to(x.dtype)


def cached_latent_model(
    mla_dir: str | Path, cache_dtype: str = "fp8", layer_scales: dict[int, float] | None = None
) -> Any:
    """transformers' AfmoeForCausalLM for an MLA-Trinity checkpoint, in float64, whose latent layers see their
    latents as a latent cache of `cache_dtype` ("fp8": one scale per token, or per layer from `layer_scales`, layer
    index -> static scale; "bf16"; "float64") stores them: a copy of `load_hf_model`'s model with those layers'
    k_proj / v_proj computed through the stored latent."""
    import copy

    cfg = json.loads((Path(mla_dir) / "config.json").read_text())
    tensors = read_safetensors_dir(Path(mla_dir))
    kv = cfg["num_key_value_heads"] * (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    model = copy.deepcopy(load_hf_model(mla_dir)).double()
    model.config._experts_implementation = "eager"  # transformers' grouped-GEMM experts take no float64
    for i, kind in enumerate(cfg["layer_types"]):
        if kind != "full_attention":
            continue
        p = f"model.layers.{i}.self_attn."
        a, b = tensors[p + "kv_a_proj.weight"], tensors[p + "kv_b_proj.weight"]
        attn = model.model.layers[i].self_attn
        scale = None if layer_scales is None else layer_scales[i]
        attn.k_proj = _CachedLatentProjection(a, b[:kv], cache_dtype, scale)
        attn.v_proj = _CachedLatentProjection(a, b[kv:], cache_dtype, scale)
    return model.eval()


@torch.no_grad()
def exact_latents(mla_dir: str | Path, tokens: list[int]) -> dict[int, torch.Tensor]:
    """Each latent layer's latents [len(tokens), r] (layer index -> float64, unrounded) for the prompt `tokens`."""
    model = cached_latent_model(mla_dir, "float64")
    model(input_ids=torch.tensor([tokens]))
    return {
        i: layer.self_attn.k_proj.latents[0]
        for i, layer in enumerate(model.model.layers)
        if isinstance(layer.self_attn.k_proj, _CachedLatentProjection)
    }


@torch.no_grad()
def teacher_forced_logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits [len(tokens), vocab] (float64) from which a model fed `prompt` then `tokens` (teacher forcing)
    predicts each of `tokens`."""
    ids = torch.tensor([prompt + tokens[:-1]])
    return model(input_ids=ids).logits[0, len(prompt) - 1 :].double()


@torch.no_grad()
def hf_greedy(model_dir: str | Path | torch.nn.Module, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy decoding with transformers' AfmoeForCausalLM (prefill, then one token at a time with a KV cache).

    `model_dir` is a checkpoint directory (see load_hf_model) or an already loaded model.

    Returns a dict with
      tokens: list[int], the max_tokens generated ids (EOS is not special: decoding never stops early);
      logprobs: list[float], log-softmax of each chosen token;
      margins: list[float], top-1 minus top-2 logit (= logprob) at each step;
      prefill_logits: float32 tensor [vocab], the logits at the last prompt position;
      step_logits: float32 tensor [max_tokens, vocab], the logits each token was chosen from.
    """
    model = model_dir if isinstance(model_dir, torch.nn.Module) else load_hf_model(model_dir)
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    past = out.past_key_values
    logits = out.logits[0, -1].float()
    steps: list[torch.Tensor] = []
    tokens: list[int] = []
    for step in range(max_tokens):
        steps.append(logits)
        tok = int(torch.argmax(logits))
        tokens.append(tok)
        if step + 1 == max_tokens:
            break
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    step_logits = torch.stack(steps)
    logp = torch.log_softmax(step_logits.double(), -1)
    top2 = torch.topk(step_logits, 2, dim=-1).values
    return {
        "tokens": tokens,
        "logprobs": [float(logp[i, t]) for i, t in enumerate(tokens)],
        "margins": (top2[:, 0] - top2[:, 1]).tolist(),
        "prefill_logits": step_logits[0].clone(),
        "step_logits": step_logits,
    }


def check_against_hf_greedy(out: Any, ref: dict[str, Any], what: str, logit_tol: float, worst: list[float]) -> None:
    """A vLLM RequestOutput (raw-logits mode, logprobs = the whole vocabulary) against `hf_greedy`'s `ref`: tokens
    equal (a divergence only after a near-tie: bench.ties), every step's logits within `logit_tol` up to
    and including the divergence; the largest difference seen is kept in worst[0]."""
    from vllm_trn_plugin.gate.ties import compare_greedy

    c = out.outputs[0]
    toks, steps, vocab = list(c.token_ids), len(ref["tokens"]), ref["step_logits"].shape[1]
    assert len(toks) == steps and len(c.logprobs) == steps, f"{what}: {len(toks)} tokens, expected {steps}"
    agree = compare_greedy(toks, ref["tokens"], ref["margins"])
    d = agree.step
    assert agree.ok, (
        f"{what}: step {d} gives {toks[d]}, transformers {ref['tokens'][d]} (margin {ref['margins'][d]:.2e})"
    )
    for step in range(steps if d is None else d + 1):
        got = torch.tensor([c.logprobs[step][i].logprob for i in range(vocab)], dtype=torch.float64)
        diff = (got - ref["step_logits"][step].double()).abs().max().item()
        worst[0] = max(worst[0], diff)
        assert diff < logit_tol, f"{what}: step {step} logits differ from transformers' by {diff:.2e}"


def trinity_geometry_pair(root: Path, seed: int, rank: int = 256) -> tuple[Path, Path]:
    """A random float32 AFMoE with Trinity-Mini's attention geometry (AFMOE_SMALL: 128-dim heads, 32 query / 4 KV,
    layers [S, S, S, F]; hidden 256, window 128) whose full-attention `[k_proj; v_proj]` is rank `rank` by
    construction, and its MLA conversion at that `kv_lora_rank` (exact): (original, converted)."""
    orig = make_random_afmoe(
        root / "orig", seed=seed, full_kv_rank=rank, hidden_size=256, intermediate_size=512, sliding_window=128
    )
    return orig, convert_to_mla(orig, root / "mla", kv_lora_rank=rank)
