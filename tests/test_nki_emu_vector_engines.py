"""The NKI emulator's ScalarE and VectorE instructions against float64 / NumPy statements of their documented
semantics: activation, tensor_tensor, tensor_scalar, reductions, copies, selects."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.emulator_helpers import BF16, RNG, f32, load, run, store
from vllm_trn_plugin.kernels.nki_emu import errors
from vllm_trn_plugin.kernels.nki_shim import nisa, nl


# ---- Scalar / Vector engines ---------------------------------------------------------------------------
def _act_ref(name: str, x: np.ndarray) -> np.ndarray:
    erf = np.vectorize(math.erf)
    sig = 1 / (1 + np.exp(-x))
    return {
        "exp": np.exp(x),
        "silu": x * sig,
        "sigmoid": sig,
        "tanh": np.tanh(x),
        "gelu": 0.5 * x * (1 + erf(x / np.sqrt(2))),
        "relu": np.maximum(x, 0),
        "square": x * x,
        "copy": x,
        "rsqrt": 1 / np.sqrt(np.abs(x) + 1),
    }[name]


@pytest.mark.parametrize("name", ["exp", "silu", "sigmoid", "tanh", "gelu", "relu", "square", "copy"])
def test_activation_applies_scale_then_bias_then_function(name: str) -> None:
    x = f32((32, 48))
    scale = f32((32, 1))
    bias = f32((32, 1))

    def k(x, scale, bias):
        y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=getattr(nl, name), data=load(x), bias=load(bias), scale=load(scale))
        y2 = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y2, op=getattr(nl, name), data=load(x), bias=0.25, scale=0.5)
        return store(y), store(y2)

    y, y2 = run(k, x, scale, bias)
    t = (x * scale + bias).astype(np.float64)  # fp32 multiply, fp32 add, as the engine
    assert np.allclose(y, _act_ref(name, t), rtol=2e-7, atol=1e-30)
    t2 = (x * np.float32(0.5) + np.float32(0.25)).astype(np.float64)
    assert np.allclose(y2, _act_ref(name, t2), rtol=2e-7, atol=1e-30)


def test_activation_reduce_registers_reset_reduce_idle() -> None:
    x = f32((16, 40))

    def k(x):
        sx = load(x)
        y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        stale = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=nl.exp, data=sx, reduce_res=stale)  # idle before any reset: NaN registers
        s1 = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(
            dst=y, op=nl.exp, data=sx, reduce_op=nl.add, reduce_res=s1, reduce_cmd=nisa.reduce_cmd.reset_reduce
        )
        s2 = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=nl.copy, data=sx, reduce_op=nl.add, reduce_res=s2, reduce_cmd=nisa.reduce_cmd.reduce)
        s3 = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=nl.copy, data=sx, reduce_res=s3, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        return store(stale), store(s1), store(s2), store(s3)

    stale, s1, s2, s3 = run(k, x)
    e = np.exp(x.astype(np.float64)).astype(np.float32).astype(np.float64).sum(1, keepdims=True)
    assert np.isnan(stale).all()
    assert np.allclose(s1, e, rtol=1e-6)
    assert np.allclose(s2, e + x.astype(np.float64).sum(1, keepdims=True), rtol=1e-5)
    assert np.allclose(s3, x.astype(np.float64).sum(1, keepdims=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("op", "ref"),
    [
        ("add", np.add),
        ("subtract", np.subtract),
        ("multiply", np.multiply),
        ("maximum", np.maximum),
        ("minimum", np.minimum),
        ("greater_equal", lambda a, b: (a >= b).astype(np.float32)),
        ("less", lambda a, b: (a < b).astype(np.float32)),
        ("equal", lambda a, b: (a == b).astype(np.float32)),
    ],
)
def test_tensor_tensor_fp32_ops_cast_on_write(op: str, ref) -> None:
    a = f32((64, 33))
    b = f32((64, 33))
    b[0, :3] = a[0, :3]

    def k(a, b):
        x, y = load(a), load(b)
        o32 = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        o16 = nl.ndarray(a.shape, nl.bfloat16, buffer=nl.psum)  # dst may be PSUM
        nisa.tensor_tensor(dst=o32, data1=x, data2=y, op=getattr(nl, op))
        nisa.tensor_tensor(dst=o16, data1=x, data2=y, op=getattr(nl, op))
        return store(o32), store(o16)

    o32, o16 = run(k, a, b)
    expect = ref(a, b).astype(np.float32)  # numpy float32 ops round once, like the fp32 ALU
    assert np.array_equal(o32, expect)
    assert np.array_equal(o16.view(np.uint16), expect.astype(BF16).view(np.uint16))


def test_divide_is_not_an_isa_operator() -> None:
    def k(a):
        x = load(a)
        nisa.tensor_tensor(dst=x, data1=x, data2=x, op=nl.divide)

    with pytest.raises(errors.NkiValidationError, match="reciprocal"):
        run(k, f32((2, 2)))


def test_tensor_tensor_integer_and_bitvec_ops_are_exact() -> None:
    a = RNG.integers(-(2**30), 2**30, (8, 16), dtype=np.int32)
    b = RNG.integers(0, 31, (8, 16), dtype=np.int32)

    def k(a, b):
        x, y = load(a), load(b)
        outs = []
        for op in (nl.add, nl.multiply, nl.bitwise_and, nl.left_shift, nl.right_shift):
            o = nl.ndarray(a.shape, nl.int32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=o, data1=x, data2=y, op=op)
            outs.append(store(o))
        return tuple(outs)

    add, mul, band, shl, shr = run(k, a, b)
    a64, b64 = a.astype(np.int64), b.astype(np.int64)
    assert np.array_equal(add, (a64 + b64).astype(np.int32))
    assert np.array_equal(mul, (a64 * b64).astype(np.int32))  # wraps like 32-bit integer hardware
    assert np.array_equal(band, a & b)
    assert np.array_equal(shl, (a64 << b64).astype(np.int32))
    assert np.array_equal(shr, ((a64 & 0xFFFFFFFF) >> b64).astype(np.int32))  # logical shift


def test_elementwise_shape_rules() -> None:
    def k(a_shape, b_shape, a_buf, b_buf):
        a = nl.zeros(a_shape, nl.float32, buffer=a_buf)
        b = nl.zeros(b_shape, nl.float32, buffer=b_buf)
        o = nl.ndarray(a_shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=o, data1=a, data2=b, op=nl.add)
        return store(o)

    assert (run(k, (8, 6), (8, 2, 3), nl.sbuf, nl.psum) == 0).all()  # same elements per partition suffice
    with pytest.raises(errors.ShapeError, match="same partition count"):
        run(k, (8, 6), (4, 12), nl.sbuf, nl.sbuf)
    with pytest.raises(errors.MemorySpaceError, match="both be in PSUM"):
        run(k, (8, 6), (8, 6), nl.psum, nl.psum)


def test_tensor_scalar_two_ops_reverse_and_column_operands() -> None:
    x = f32((16, 24))
    col = f32((16, 1))

    def k(x, col):
        sx, sc = load(x), load(col)
        o1 = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o1, data=sx, op0=nl.subtract, operand0=sc, op1=nl.multiply, operand1=3.0)
        o2 = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o2, data=sx, op0=nl.subtract, operand0=1.5, reverse0=True)
        o3 = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o3, data=sx, op0=nl.abs, operand0=None, op1=nl.maximum, operand1=0.5)
        o4 = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o4, data=sx, op0=nl.add, operand0=1.0, op1=nl.subtract, operand1=sc, reverse1=True)
        return store(o1), store(o2), store(o3), store(o4)

    o1, o2, o3, o4 = run(k, x, col)
    assert np.array_equal(o1, (x - col) * np.float32(3))
    assert np.array_equal(o2, np.float32(1.5) - x)
    assert np.array_equal(o3, np.maximum(np.abs(x), np.float32(0.5)))
    assert np.array_equal(o4, col - (x + np.float32(1)))


def test_scalar_tensor_tensor_matches_unfused_fp32_torch() -> None:
    s = torch.randn(96, 192)
    kv = torch.randn(96, 192)
    lam = 0.9371

    def k(s, kv):
        ss, skv = load(s), load(kv)
        o = nl.ndarray(s.shape, nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=o, data=ss, op0=nl.multiply, operand0=lam, op1=nl.add, operand1=skv)
        o2 = nl.ndarray(s.shape, nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(
            dst=o2, data=ss, op0=nl.subtract, operand0=1.0, op1=nl.subtract, operand1=skv, reverse0=True, reverse1=True
        )
        return store(o), store(o2)

    o, o2 = run(k, s, kv)
    assert torch.equal(o, lam * s + kv)  # torch: fp32 multiply, then fp32 add
    assert torch.equal(o2, kv - (1.0 - s))


def test_tensor_reduce_over_trailing_axes_with_negate() -> None:
    x = f32((8, 4, 5))

    def k(x):
        sx = load(x)
        s = nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=s, op=nl.add, data=sx, axis=2)
        m = nl.ndarray((8, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=m, op=nl.maximum, data=sx, axis=(1, 2), negate=True)
        return store(s), store(m)

    s, m = run(k, x)
    assert np.array_equal(s, x.astype(np.float64).sum(2).astype(np.float32))
    assert np.array_equal(m[:, 0], -x.max((1, 2)))

    def bad(x):
        d = nl.ndarray((8, 5), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=d, op=nl.add, data=load(x), axis=1)

    with pytest.raises(errors.NkiValidationError, match="trailing free dims"):
        run(bad, x)


def test_tensor_copy_memset_iota_reciprocal() -> None:
    x = f32((8, 10))

    def k(x):
        sx = load(x)
        c = nl.ndarray((8, 2, 5), nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=c, src=sx)
        m = nl.ndarray((8, 3), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=m, value=-5)
        i = nl.ndarray((8, 2, 3), nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=i, pattern=[[10, 2], [1, 3]], offset=7, channel_multiplier=100)
        fi = nl.ndarray((8, 6), nl.float32, buffer=nl.sbuf)
        nisa.iota(fi, [[1, 6]], 0, 2)
        r = nl.ndarray((8, 10), nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=r, data=sx)
        return store(c), store(m), store(i), store(fi), store(r)

    c, m, i, fi, r = run(k, x)
    assert np.array_equal(c.reshape(8, 10), x)
    assert (m == -5).all()
    p = np.arange(8)[:, None, None]
    assert np.array_equal(i, 7 + 100 * p + 10 * np.arange(2)[None, :, None] + np.arange(3)[None, None, :])
    assert np.array_equal(fi, (2 * np.arange(8)[:, None] + np.arange(6)[None, :]).astype(np.float32))
    assert np.array_equal(r, np.float32(1) / x)

    def bad(x):
        nisa.memset(dst=nl.ndarray((8, 3), nl.int32, buffer=nl.sbuf), value=2.0)

    with pytest.raises(errors.DtypeError, match="integer value"):
        run(bad, x)


def test_predicated_copy_and_range_select() -> None:
    x = f32((8, 12))
    pred = (RNG.random((8, 12)) > 0.5).astype(np.uint8)
    lo = RNG.integers(0, 16, (8, 1)).astype(np.float32)
    hi = lo + RNG.integers(0, 6, (8, 1)).astype(np.float32)
    hi[0] = lo[0]  # an empty range: every element masked

    def k(x, pred, lo, hi):
        sx, sp = load(x), load(pred)
        d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=d, value=-1.0)
        nisa.tensor_copy_predicated(dst=d, src=sx, predicate=sp)
        r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        rmax = nl.ndarray((8, 1), nl.float32, buffer=nl.sbuf)
        nisa.range_select(
            r, sx, nl.greater_equal, nl.less, bound0=load(lo), bound1=load(hi), reduce_res=rmax, range_start=4
        )
        return store(d), store(r), store(rmax)

    d, r, rmax = run(k, x, pred, lo, hi)
    assert np.array_equal(d, np.where(pred != 0, x, -1))
    j = np.arange(12)[None, :] + 4  # element j of a row stands for index j + range_start
    expect = np.where((j >= lo) & (j < hi), x, np.finfo(np.float32).min)
    assert np.array_equal(r, expect) and np.array_equal(rmax[:, 0], expect.max(1))
