"""Small C kernels compiled once per machine with the system's C compiler and loaded by ctypes.

Why not a torch extension: it compiles against torch's headers for a minute; these are plain C99 (plus compiler
intrinsics) that build in a fraction of a second with `cc -O3`. Why not numba: llvmlite's binding object breaks vLLM's
CPU worker start in the same process (docs/packed-format.md). A library is cached under the user's cache directory by
the hash of its source, flags and compiler, written to a temporary name and renamed, so concurrent workers never load
a half-written file, and never from a directory another user could write to.

A library built with `-fopenmp` names `libgomp.so.1`, which the dynamic loader resolves to the copy torch has already
loaded: its parallel loops run on torch's own OpenMP threads, with the count and core binding vLLM gave them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


def _cache_dirs() -> list[Path]:
    """Where a compiled library may live: the user's cache directory, else (a read-only home, as in the trn2 pods)
    a per-user directory under the temporary directory."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(root) / "vllm-trn", Path(tempfile.gettempdir()) / f"vllm-trn-{os.getuid()}"]


def _build(name: str, source: str, flags: Sequence[str], compiler: str) -> Path:
    key = hashlib.sha256("\0".join([source, compiler, *flags]).encode()).hexdigest()[:16]
    for d in _cache_dirs():
        lib = d / f"{name}-{key}.so"
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = d.stat()
            if st.st_uid != os.getuid() or st.st_mode & 0o022:
                continue  # a directory another user could write to: never load code from it
            return lib if lib.is_file() else _compile(source, flags, compiler, lib)
        except OSError:
            continue
    raise OSError(f"no writable directory for the compiled {name} among {[str(d) for d in _cache_dirs()]}")


def _compile(source: str, flags: Sequence[str], compiler: str, lib: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, built = Path(tmp) / "lib.c", Path(tmp) / "lib.so"
        src.write_text(source)
        cmd = [compiler, "-O3", "-std=gnu99", "-shared", "-fPIC", *flags, "-o", str(built), str(src)]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(built, lib)  # atomic: another process loads the old complete file or this one
    return lib


def load(name: str, source: str, flags: Sequence[str] = (), *, fallback: str) -> ctypes.CDLL | None:
    """Compile `source` (or find it compiled) and load it; None, with a warning that ends with `fallback` (what runs
    instead), where no C compiler ($CC, cc or gcc) is found or the build fails."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler (cc, gcc or $CC) for %s: %s", name, fallback)
        return None
    try:
        return ctypes.CDLL(str(_build(name, source, flags, compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("compiling %s failed (%s): %s", name, detail[-500:], fallback)
        return None
