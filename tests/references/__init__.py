"""Independent references the tests compare the plugin against (float64 math, transformers, fla)."""

from __future__ import annotations

from pathlib import Path

import torch


def read_safetensors_dir(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in d."""
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out
