"""Small random checkpoints in the pinned formats (docs/models.md §3), with an offline tokenizer.

Weights are random: a demo checkpoint proves the serving path, not language quality. The
geometry is a scaled-down copy of the real one (same tensor names, same head structure).
Besides the two served formats, `write_afmoe_demo` writes an original AFMoE checkpoint (the input
of `vllm-trn convert-mla`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from vllm_trn_plugin.configs import LaplaceConfig
from vllm_trn_plugin.loaders.io import ShardWriter, StagedCheckpoint, write_config

# ChatML. With `tools`, a system turn lists their signatures and asks for calls as `<tool_call>{"name": ...,
# "arguments": {...}}</tool_call>` (the Hermes format, read by vLLM's `hermes` tool parser); an assistant turn's
# tool calls are rendered back in that format and a tool result as a `tool` turn inside <tool_response>.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions. Their signatures, within <tools></tools>:\n<tools>\n' }}"
    "{% for tool in tools %}"
    "{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}{{ '\n' }}"
    "{% endfor %}"
    "{{ '</tools>\n\nFor each call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call>:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) %}"
    "{{ '<tool_call>\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' + args + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>tool\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

LAPLACE_DEMO = dict(
    vocab_size=259,  # the byte tokenizer: 256 bytes + 3 special tokens
    hidden_size=256,
    num_hidden_layers=4,
    num_heads=4,
    head_k_dim=32,
    head_v_dim=64,
    conv_size=4,
    intermediate_size=512,
    decay_t_min=1.0,
    decay_t_max=2048.0,
    num_decay_tiers=2,
    attn_scale=None,
    norm_eps=1e-5,
    head_norm_eps=1e-6,
    max_position_embeddings=131072,
)


def write_byte_tokenizer(out_dir: Path) -> None:
    """A byte-level tokenizer (ids 0-255 are the bytes, then the special tokens), ChatML template with tools."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def random_laplace_weights(config: LaplaceConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 tensors under the checkpoint names of docs/models.md §3."""
    g = torch.Generator().manual_seed(seed)
    D, H, dk, dv = config.hidden_size, config.num_heads, config.head_k_dim, config.head_v_dim
    F, V, W = config.intermediate_size, config.vocab_size, config.conv_size

    def randn(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std + mean

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(V, D, std=1.0)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        t[p + "attn_norm.weight"] = randn(D, std=0.1, mean=1.0)
        t[p + "attn_norm.bias"] = randn(D, std=0.1)
        t[p + "mixer.conv1d.weight"] = randn(D, 1, W, std=W**-0.5)
        t[p + "mixer.conv1d.bias"] = randn(D, std=0.1)
        t[p + "mixer.qkvg_proj.weight"] = randn(H * (2 * dk + 2 * dv), D, std=D**-0.5)
        t[p + "mixer.aug_balance"] = randn(H, dk, std=0.5)
        t[p + "mixer.head_norm.weight"] = randn(config.num_decay_tiers, dv, std=0.1, mean=1.0)
        t[p + "mixer.o_proj.weight"] = randn(D, H * dv, std=(H * dv) ** -0.5)
        t[p + "ffn_norm.weight"] = randn(D, std=0.1, mean=1.0)
        t[p + "ffn_norm.bias"] = randn(D, std=0.1)
        t[p + "mlp.gate_proj.weight"] = randn(F, D, std=D**-0.5)
        t[p + "mlp.up_proj.weight"] = randn(F, D, std=D**-0.5)
        t[p + "mlp.down_proj.weight"] = randn(D, F, std=F**-0.5)
    t["model.norm.weight"] = randn(D, std=0.1, mean=1.0)
    t["model.norm.bias"] = randn(D, std=0.1)
    # A peaked output distribution keeps greedy decoding away from near-ties.
    t["lm_head.weight"] = randn(V, D, std=4 * D**-0.5)
    return t


def _write_demo(
    out_dir: str | Path, config: Any, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Path:
    """config.json (the byte tokenizer's special ids), the tensors in `dtype` (streamed into shards of at most
    1 GiB) and the tokenizer, into `out_dir`, which must be absent or empty (written whole or not at all:
    `StagedCheckpoint`)."""
    out = Path(out_dir)
    if config.vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={config.vocab_size}: the byte tokenizer needs at least 259")
    config.eos_token_id = 256 + SPECIAL_TOKENS.index("<|im_end|>")
    config.pad_token_id = 256 + SPECIAL_TOKENS.index("<|endoftext|>")
    with StagedCheckpoint(out) as staged:
        writer = ShardWriter(staged)
        for name, t in tensors:
            writer.add(name, t.to(dtype))
        writer.finish()
        cfg = config.to_dict()
        cfg.pop("torch_dtype", None)
        cfg["dtype"] = str(dtype).removeprefix("torch.")
        write_config(staged, cfg)
        write_byte_tokenizer(staged)
    return out


def write_laplace_demo(
    out_dir: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16, **overrides: Any
) -> Path:
    """Write config.json, model.safetensors and a tokenizer for a random Laplace model."""
    config = LaplaceConfig(**{**LAPLACE_DEMO, **overrides})
    config.architectures = ["LaplaceForCausalLM"]
    return _write_demo(out_dir, config, random_laplace_weights(config, seed).items(), dtype)


# Arcee Trinity-Mini's public geometry (docs/models.md §1), with MLA's 256-wide latent.
TRINITY_MINI: dict[str, Any] = dict(
    vocab_size=200192,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=1024,
    num_hidden_layers=32,
    num_dense_layers=2,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    kv_lora_rank=256,
    num_experts=128,
    num_experts_per_tok=8,
    num_shared_experts=1,
    route_scale=2.826,
    route_norm=True,
    score_func="sigmoid",
    n_group=1,
    topk_group=1,
    sliding_window=2048,
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    mup_enabled=True,
    max_position_embeddings=131072,
)
TRINITY_MINI["layer_types"] = TRINITY_MINI["layer_types"] * 8

# The demo keeps the head geometry and latent, with few layers, experts and a short window.
TRINITY_DEMO: dict[str, Any] = dict(
    TRINITY_MINI,
    vocab_size=259,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_dense_layers=1,
    num_experts=8,
    num_experts_per_tok=2,
    sliding_window=128,
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    max_position_embeddings=8192,
)


def _afmoe_weights(config: Any, seed: int = 0, kv_rank: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Random fp32 tensors under transformers' AFMoE checkpoint names (docs/models.md §3; one tensor per expert),
    one at a time. Full-attention layers hold kv_a_proj/kv_b_proj when `config` has a `kv_lora_rank` (MLA-Trinity),
    else k_proj/v_proj, whose stacked [k_proj; v_proj] has rank `kv_rank` when given."""
    g = torch.Generator().manual_seed(seed)
    D, H, Hkv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    r, V = getattr(config, "kv_lora_rank", None), config.vocab_size

    def randn(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std + mean

    def mlp(prefix: str, inner: int) -> Iterator[tuple[str, torch.Tensor]]:
        yield prefix + "gate_proj.weight", randn(inner, D, std=D**-0.5)
        yield prefix + "up_proj.weight", randn(inner, D, std=D**-0.5)
        yield prefix + "down_proj.weight", randn(D, inner, std=inner**-0.5)

    yield "model.embed_tokens.weight", randn(V, D, std=D**-0.5)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        yield a + "q_proj.weight", randn(H * hd, D, std=D**-0.5)
        full = config.layer_types[i] == "full_attention"
        if full and r is not None:
            yield a + "kv_a_proj.weight", randn(r, D, std=D**-0.5)
            yield a + "kv_b_proj.weight", randn(2 * Hkv * hd, r, std=r**-0.5)
        elif full and kv_rank is not None:
            # [k; v] = B A: var = kv_rank * (1 / kv_rank) * (1 / D), the full-rank layers' scale.
            kv = randn(2 * Hkv * hd, kv_rank, std=kv_rank**-0.5) @ randn(kv_rank, D, std=D**-0.5)
            yield a + "k_proj.weight", kv[: Hkv * hd]
            yield a + "v_proj.weight", kv[Hkv * hd :]
        else:
            yield a + "k_proj.weight", randn(Hkv * hd, D, std=D**-0.5)
            yield a + "v_proj.weight", randn(Hkv * hd, D, std=D**-0.5)
        yield a + "o_proj.weight", randn(D, H * hd, std=(H * hd) ** -0.5)
        yield a + "gate_proj.weight", randn(H * hd, D, std=D**-0.5)
        yield a + "q_norm.weight", randn(hd, std=0.1, mean=1.0)
        yield a + "k_norm.weight", randn(hd, std=0.1, mean=1.0)
        for n in ("input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm"):
            yield p + n + ".weight", randn(D, std=0.1, mean=1.0)
        if i < config.num_dense_layers:
            yield from mlp(p + "mlp.", config.intermediate_size)
        else:
            E = config.num_experts
            yield p + "mlp.router.gate.weight", randn(E, D, std=D**-0.5)
            yield p + "mlp.expert_bias", randn(E, std=0.1)
            yield from mlp(p + "mlp.shared_experts.", config.moe_intermediate_size * config.num_shared_experts)
            for e in range(E):
                yield from mlp(p + f"mlp.experts.{e}.", config.moe_intermediate_size)
    yield "model.norm.weight", randn(D, std=0.1, mean=1.0)
    yield "lm_head.weight", randn(V, D, std=4 * D**-0.5)


def write_trinity_demo(
    out_dir: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16, **overrides: Any
) -> Path:
    """Write a random MLA-Trinity checkpoint: real head geometry (128-dim heads, 32 q / 4 KV, latent
    256, [S, S, S, F] layers), few layers and experts."""
    from transformers import AfmoeConfig

    config = AfmoeConfig(**{**TRINITY_DEMO, **overrides})
    config.architectures = ["TrinityMLAForCausalLM"]
    return _write_demo(out_dir, config, _afmoe_weights(config, seed), dtype)


def write_afmoe_demo(
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    kv_rank: int | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a random original AFMoE checkpoint (`AfmoeForCausalLM`: k_proj/v_proj on every layer), the demo's
    geometry by default (`TRINITY_DEMO` without the latent; `config_overrides` replace AfmoeConfig fields).

    With `kv_rank`, the stacked [k_proj; v_proj] of every full-attention layer has exactly that rank, so that
    `vllm-trn convert-mla --latent <kv_rank>` of it is exact (the converted model computes the original's logits).
    """
    from transformers import AfmoeConfig

    if "kv_lora_rank" in config_overrides:
        raise ValueError("write_afmoe_demo: kv_lora_rank is MLA-Trinity's field (write_trinity_demo)")
    base = {k: v for k, v in TRINITY_DEMO.items() if k != "kv_lora_rank"}
    config = AfmoeConfig(**{**base, **config_overrides})
    config.architectures = ["AfmoeForCausalLM"]
    top = min(2 * config.num_key_value_heads * config.head_dim, config.hidden_size)
    if kv_rank is not None and not 1 <= kv_rank <= top:
        raise ValueError(f"write_afmoe_demo: kv_rank={kv_rank} must be in [1, {top}] (min(2 x KV width, hidden))")
    return _write_demo(out_dir, config, _afmoe_weights(config, seed, kv_rank), dtype)
