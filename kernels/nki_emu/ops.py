"""ALU operators and activation functions shared by ``nki.language`` and ``nki.isa``.

The identifiers are ``nl.*`` objects (``nisa.tensor_tensor(op=nl.add)`` [NL, SHARED]); each carries an
``nki_op`` name that the ISA layer looks up here.

Arithmetic ALU ops take fp32 operands and return fp32 (comparisons and logical ops return 1.0 / 0.0,
our reading of [SHARED]; UNCONFIRMED). Bitvec ops work on raw integers; ``right_shift`` is logical
[SHARED]. Activation functions are evaluated in float64 and rounded once to fp32: the hardware uses
piecewise-polynomial approximations whose accuracy is not documented (only ``sin`` is mirrored by
the real simulator [SHARED]), so this is "the exact function, rounded", UNCONFIRMED vs hardware.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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


def activation_fn(name: str) -> Callable[[np.ndarray], np.ndarray]:
    fn = ACTIVATIONS[name]

    def run(x32: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return np.asarray(fn(x32.astype(np.float64))).astype(np.float32)

    return run


def op_name(op: object, what: str) -> str:
    name = getattr(op, "nki_op", None)
    if name is None:
        if isinstance(op, str):
            return op
        raise TypeError(f"{what}: {op!r} is not an nl operator identifier (use nl.add, nl.exp, ...)")
    return name
