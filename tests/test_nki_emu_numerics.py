"""The NKI emulator's numerics model: ScalarE functions give NaN outside their documented valid input ranges, an
optional relative error on the polynomial-approximated functions, and the precision of fp32 TensorE operands
(docs/nki.md section 7.1). Expected values are computed here with NumPy, independently of the emulator."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from tests.emulator_helpers import f32, load, run, store
from vllm_trn_plugin.kernels.nki_emu import numerics, ops
from vllm_trn_plugin.kernels.nki_shim import nisa, nl


def _act(op_name: str):
    def k(x):
        t = load(x)
        y = nl.ndarray(t.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=getattr(nl, op_name), data=t)
        return store(y)

    return k


def test_documented_valid_ranges() -> None:
    # [SHARED] "Supported Activation Functions for NKI ISA"
    assert ops.ACTIVATION_VALID_RANGE["log"] == (2.0**-64, 2.0**64)
    assert ops.ACTIVATION_VALID_RANGE["sqrt"] == (2.0**-116, 2.0**118)
    assert ops.ACTIVATION_VALID_RANGE["rsqrt"] == (2.0**-87, 2.0**97)
    assert ops.ACTIVATION_VALID_RANGE["reciprocal"] == ("abs", 2.0**-42, 2.0**42)
    assert ops.ACTIVATION_VALID_RANGE["sin"] == (-math.pi, math.pi)
    assert "exp" not in ops.ACTIVATION_VALID_RANGE and "silu" not in ops.ACTIVATION_VALID_RANGE
    assert ops.ACTIVATION_ERROR_BOUND is None and ops.FP32_MATMUL_PRECISION is None  # no source: UNCONFIRMED


@pytest.mark.parametrize(
    "op, x, expect",
    [
        ("reciprocal", [1.0, 2.0**43, 0.0, 2.0**-43, -4.0], [1.0, np.nan, np.nan, np.nan, -0.25]),
        ("rsqrt", [4.0, 0.0, 2.0**98, 2.0**-88], [0.5, np.nan, np.nan, np.nan]),
        ("sqrt", [9.0, 0.0, -1.0], [3.0, np.nan, np.nan]),
        ("log", [1.0, 0.0, 2.0**65], [0.0, np.nan, np.nan]),
        ("sin", [3.0, 9.0], [np.float32(math.sin(3.0)), np.nan]),  # no range reduction on ScalarE
        ("arctan", [1.5, 2.0], [np.float32(math.atan(1.5)), np.nan]),
        ("exp", [-1e30, 50.0], [0.0, np.float32(math.exp(50.0))]),  # valid on [-inf, inf]
    ],
)
def test_inputs_outside_the_valid_range_are_invalid(op: str, x: list, expect: list) -> None:
    xs = np.array([x], np.float32)
    out = run(_act(op), xs)
    np.testing.assert_array_equal(out[0], np.array(expect, np.float32))
    with numerics(activation_range="exact"):  # the old behaviour: the exact function everywhere
        exact = run(_act(op), xs)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ref = {"reciprocal": 1 / xs, "rsqrt": 1 / np.sqrt(xs), "sqrt": np.sqrt(xs), "log": np.log(xs),
               "sin": np.sin(xs), "arctan": np.arctan(xs), "exp": np.exp(xs)}[op]  # fmt: skip
    np.testing.assert_allclose(exact, ref, rtol=2e-7)


def test_activation_error_model_is_bounded_deterministic_and_spares_exact_functions() -> None:
    x = np.tile(np.linspace(-8, 8, 256, dtype=np.float32), (2, 1))  # two equal rows
    exact = run(_act("exp"), x)
    e = 2.0**-10
    with numerics(activation_rel_error=e):
        noisy = run(_act("exp"), x)
        copied = run(_act("copy"), x)
    rel = np.abs(noisy.astype(np.float64) / exact - 1)
    assert rel.max() <= e + 2.0**-23 and rel.max() > e / 4  # within the assumed bound, and actually perturbed
    assert np.array_equal(noisy[0], noisy[1])  # a function of the input value: equal inputs, equal outputs
    assert np.array_equal(copied, x)  # copy is not an approximated function
    assert np.array_equal(run(_act("exp"), x), exact)  # the model is restored after the block


def _round_mantissa(x: np.ndarray, bits: int) -> np.ndarray:
    """Round to `bits` significant bits, ties to even (frexp mantissa in [0.5, 1))."""
    m, ex = np.frexp(x.astype(np.float64))
    return np.ldexp(np.round(m * 2.0**bits), ex - bits)


def _mm(x_t, y):
    def k(a, b):
        ta, tb = load(a), load(b)
        ps = nl.ndarray((a.shape[1], b.shape[1]), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, ta, tb)
        return store(ps)

    return run(k, x_t, y)


@pytest.mark.parametrize("mode, bits", [("exact", None), ("tf32", 11), ("bf16", 8)])
def test_fp32_matmul_operand_precision(mode: str, bits: int | None) -> None:
    a, b = f32((64, 32)), f32((64, 48))
    with numerics(fp32_matmul=mode):
        out = _mm(a, b)
    ra, rb = (a, b) if bits is None else (_round_mantissa(a, bits), _round_mantissa(b, bits))
    ref = (ra.astype(np.float64).T @ rb.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    if bits is not None:  # and it differs from the exact product by about the operand rounding
        exact = a.astype(np.float64).T @ b.astype(np.float64)
        err = np.abs(out - exact).max() / np.abs(exact).max()
        assert 2.0**-bits / 64 < err < 2.0**-bits * 4
    # bf16 operands are exact in every mode (the rounding applies to fp32/tf32 operands only)
    a16, b16 = a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16)
    with numerics(fp32_matmul=mode):
        out16 = _mm(a16, b16)
    ref16 = (a16.astype(np.float64).T @ b16.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(out16, ref16, rtol=1e-6, atol=1e-6)


def test_unknown_model_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown numerics"), numerics(fp32_matmul="fp16"):
        pass
