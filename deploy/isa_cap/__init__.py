"""Benchmark on a lesser x86 CPU than this one: the environment under which child processes compute as an
AVX-512 BF16 CPU without AMX (`avx512`, e.g. AMD EPYC Zen 4) or an AVX2-only one (`avx2`) would, on this
machine's cores and memory. What it caps: oneDNN (ONEDNN_MAX_CPU_ISA), ATen's kernels (ATEN_CPU_CAPABILITY),
FBGEMM (FBGEMM_ENABLE_INSTRUCTIONS), the plugin's own FP8 kernel (VLLM_TRN_NATIVE_GEMM) and torch's CPU probes
that vLLM reads (sitecustomize.py here). What it cannot: the other CPU's caches, memory bandwidth and clock, so a
ratio measured under a cap is a stand-in for one measured on that CPU, to be stated as such."""

from __future__ import annotations

import os
from pathlib import Path

CAPS = ("native", "avx512", "avx2")

_ENV = {
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "VLLM_TRN_NATIVE_GEMM": "avx512"},
    "avx2": {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
        "VLLM_TRN_NATIVE_GEMM": "0",
    },
}


def cap_env(cap: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default os.environ) with the variables that make processes started from it compute as `cap`'s CPU;
    read at their start, so set them before any engine or worker starts. "native" changes nothing."""
    if cap not in CAPS:
        raise ValueError(f"ISA cap {cap!r}: expected one of {', '.join(CAPS)}")
    out = dict(os.environ if env is None else env)
    if cap == "native":
        return out
    out.update(_ENV[cap], TRN_BENCH_ISA_CAP=cap)
    here = str(Path(__file__).resolve().parent)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (here, out.get("PYTHONPATH")) if p)
    return out
