"""The MXFP4 -> FP8 expansion loop in C, compiled once per machine with the system's C compiler and loaded by ctypes.

Why C: the expansion is a table lookup per code byte; as torch ops it runs at ~0.1x memcpy on two AVX2 cores
(index arithmetic, an index tensor and a gather per pass), as one loop at memory speed. Why not numba or a torch
extension: numba loads llvmlite, whose binding object breaks vLLM's CPU worker start in the same process
(docs/packed-format.md), and a torch extension compiles against torch's headers for a minute. This is plain C99 with
no headers beyond the C library's: a fraction of a second with `cc -O3`, cached under the user's cache directory by
the source's hash, written to a temporary name and renamed, so concurrent workers never load a half-written file.

`loop()` is None where no compiler is found, the compile fails or `VLLM_TRN_NATIVE_EXPAND=0`: the loader then runs
its torch path, bit for bit the same (tests/test_mxfp4_parts.py runs both). ctypes releases the GIL for the call, so the
loader's threads expand chunks side by side.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from vllm_trn_plugin import envs

logger = logging.getLogger(__name__)

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


def _cache_dirs() -> list[Path]:
    """Where the compiled loop may live: the user's cache directory, else (a read-only home, as in the trn2 pods)
    a per-user directory under the temporary directory."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(root) / "vllm-trn", Path(tempfile.gettempdir()) / f"vllm-trn-{os.getuid()}"]


def _build(compiler: str) -> Path:
    key = hashlib.sha256((SOURCE + compiler).encode()).hexdigest()[:16]
    for d in _cache_dirs():
        lib = d / f"expand-mxfp4-{key}.so"
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = d.stat()
            if st.st_uid != os.getuid() or st.st_mode & 0o022:
                continue  # a directory another user could write to: never load code from it
            return lib if lib.is_file() else _compile(compiler, lib)
        except OSError:
            continue
    raise OSError(f"no writable directory for the compiled expansion loop among {[str(d) for d in _cache_dirs()]}")


def _compile(compiler: str, lib: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, built = Path(tmp) / "expand.c", Path(tmp) / "expand.so"
        src.write_text(SOURCE)
        cmd = [compiler, "-O3", "-std=c99", "-shared", "-fPIC", "-o", str(built), str(src)]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(built, lib)  # atomic: another process loads the old complete file or this one
    return lib


def loop() -> object | None:
    """The compiled expansion loop (a ctypes function), or None: disabled, or no working C compiler."""
    return compiled_loop() if envs.native_expand() else None


@functools.cache
def compiled_loop() -> object | None:
    """Compile (or find) and load the loop once per process; None, with a warning, where that fails."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler (cc, gcc or $CC): MXFP4 -> FP8 expansion runs on torch ops, ~3x slower")
        return None
    try:
        fn = ctypes.CDLL(str(_build(compiler))).trn_expand_mxfp4_rows
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("compiling the MXFP4 expansion loop failed (%s): it runs on torch ops", detail[-500:])
        return None
    fn.restype = ctypes.c_int64
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64]
    return fn
