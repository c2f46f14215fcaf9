"""NKI dtypes of the emulator and the casts every engine applies on write.

NKI dtypes are strings (``DType = str`` in the 0.6 stub) [NL]. Storage uses NumPy / ``ml_dtypes``
types as the simulator does with ``NKI_PRECISE_FP=1`` [SIM]: ``bfloat16`` -> ``ml_dtypes.bfloat16``,
``float8_e4m3`` (Trainium2's FP8, IEEE-style, bias 7, max finite 240) -> ``ml_dtypes.float8_e4m3``
(mapping inferred from 3P-ADP, UNCONFIRMED in AWS text), ``float8_e5m2`` -> ``ml_dtypes.float8_e5m2``.

Cast rules (engines compute in fp32 and cast the fp32 result on write [SHARED, TRN1, ISA]):

* fp32 -> bfloat16 / fp8: round to nearest even (``ml_dtypes`` astype; the hardware rounding mode is
  UNCONFIRMED, docs/nki.md section 7).
* fp32 -> ``float8_e4m3``: our spec choice (the hardware overflow behaviour is UNCONFIRMED): a value
  whose RNE result would lie beyond +-240 (|x| >= 248, and +-inf) becomes NaN, never inf. Values in
  (240, 248) round to +-240 like any RNE cast.
* fp32 -> integer: round to nearest even and saturate, as the 0.6 simulator does [RN 0.6.0]; NaN
  becomes 0 (UNCONFIRMED).
* integer -> integer: two's-complement wrap (bit semantics of GpSimd integer arithmetic).
"""

from __future__ import annotations

import numpy as np

try:
    import ml_dtypes
except ImportError as exc:  # an optional dependency: only the emulator needs it
    raise ImportError("the NKI emulator (VLLM_TRN_KERNELS=emulate) needs ml_dtypes: pip install ml_dtypes") from exc

bool_ = "bool_"
int8 = "int8"
int16 = "int16"
int32 = "int32"
uint8 = "uint8"
uint16 = "uint16"
uint32 = "uint32"
float16 = "float16"
float32 = "float32"
bfloat16 = "bfloat16"
tfloat32 = "tfloat32"
float8_e4m3 = "float8_e4m3"
float8_e5m2 = "float8_e5m2"
float8_e4m3fn = "float8_e4m3fn"
# Names only (issue 28, the nki-library peer suite): the trn3 packed MX types and the MX scale type [NL, SHARED].
# nki-library names them at import time; the emulator has no storage or arithmetic for them, so tensors of these
# dtypes are refused (``normalize``) rather than mis-emulated.
float8_e4m3fn_x4 = "float8_e4m3fn_x4"
float8_e5m2_x4 = "float8_e5m2_x4"
float4_e2m1fn_x4 = "float4_e2m1fn_x4"
float8_e8m0fnu = "float8_e8m0fnu"
NOT_EMULATED = frozenset({float8_e4m3fn_x4, float8_e5m2_x4, float4_e2m1fn_x4, float8_e8m0fnu})

NP_DTYPES: dict[str, np.dtype] = {
    bool_: np.dtype(np.uint8),
    int8: np.dtype(np.int8),
    int16: np.dtype(np.int16),
    int32: np.dtype(np.int32),
    uint8: np.dtype(np.uint8),
    uint16: np.dtype(np.uint16),
    uint32: np.dtype(np.uint32),
    float16: np.dtype(np.float16),
    float32: np.dtype(np.float32),
    # tfloat32 is stored as fp32 (its 10-bit mantissa truncation happens inside TensorE only).
    tfloat32: np.dtype(np.float32),
    bfloat16: np.dtype(ml_dtypes.bfloat16),
    float8_e4m3: np.dtype(ml_dtypes.float8_e4m3),
    float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
}

INT_DTYPES = frozenset({bool_, int8, int16, int32, uint8, uint16, uint32})
FP8_DTYPES = frozenset({float8_e4m3, float8_e5m2, float8_e4m3fn})
FP8_E4M3_MAX = 240.0

_FROM_NP: dict[np.dtype, str] = {
    np.dtype(np.int8): int8,
    np.dtype(np.int16): int16,
    np.dtype(np.int32): int32,
    np.dtype(np.uint8): uint8,
    np.dtype(np.uint16): uint16,
    np.dtype(np.uint32): uint32,
    np.dtype(np.float16): float16,
    np.dtype(np.float32): float32,
    np.dtype(np.bool_): bool_,
    np.dtype(ml_dtypes.bfloat16): bfloat16,
    np.dtype(ml_dtypes.float8_e4m3): float8_e4m3,
    np.dtype(ml_dtypes.float8_e5m2): float8_e5m2,
    np.dtype(ml_dtypes.float8_e4m3fn): float8_e4m3fn,
}


def normalize(dtype: object) -> str:
    """Return the NKI dtype string for ``dtype`` (an NKI string or a NumPy / ml_dtypes dtype)."""
    if isinstance(dtype, str):
        if dtype in NOT_EMULATED:
            raise TypeError(f"NKI dtype {dtype!r} (MX / packed x4, trn3) is not emulated")
        if dtype not in NP_DTYPES:
            raise TypeError(f"unknown NKI dtype {dtype!r}")
        return dtype
    try:
        npd = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError as exc:
        raise TypeError(f"unknown NKI dtype {dtype!r}") from exc
    if npd not in _FROM_NP:
        raise TypeError(f"NumPy dtype {npd} has no NKI equivalent (NKI has no 64-bit types)")
    return _FROM_NP[npd]


def np_dtype(dtype: str) -> np.dtype:
    return NP_DTYPES[dtype]


def itemsize(dtype: str) -> int:
    return NP_DTYPES[dtype].itemsize


def is_int(dtype: str) -> bool:
    return dtype in INT_DTYPES


def is_float(dtype: str) -> bool:
    return dtype not in INT_DTYPES


def poison_value(dtype: str) -> float:
    """Sentinel of a fresh buffer: NaN for floats, 4 for integers [SIM]."""
    return 4 if is_int(dtype) else float("nan")


def to_f32(x: np.ndarray) -> np.ndarray:
    """Engine read: any stored dtype -> float32 (exact for every NKI float type and |int| < 2^24)."""
    return np.asarray(x).astype(np.float32)


def cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """Engine write: cast a computed array (float or int) to ``dtype`` with the rules in the module doc."""
    x = np.asarray(x)
    target = NP_DTYPES[dtype]
    if is_int(dtype):
        if x.dtype.kind in "iub":
            return x.astype(target)
        info = np.iinfo(target)
        r = np.rint(x.astype(np.float64))
        r = np.where(np.isnan(r), 0.0, r)
        return np.clip(r, info.min, info.max).astype(target)
    if x.dtype.kind in "iub":
        x = x.astype(np.float64)
    if dtype == float8_e4m3:
        f = x.astype(np.float32)
        out = f.astype(target)
        bad = ~np.isfinite(out.astype(np.float32)) & ~np.isnan(f)
        if bad.any():
            out = out.copy()
            out[bad] = np.nan
        return out
    return x.astype(np.float32).astype(target) if target != np.float32 else x.astype(np.float32)
