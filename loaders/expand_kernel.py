"""The compiled loop of MXFP4 -> FP8 row expansion (`loaders/mxfp4.expand_rows` is the interface and the rules).

One pass per row: the row's largest block exponent among blocks holding a nonzero code (two 8-byte words per block,
sign bits masked off), the spread check, then one lookup per code byte in the 256-entry pair table of the block's
shift, writing the byte's two FP8 elements as one 16-bit store. The table of a shift is 512 bytes, so every lookup
hits L1; compiled with numba (a dependency of vLLM itself), the loop runs at a third of memcpy or better on one core,
where torch's elementwise ops and gathers managed a tenth. `nogil`: `expand_rows` runs chunks on threads of its own.
Kept apart from `mxfp4.py` so that importing the format's rules does not import numba.
"""

from __future__ import annotations

import numba
import numpy as np

_MAGNITUDE_BITS = 0x7777777777777777  # the magnitude bits of the 16 E2M1 codes in 8 bytes


@numba.njit(nogil=True, cache=True)
def expand_block_rows(
    codes: np.ndarray,
    words: np.ndarray,
    scales: np.ndarray,
    kb0: int,
    kb1: int,
    pair: np.ndarray,
    max_spread: int,
    zero_row_emax: int,
    out16: np.ndarray,
    e_max: np.ndarray,
) -> int:
    """Expand rows of MXFP4 codes, keeping blocks kb0..kb1 of each.

    ``codes`` the code bytes uint8 [n, in/2]; ``words`` the same bytes as int64
    [n, in/16]; ``scales`` uint8 [n, blocks] (every block of the row: e_max is over the whole row); ``pair`` uint16
    [(max_spread + 1) * 256], entry d * 256 + b the two FP8 bytes of code byte b at shift d; ``out16`` uint16
    [n, (kb1 - kb0) * 16] (any row stride). Writes e_max per row (``zero_row_emax`` for a row of zeros) and returns
    -1, or returns the first row whose nonzero blocks span more than ``max_spread`` octaves (nothing of it written).
    """
    n = scales.shape[0]
    nb = scales.shape[1]
    for r in range(n):
        top = -1
        low = 256
        for b in range(nb):
            if (words[r, 2 * b] | words[r, 2 * b + 1]) & _MAGNITUDE_BITS:
                e = np.int32(scales[r, b])
                top = max(top, e)
                low = min(low, e)
        if top >= 0 and top - low > max_spread:
            return r
        em = top if top >= 0 else zero_row_emax
        e_max[r] = em
        for b in range(kb0, kb1):
            # zero codes map to +-0 at any shift, so an all-zero block may take any clamped one
            d = min(max(em - np.int32(scales[r, b]), 0), max_spread)
            table = pair[d * 256 : (d + 1) * 256]
            o = (b - kb0) * 16
            c = b * 16
            for j in range(16):
                out16[r, o + j] = table[codes[r, c + j]]
    return -1
