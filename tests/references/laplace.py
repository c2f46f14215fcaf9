"""An independent plain-PyTorch Laplace forward, written from the spec (models.md §2, §3).

One token at a time in float64, straight from the safetensors file: no vLLM, no plugin code.
Every equation is the spec's per-token recurrence, so it is the oracle for the served model.
A packed checkpoint (config.json declares `quantization_config`) is read by tests/references/packed.py
and its quantized matrices apply FP8 activations, as the served FP8 layers must.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.references.packed import fp8_matmul, load_packed
from vllm_trn_plugin.gate.ties import compare_greedy


@dataclass
class Greedy:
    tokens: list[int]
    logprobs: list[float]  # log-softmax of each chosen token
    margins: list[float]  # top-1 minus top-2 logprob at each step


class LaplaceReference:
    def __init__(self, ckpt: str | Path) -> None:
        ckpt = Path(ckpt)
        self.cfg = json.loads((ckpt / "config.json").read_text())
        if "quantization_config" in self.cfg:
            self.w, self.fp8 = load_packed(ckpt)
        else:
            self.w = {k: v.to(torch.float64) for k, v in load_file(str(ckpt / "model.safetensors")).items()}
            self.fp8 = set()
        c = self.cfg
        self.H, self.dk, self.dv, self.D = c["num_heads"], c["head_k_dim"], c["head_v_dim"], c["hidden_size"]
        self.L, self.W = c["num_hidden_layers"], c["conv_size"]
        self.scale = c["attn_scale"] if c["attn_scale"] is not None else self.dk**-0.5
        H = self.H
        t_min, t_max = c["decay_t_min"], c["decay_t_max"]
        half_lives = [t_min * (t_max / t_min) ** (h / (H - 1)) for h in range(H)]
        self.lam = torch.tensor([2.0 ** (-1.0 / t) for t in half_lives], dtype=torch.float64)
        self.tier = [h // (H // c["num_decay_tiers"]) for h in range(H)]

    def new_state(self) -> list[dict[str, torch.Tensor]]:
        return [
            {
                "S": torch.zeros(self.H, self.dk, self.dv, dtype=torch.float64),
                "conv": torch.zeros(self.W - 1, self.D, dtype=torch.float64),
            }
            for _ in range(self.L)
        ]

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (self.D,), self.w[name + ".weight"], self.w[name + ".bias"], self.cfg["norm_eps"])

    def _linear(self, module: str, x: torch.Tensor) -> torch.Tensor:
        if module in self.fp8:
            return fp8_matmul(self.w, module, x)
        bias = self.w.get(module + ".bias")  # a packed matrix served in bf16 keeps its bias correction
        return self.w[module + ".weight"] @ x + (0 if bias is None else bias)

    def step(self, token: int, state: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Consume one token, update `state` in place, return the next-token logits (float64)."""
        w, H, dk, dv = self.w, self.H, self.dk, self.dv
        x = w["model.embed_tokens.weight"][token]
        for i, st in enumerate(state):
            p = f"model.layers.{i}."
            h = self._ln(x, p + "attn_norm")
            window = torch.cat([st["conv"], h[None]], 0)  # [W, D], last row = current token
            conv_w = w[p + "mixer.conv1d.weight"][:, 0, :]  # [D, W]
            c = F.silu((window.T * conv_w).sum(1) + w[p + "mixer.conv1d.bias"])
            st["conv"] = window[1:]
            qkvg = w[p + "mixer.qkvg_proj.weight"] @ c
            q = qkvg[: H * dk].view(H, dk)
            k = qkvg[H * dk : 2 * H * dk].view(H, dk)
            v = qkvg[2 * H * dk : 2 * H * dk + H * dv].view(H, dv)
            g = qkvg[2 * H * dk + H * dv :]
            a = w[p + "mixer.aug_balance"]
            norm_w = w[p + "mixer.head_norm.weight"]
            heads = []
            for hh in range(H):
                st["S"][hh] = self.lam[hh] * st["S"][hh] + torch.outer(k[hh], v[hh])
                o = self.scale * (q[hh] @ st["S"][hh]) + torch.sigmoid((q[hh] * a[hh] * k[hh]).sum()) * v[hh]
                o = o / torch.sqrt((o * o).mean() + self.cfg["head_norm_eps"]) * norm_w[self.tier[hh]]
                heads.append(o)
            y = F.silu(g) * torch.cat(heads)
            x = x + w[p + "mixer.o_proj.weight"] @ y
            h = self._ln(x, p + "ffn_norm")
            gate, up = self._linear(p + "mlp.gate_proj", h), self._linear(p + "mlp.up_proj", h)
            x = x + self._linear(p + "mlp.down_proj", F.silu(gate) * up)
        return self._linear("lm_head", self._ln(x, "model.norm"))

    def greedy(self, prompt: list[int], max_tokens: int) -> Greedy:
        state = self.new_state()
        for t in prompt[:-1]:
            self.step(t, state)
        out = Greedy([], [], [])
        token = prompt[-1]
        for _ in range(max_tokens):
            logp = torch.log_softmax(self.step(token, state), -1)
            top = torch.topk(logp, 2)
            token = int(top.indices[0])
            out.tokens.append(token)
            out.logprobs.append(float(top.values[0]))
            out.margins.append(float(top.values[0] - top.values[1]))
        return out


def assert_same_greedy(got: list[int], ref: Greedy, what: str) -> None:
    """Token-for-token equality, except that after a near-tie the paths may legitimately part (the tie rule,
    `vllm_trn_plugin.gate.ties`); the steps before that must match exactly."""
    agree = compare_greedy(got, ref.tokens, ref.margins)
    d = agree.step
    assert agree.ok, (
        f"{what}: diverges at step {d} (got {got[d : d + 4]}, want {ref.tokens[d : d + 4]}); "
        f"reference top-2 margin there {ref.margins[d] if d < len(ref.margins) else math.nan:.2e} nats is no tie"
    )
