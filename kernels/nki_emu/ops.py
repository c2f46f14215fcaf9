"""ALU operators and activation functions shared by ``nki.language`` and ``nki.isa``.

The identifiers are ``nl.*`` objects (``nisa.tensor_tensor(op=nl.add)`` [NL, SHARED]); each carries an
``nki_op`` name that the ISA layer looks up here.

Arithmetic ALU ops take fp32 operands and return fp32 (comparisons and logical ops return 1.0 / 0.0,
our reading of [SHARED]; UNCONFIRMED). Bitvec ops work on raw integers; ``right_shift`` is logical
[SHARED].

Numerics of the engines (docs/nki.md section 7.1; ``Numerics`` / ``numerics()`` select the model):

- ScalarE activation functions "are approximated with piece-wise polynomials" and give "invalid output results" for
  inputs outside each function's valid input range (log [2^-64, 2^64], sqrt [2^-116, 2^118], rsqrt [2^-87, 2^97],
  reciprocal +-[2^-42, 2^42], sin [-pi, pi] with no range reduction, arctan [-pi/2, pi/2], the rest unbounded)
  [SHARED]. Default model: the exact function rounded once to fp32 inside the range, NaN outside it
  (``activation_range="invalid"``; ``"exact"`` evaluates everywhere). No source states the polynomials' error
  (UNCONFIRMED: ``ACTIVATION_ERROR_BOUND`` is None); ``activation_rel_error=e`` perturbs every approximated function's
  output by a deterministic relative error in [-e, e] (a function of the input's bits, so equal inputs give equal
  outputs), so a kernel test can show its tolerance survives an assumed table error.
- TensorE: fp32 operands cost 4x a bf16 matmul (20 vs 79 dense TFLOPS on NeuronCore-v3) [TRN1, TRN2]; how fp32
  products are formed (native, bf16 passes, tf32-like) is not documented (UNCONFIRMED: ``FP32_MATMUL_PRECISION`` is
  None). ``fp32_matmul="exact"`` (default) sums each matmul exactly and rounds once to fp32; ``"tf32"`` and
  ``"bf16"`` first round fp32/tf32 operands to 10 / 7 mantissa bits (RNE), the bounds a test can check itself
  against when it relies on fp32 TensorE precision. Accumulation stays fp32 in PSUM [TRN2].
- Rounding: round-to-nearest-even is supported on every NeuronCore generation and the default; stochastic rounding
  is optional from NeuronCore-v2 [ROUND]. Casts use RNE.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator

import numpy as np


def _f(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32)


def _cmp(fn: Callable) -> Callable:
    return lambda a, b: fn(a, b).astype(np.float32)


def _logical(fn: Callable) -> Callable:
    return lambda a, b: fn(a != 0, b != 0).astype(np.float32)


# name -> fp32 binary function (numpy float32 arithmetic rounds once per op, like an fp32 ALU).
ARITH: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "power": np.power,
    "equal": _cmp(np.equal),
    "not_equal": _cmp(np.not_equal),
    "greater": _cmp(np.greater),
    "greater_equal": _cmp(np.greater_equal),
    "less": _cmp(np.less),
    "less_equal": _cmp(np.less_equal),
    "logical_and": _logical(np.logical_and),
    "logical_or": _logical(np.logical_or),
    "logical_xor": _logical(np.logical_xor),
    "abs_max": lambda a, b: np.maximum(np.abs(a), np.abs(b)),
    "abs_min": lambda a, b: np.minimum(np.abs(a), np.abs(b)),
}

# Unary ALU ops usable as tensor_scalar op0 with operand0 None / 0 [ISA tensor_scalar, SHARED].
UNARY_ALU: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "abs": np.abs,
    "square": np.square,
    "relu": lambda x: np.maximum(x, np.float32(0)),
    "rsqrt": lambda x: (1.0 / np.sqrt(x.astype(np.float64))).astype(np.float32),
    "reciprocal": lambda x: (1.0 / x.astype(np.float64)).astype(np.float32),
    "logical_not": lambda x: (x == 0).astype(np.float32),
    "negative": np.negative,
}


def _lsr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a & 0xFFFFFFFF) >> b


BITVEC: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "bitwise_and": np.bitwise_and,
    "bitwise_or": np.bitwise_or,
    "bitwise_xor": np.bitwise_xor,
    "left_shift": np.left_shift,
    "right_shift": _lsr,
}
UNARY_BITVEC = {"invert": np.invert}

# Reduction-legal ops [SHARED]: identity element for a reset accumulator.
REDUCE_INIT = {
    "add": 0.0,
    "multiply": 1.0,
    "maximum": -np.inf,
    "minimum": np.inf,
    "logical_and": 1.0,
    "logical_or": 0.0,
    "logical_xor": 0.0,
    "bitwise_and": -1,
    "bitwise_or": 0,
    "bitwise_xor": 0,
}


def reduce_arith(name: str, x: np.ndarray, axis: tuple[int, ...]) -> np.ndarray:
    """Free-axis reduction of fp32 values; sums/products in float64 then one rounding to fp32."""
    if name == "add":
        return np.sum(x.astype(np.float64), axis=axis).astype(np.float32)
    if name == "multiply":
        return np.prod(x.astype(np.float64), axis=axis).astype(np.float32)
    if name == "maximum":
        return np.max(x, axis=axis)
    if name == "minimum":
        return np.min(x, axis=axis)
    if name == "logical_and":
        return np.all(x != 0, axis=axis).astype(np.float32)
    if name == "logical_or":
        return np.any(x != 0, axis=axis).astype(np.float32)
    if name == "logical_xor":
        return (np.sum(x != 0, axis=axis) % 2).astype(np.float32)
    raise KeyError(name)


def reduce_bitvec(name: str, x: np.ndarray, axis: tuple[int, ...]) -> np.ndarray:
    fn = {"bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor}[name]
    return fn.reduce(x, axis=axis)


_erf = np.vectorize(math.erf, otypes=[np.float64])
_SQRT1_2 = 1.0 / math.sqrt(2.0)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


# name -> float64 function (evaluated on fp32 inputs promoted to float64).
ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "copy": lambda x: x,
    "identity": lambda x: x,
    "bypass": lambda x: x,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "reciprocal": lambda x: 1.0 / x,
    "square": np.square,
    "abs": np.abs,
    "sign": np.sign,
    "relu": lambda x: np.maximum(x, 0.0),
    "sigmoid": _sigmoid,
    "tanh": np.tanh,
    "silu": lambda x: x * _sigmoid(x),
    "silu_dx": lambda x: _sigmoid(x) * (1.0 + x * (1.0 - _sigmoid(x))),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x * _SQRT1_2)),
    "gelu_dx": lambda x: 0.5 * (1.0 + _erf(x * _SQRT1_2)) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi),
    "gelu_apprx_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    "gelu_apprx_sigmoid": lambda x: x * _sigmoid(1.702 * x),
    "gelu_apprx_sigmoid_dx": lambda x: _sigmoid(1.702 * x) * (1.0 + 1.702 * x * (1.0 - _sigmoid(1.702 * x))),
    "softplus": _softplus,
    "mish": lambda x: x * np.tanh(_softplus(x)),
    "erf": _erf,
    "erf_dx": lambda x: 2.0 / math.sqrt(math.pi) * np.exp(-x * x),
    "sin": np.sin,
    "cos": np.cos,
    "arctan": np.arctan,
    "negative": np.negative,
}


# ---- numerics model (module docstring) ------------------------------------------------------------------------
# Valid input ranges of the Scalar Engine's functions [SHARED, "Supported Activation Functions for NKI ISA"]:
# (lo, hi) on the input, or ("abs", lo, hi) on |x|; functions not listed are valid on [-inf, inf].
ACTIVATION_VALID_RANGE: dict[str, tuple] = {
    "log": (2.0**-64, 2.0**64),
    "sqrt": (2.0**-116, 2.0**118),
    "rsqrt": (2.0**-87, 2.0**97),
    "reciprocal": ("abs", 2.0**-42, 2.0**42),
    "sin": (-math.pi, math.pi),
    "arctan": (-math.pi / 2, math.pi / 2),
}
# Functions the table approximates by polynomials; the others (copy, relu, abs, sign, square, ...) are taken as exact.
APPROXIMATED = frozenset(
    {
        "exp", "log", "sqrt", "rsqrt", "reciprocal", "sigmoid", "tanh", "silu", "silu_dx", "gelu", "gelu_dx",
        "gelu_apprx_tanh", "gelu_apprx_sigmoid", "gelu_apprx_sigmoid_dx", "softplus", "mish", "erf", "erf_dx",
        "sin", "arctan",
    }
)  # fmt: skip
ACTIVATION_ERROR_BOUND: float | None = None  # no source states the polynomials' error: UNCONFIRMED
FP32_MATMUL_PRECISION: str | None = None  # how TensorE forms fp32 products: not documented, UNCONFIRMED


@dataclasses.dataclass
class Numerics:
    """The emulator's numerics model (module docstring)."""

    activation_range: str = "invalid"  # "invalid": NaN outside the documented valid range; "exact": no range check
    activation_rel_error: float = 0.0  # relative error applied to approximated functions (0: exact, rounded)
    fp32_matmul: str = "exact"  # "exact", "tf32" or "bf16": precision of fp32/tf32 TensorE operands


NUMERICS = Numerics()


@contextlib.contextmanager
def numerics(**changes: object) -> Iterator[Numerics]:
    """Run with some fields of ``NUMERICS`` changed, e.g. ``with numerics(activation_rel_error=2**-10): ...``."""
    global NUMERICS
    new = dataclasses.replace(NUMERICS, **changes)
    if new.activation_range not in ("invalid", "exact") or new.fp32_matmul not in ("exact", "tf32", "bf16"):
        raise ValueError(f"unknown numerics model {new}")
    prev, NUMERICS = NUMERICS, new
    try:
        yield new
    finally:
        NUMERICS = prev


def _outside_range(name: str, x: np.ndarray) -> np.ndarray | None:
    rng = ACTIVATION_VALID_RANGE.get(name)
    if rng is None:
        return None
    if rng[0] == "abs":
        ax = np.abs(x)
        return ~((ax >= rng[1]) & (ax <= rng[2]))
    return ~((x >= rng[0]) & (x <= rng[1]))


def _perturbation(x32: np.ndarray) -> np.ndarray:
    """A deterministic value in [-1, 1) per input (a hash of its fp32 bits)."""
    bits = np.ascontiguousarray(x32, np.float32).view(np.uint32).astype(np.uint64)
    h = (bits * np.uint64(2654435761) + np.uint64(0x9E3779B9)) % np.uint64(1 << 32)
    h ^= h >> np.uint64(15)
    h = (h * np.uint64(2246822519)) % np.uint64(1 << 32)
    return h.astype(np.float64) / float(1 << 31) - 1.0


def activation_fn(name: str) -> Callable[[np.ndarray], np.ndarray]:
    """The Scalar Engine's ``name`` on fp32 inputs under ``NUMERICS`` (module docstring)."""
    fn = ACTIVATIONS[name]

    def run(x32: np.ndarray) -> np.ndarray:
        model = NUMERICS
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            y = np.asarray(fn(x32.astype(np.float64)), np.float64)
            if model.activation_rel_error and name in APPROXIMATED:
                y = y * (1.0 + model.activation_rel_error * _perturbation(x32))
            if model.activation_range == "invalid":
                bad = _outside_range(name, x32)
                if bad is not None and bad.any():
                    y = np.where(bad, np.nan, y)
            return y.astype(np.float32)

    return run


def tensor_engine_operand(a: np.ndarray, dtype: str) -> np.ndarray:
    """A TensorE operand as the multiplier sees it (float64 values): fp32/tf32 operands rounded to the mantissa of
    ``NUMERICS.fp32_matmul`` (RNE), every other dtype exact (its values are already in that dtype)."""
    mode = NUMERICS.fp32_matmul
    if mode == "exact" or dtype not in ("float32", "tfloat32"):
        return a.astype(np.float64)
    drop = 13 if mode == "tf32" else 16  # fp32 has 23 mantissa bits; tf32 keeps 10, bf16 7
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    half = np.uint64(1 << (drop - 1))
    lsb = (bits >> np.uint64(drop)) & np.uint64(1)
    rounded = ((bits + half - np.uint64(1) + lsb) >> np.uint64(drop)) << np.uint64(drop)
    finite = np.isfinite(a)
    out = np.where(finite, rounded, bits).astype(np.uint32).view(np.float32)
    return out.astype(np.float64)


def op_name(op: object, what: str) -> str:
    name = getattr(op, "nki_op", None)
    if name is None:
        if isinstance(op, str):
            return op
        raise TypeError(f"{what}: {op!r} is not an nl operator identifier (use nl.add, nl.exp, ...)")
    return name
