"""Kernel-side helpers and random inputs for the NKI emulator tests."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from vllm_trn_plugin.kernels.nki_shim import nisa, nki, nl, simulate

E4M3 = ml_dtypes.float8_e4m3
BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(0)


def run(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    return simulate(nki.jit(fn))(*args, **kwargs)


def load(src: Any, dtype: Any = None) -> Any:
    """Kernel-side helper: HBM -> a new SBUF tile (one dma_copy)."""
    t = nl.ndarray(src.shape if src.ndim > 1 else (src.shape[0], 1), dtype or src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src)
    return t


def store(t: Any) -> Any:
    """Kernel-side helper: SBUF/PSUM tile -> a new shared_hbm output."""
    if t.buffer == nl.psum:
        sb = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb, src=t)
        t = sb
    out = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def f32(shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def fp8_values(shape: tuple[int, ...], scale: float = 30.0) -> np.ndarray:
    """Random finite E4M3 values (|x| <= 240)."""
    return np.clip(RNG.standard_normal(shape) * scale, -240, 240).astype(E4M3)


# The counters a kernel's cost formula states per program (kernels/kernel_cost.py), compared exactly.
COUNTER_KEYS = (
    "dma_hbm_to_sbuf_bytes", "dma_sbuf_to_hbm_bytes", "dma_sbuf_to_sbuf_bytes", "dma_bytes", "dma_instructions",
    "dma_descriptors", "matmul_instructions", "transpose_instructions", "matmul_macs", "emitted_instructions",
    "executed_instructions",
)  # fmt: skip


def lnc2(kernel: Any) -> Any:
    """The runner of a Trn2 deployment at LNC=2: two programs, neuronx-cc at LNC=2."""
    return simulate(kernel[2], compiler_lnc=2)


def assert_counters_equal_cost(c: Any, cost: dict) -> None:
    """Every program's emulator counters equal the cost formula's program (DMA times to float rounding)."""
    assert c.num_programs == cost["lnc"] == len(cost["programs"])
    for p, (got, want) in enumerate(zip(c.programs, cost["programs"])):
        for key in COUNTER_KEYS:
            assert getattr(got, key) == want[key], (p, key, getattr(got, key), want[key])
        for key in ("dma_transfer_ns", "dma_time_ns"):
            assert math.isclose(getattr(got, key), want[key], rel_tol=1e-9), (p, key)
