"""`laplace` config (spec §3): registered with transformers' AutoConfig, no remote code."""

from __future__ import annotations

import math
from typing import Any

from transformers import PretrainedConfig


class LaplaceConfig(PretrainedConfig):
    model_type = "laplace"

    def __init__(
        self,
        vocab_size: int = 50304,
        hidden_size: int = 3072,
        num_hidden_layers: int = 24,
        num_heads: int = 16,
        head_k_dim: int = 96,
        head_v_dim: int = 192,
        conv_size: int = 4,
        intermediate_size: int = 8192,
        decay_t_min: float = 1.0,
        decay_t_max: float = 2048.0,
        num_decay_tiers: int = 4,
        attn_scale: float | None = None,
        norm_eps: float = 1e-5,
        head_norm_eps: float = 1e-6,
        max_position_embeddings: int = 131072,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.conv_size = conv_size
        self.intermediate_size = intermediate_size
        self.decay_t_min = decay_t_min
        self.decay_t_max = decay_t_max
        self.num_decay_tiers = num_decay_tiers
        self.attn_scale = attn_scale
        self.norm_eps = norm_eps
        self.head_norm_eps = head_norm_eps
        # No positional encoding: the recurrent state serves any length. This only bounds vLLM's
        # default max_model_len (the model was trained at 2048).
        self.max_position_embeddings = max_position_embeddings
        # vLLM reads these to size attention caches; an attention-free model has none.
        self.num_attention_heads = num_heads
        if tie_word_embeddings:
            raise ValueError("laplace config: tie_word_embeddings must be false (untied LM head)")
        for field, value in (("decay_t_min", decay_t_min), ("decay_t_max", decay_t_max)):
            # half-lives in tokens: lambda = 2^(-1/T) is a decay in (0, 1) only for 0 < T < inf (a negative T grows the
            # state without bound, 0 divides by zero)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ValueError(f"laplace config: {field}={value!r} must be a positive, finite half-life in tokens")
        for field, value in (("num_heads", num_heads), ("num_decay_tiers", num_decay_tiers)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"laplace config: {field}={value!r} must be a positive integer")
        if num_heads % num_decay_tiers:
            raise ValueError(
                f"laplace config: num_heads={num_heads} is not divisible by num_decay_tiers={num_decay_tiers}"
            )
        super().__init__(tie_word_embeddings=False, **kwargs)

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_k_dim**-0.5
