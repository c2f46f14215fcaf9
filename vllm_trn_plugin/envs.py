"""The plugin's environment switches (read where used, so vLLM's worker processes see them too)."""

from __future__ import annotations

import os

ALLOW_BF16 = "VLLM_TRN_ALLOW_BF16"  # "1": a packed matrix that cannot be exact in FP8 is kept in bf16
KERNELS = "VLLM_TRN_KERNELS"  # auto | torch | emulate | nki: who computes the kernel ops (kernels/dispatch.py)
KERNEL_MODES = ("auto", "torch", "emulate", "nki")


def allow_bf16() -> bool:
    value = os.environ.get(ALLOW_BF16, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ALLOW_BF16}={value!r}: expected 0 or 1")
    return value == "1"


def kernels() -> str:
    value = os.environ.get(KERNELS, "auto")
    if value not in KERNEL_MODES:
        raise ValueError(f"{KERNELS}={value!r}: expected one of {', '.join(KERNEL_MODES)}")
    return value
