"""Kernel-side helpers and random inputs for the NKI emulator tests."""

from __future__ import annotations

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
