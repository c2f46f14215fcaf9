"""The plugin's environment switches (read where used, so vLLM's worker processes see them too)."""

from __future__ import annotations

import os

ALLOW_BF16 = "VLLM_TRN_ALLOW_BF16"  # "1": a packed matrix that cannot be exact in FP8 is kept in bf16
KERNELS = "VLLM_TRN_KERNELS"  # auto | torch | emulate | nki: who computes the kernel ops (kernels/dispatch.py)
KERNEL_MODES = ("auto", "torch", "emulate", "nki")
FP8_RESIDENCY = (
    "VLLM_TRN_FP8_RESIDENCY"  # copy | fp8: what a CPU holds of each FP8 matrix (model_executors/mxfp4_fp8.py)
)
FP8_RESIDENCY_MODES = ("copy", "fp8")
NO_TCMALLOC = "VLLM_TRN_NO_TCMALLOC"  # "1": `vllm-trn serve` leaves the allocator alone (no tcmalloc preload)
NATIVE_EXPAND = "VLLM_TRN_NATIVE_EXPAND"  # "0": MXFP4 -> FP8 expansion on torch ops, not the compiled loop
# 1 | avx512 | 0: CPU FP8 layers multiply with the compiled kernel (kernels/fp8_cpu.py) on AMX where the CPU has it,
# on AVX-512 BF16 only, or not at all
NATIVE_GEMM = "VLLM_TRN_NATIVE_GEMM"
NATIVE_GEMM_MODES = ("1", "avx512", "0")


def _flag(name: str, default: str = "0") -> bool:
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    return value == "1"


def allow_bf16() -> bool:
    return _flag(ALLOW_BF16)


def no_tcmalloc() -> bool:
    return _flag(NO_TCMALLOC)


def native_expand() -> bool:
    return _flag(NATIVE_EXPAND, "1")


def native_gemm() -> str:
    value = os.environ.get(NATIVE_GEMM, "1")
    if value not in NATIVE_GEMM_MODES:
        raise ValueError(f"{NATIVE_GEMM}={value!r}: expected one of {', '.join(NATIVE_GEMM_MODES)}")
    return value


def kernels() -> str:
    value = os.environ.get(KERNELS, "auto")
    if value not in KERNEL_MODES:
        raise ValueError(f"{KERNELS}={value!r}: expected one of {', '.join(KERNEL_MODES)}")
    return value


def fp8_residency() -> str:
    value = os.environ.get(FP8_RESIDENCY, "copy")
    if value not in FP8_RESIDENCY_MODES:
        raise ValueError(f"{FP8_RESIDENCY}={value!r}: expected one of {', '.join(FP8_RESIDENCY_MODES)}")
    return value


# Under vLLM Neuron's runner (vllm-neuron 0.29 / GA, Trn2/Trn3) the runner, not vLLM, drives the model
# through its own contract (from_configs / get_kv_spec / bind_kv_cache / load_weights / forward with attn_metadata):
# the same architecture names then resolve to the contract adapters (vllm_trn_plugin/neuron, docs/trainium.md).
NEURON_ENTRY = "VLLM_TRN_NEURON_ENTRY"  # auto | neuron | vllm


def neuron_runner_active() -> bool:
    """Whether vLLM Neuron's runner drives the models (through the contract adapters), per VLLM_TRN_NEURON_ENTRY."""
    mode = os.environ.get(NEURON_ENTRY, "auto")
    if mode not in ("auto", "neuron", "vllm"):
        raise ValueError(f"{NEURON_ENTRY}={mode!r}: expected auto, neuron or vllm")
    if mode != "auto":
        return mode == "neuron"
    import importlib.util

    try:  # vLLM Neuron ships its own runner package; the older NxD generation does not
        if importlib.util.find_spec("vllm_neuron.vllm.worker") is None:
            return False
    except Exception:  # not installed, or PyPI's placeholder (which refuses to import)
        return False
    from vllm.platforms import current_platform

    return getattr(current_platform, "device_type", "") == "neuron"
