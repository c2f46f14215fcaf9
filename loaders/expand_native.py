"""The MXFP4 -> FP8 expansion loop in C, compiled once per machine and loaded by ctypes (vllm_trn_plugin/native.py).

Why C: the expansion is a table lookup per code byte; as torch ops it runs at ~0.1x memcpy on two AVX2 cores
(index arithmetic, an index tensor and a gather per pass), as one loop at memory speed. Plain C99 with no headers
beyond the C library's.

`loop()` is None where no compiler is found, the compile fails or `VLLM_TRN_NATIVE_EXPAND=0`: the loader then runs
its torch path, bit for bit the same (tests/test_mxfp4_parts.py runs both). ctypes releases the GIL for the call, so the
loader's threads expand chunks side by side.
"""

from __future__ import annotations

import ctypes
import functools

from vllm_trn_plugin import envs, native

SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* Expand rows 0..n of one chunk. codes: uint8 [n, nb*16] (row stride code_stride bytes), sc: uint8 E8M0 block
   exponents [n, nb] (row stride sc_stride), out: FP8 bytes of blocks kb0..kb1 [n, (kb1-kb0)*32] (row stride
   out_stride), pair: int16 [(max_spread+1) * 256], entry d*256 + byte = the FP8 bytes of the byte's two E2M1 codes
   at shift d, first code in the low byte. A row's e_max is the largest exponent of a block holding a nonzero code
   (zero_row_emax for an all-zero row), written to e_max[r]; each kept block's shift is e_max - e clamped to
   0..max_spread (a zero block maps to +-0 at any shift). Returns -1, or the first row whose nonzero blocks span
   more than max_spread octaves (nothing of that row or later is written). */
int64_t trn_expand_mxfp4_rows(const uint8_t *codes, int64_t code_stride, const uint8_t *sc, int64_t sc_stride,
                              int64_t n, int64_t nb, int64_t kb0, int64_t kb1, uint8_t *out, int64_t out_stride,
                              const uint16_t *pair, int16_t *e_max, int64_t max_spread, int64_t zero_row_emax) {
    const uint64_t magnitude = 0x7777777777777777ULL;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *c = codes + r * code_stride, *s = sc + r * sc_stride;
        int64_t top = -1, bottom = 256;
        for (int64_t b = 0; b < nb; b++) {
            uint64_t w0, w1;
            memcpy(&w0, c + 16 * b, 8);
            memcpy(&w1, c + 16 * b + 8, 8);
            if ((w0 | w1) & magnitude) {
                int64_t e = s[b];
                if (e > top) top = e;
                if (e < bottom) bottom = e;
            }
        }
        if (top >= 0 && top - bottom > max_spread) return r;
        int64_t em = top < 0 ? zero_row_emax : top;
        e_max[r] = (int16_t)em;
        uint8_t *o = out + r * out_stride;
        for (int64_t b = kb0; b < kb1; b++) {
            int64_t d = em - (int64_t)s[b];
            d = d < 0 ? 0 : (d > max_spread ? max_spread : d);
            const uint16_t *t = pair + d * 256;
            const uint8_t *cb = c + 16 * b;
            uint16_t v[16];
            for (int j = 0; j < 16; j++) v[j] = t[cb[j]];
            memcpy(o + 32 * (b - kb0), v, 32);
        }
    }
    return -1;
}
"""


def loop() -> object | None:
    """The compiled expansion loop (a ctypes function), or None: disabled, or no working C compiler."""
    return compiled_loop() if envs.native_expand() else None


@functools.cache
def compiled_loop() -> object | None:
    """Compile (or find) and load the loop once per process; None, with a warning, where that fails."""
    lib = native.load("expand-mxfp4", SOURCE, fallback="MXFP4 -> FP8 expansion runs on torch ops, ~3x slower")
    if lib is None:
        return None
    fn = lib.trn_expand_mxfp4_rows
    fn.restype = ctypes.c_int64
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64]
    return fn
