"""Runs AWS's nki-library kernels (a snapshot in ../shared/nki-library) in the project's NKI emulator.

nki-library kernels do ``import nki, nki.isa as nisa, nki.language as nl`` (and ``nki.typing``, ``nki.isa.constants``,
...) at module top; AWS's own harness runs them on CPU by aliasing those module names to its simulator package
(``test/utils/simulation_setup.py`` there) and calling ``nki.cpu_simulate(kernel)[lnc](**inputs)``. This module does
the same with the emulator (``install()``), both under the ``nki`` names the kernels import and under the
``nki_cpu_simulator`` names AWS's harness imports, then imports the kernels from the snapshot's ``src`` as
``nkilib_src.nkilib...`` and their AWS test modules (for input generators and tolerances) from its root.

Test-only: nothing on the serving path imports this module, and the library is read and run in place, never copied.
The library location: ``NKI_LIBRARY_DIR`` if set, else ``../shared/nki-library`` beside the repository.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
ENV_DIR = "NKI_LIBRARY_DIR"


def library_dir() -> Path:
    """Where the nki-library snapshot is expected (it may be absent)."""
    env = os.environ.get(ENV_DIR)
    return Path(env).resolve() if env else (REPO.parent / "shared" / "nki-library").resolve()


def library_missing_reason() -> str | None:
    """None when the snapshot is usable, else why not (naming the path)."""
    d = library_dir()
    if not (d / "src" / "nkilib_src" / "nkilib").is_dir():
        return f"nki-library snapshot not found at {d} (set {ENV_DIR} or place a clone at ../shared/nki-library)"
    return None


class _CpuSimulate:
    """``nki.cpu_simulate(kernel)[lnc](**inputs)`` as AWS's harness calls its simulator: the kernel at LNC=``lnc``
    under a compiler at the same LNC."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, lnc: int) -> Any:
        from vllm_trn_plugin.kernels.nki_emu import Kernel, simulate

        k = self.kernel if isinstance(self.kernel, Kernel) else Kernel(self.kernel)  # plain wrappers, as AWS passes
        return simulate(k[int(lnc)], compiler_lnc=int(lnc))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self[1](*args, **kwargs)


def _module(name: str, src: Any, **extra: Any) -> types.ModuleType:
    """A module object named ``name`` exposing ``src``'s public attributes plus ``extra``."""
    m = types.ModuleType(name)
    for k in dir(src):
        if not k.startswith("__"):
            setattr(m, k, getattr(src, k))
    for k, v in extra.items():
        setattr(m, k, v)
    return m


_INSTALLED: dict[str, types.ModuleType] | None = None


def emulator_modules() -> dict[str, types.ModuleType]:
    """The module objects the shim installs, keyed by the names AWS's simulator package has under ``nki``."""
    global _INSTALLED
    if _INSTALLED is not None:
        return _INSTALLED
    from vllm_trn_plugin.kernels import nki_emu
    from vllm_trn_plugin.kernels.nki_emu import dtypes, isa, language, typing

    nl = _module("nki.language", language)
    nl.dtypes = _module("nki.language.dtypes", dtypes)
    nisa = _module("nki.isa", isa)
    nisa.constants = _module("nki.isa.constants", isa)
    nt = _module("nki.typing", typing)
    ncc = types.ModuleType("nki.compiler")
    tensor = types.ModuleType("nki.tensor")
    tensor.NkiTensor = nki_emu.NkiTensor
    builtin = types.ModuleType("nki.builtin")
    nki = _module(
        "nki",
        nki_emu,
        language=nl,
        isa=nisa,
        typing=nt,
        compiler=ncc,
        tensor=tensor,
        builtin=builtin,
        dtype=str,
        cpu_simulate=_CpuSimulate,
    )
    # A module object has no file; name the emulator's, so that kernels/nki_shim.py never takes this alias for the
    # genuine package (it rejects candidates whose file lies in nki_emu).
    nki.__file__ = nki_emu.__file__
    _INSTALLED = {
        "": nki,
        ".language": nl,
        ".language.dtypes": nl.dtypes,
        ".isa": nisa,
        ".isa.constants": nisa.constants,
        ".typing": nt,
        ".compiler": ncc,
        ".tensor": tensor,
        ".builtin": builtin,
    }
    return _INSTALLED


def _neuron_dtypes() -> types.ModuleType:
    """A stand-in for AWS's ``neuron_dtypes`` package (imported by nki-library's test utilities; not on PyPI):
    ``static_cast`` (a value cast through NumPy / ml_dtypes, round to nearest even: the real package's rounding is
    UNCONFIRMED), ``sizeinbytes``, ``is_float_type``, ``finfo``, ``bfloat16`` and the packed x4 type names."""
    import ml_dtypes

    m = types.ModuleType("neuron_dtypes")
    m.bfloat16 = ml_dtypes.bfloat16
    m.float8_e4m3fn_x4, m.float8_e5m2_x4, m.float4_e2m1fn_x4 = "float8_e4m3fn_x4", "float8_e5m2_x4", "float4_e2m1fn_x4"
    m.static_cast = lambda x, dtype: np.asarray(x).astype(np.dtype(dtype))
    m.sizeinbytes = lambda dtype: np.dtype(dtype).itemsize
    m.is_float_type = lambda dtype: np.dtype(dtype).kind == "f" or "float" in str(np.dtype(dtype))
    m.finfo = ml_dtypes.finfo
    return m


def install(simulator_names: bool = True) -> None:
    """Put the emulator under ``nki`` / ``nki.language`` / ``nki.isa`` / ... (what the kernels import) and, with
    ``simulator_names``, under ``nki_cpu_simulator.nki...`` (what AWS's ``simulation_setup`` imports); put the
    snapshot's ``src`` (for ``nkilib_src``) and its root (for AWS's ``test`` package) on ``sys.path``."""
    mods = emulator_modules()
    for suffix, m in mods.items():
        sys.modules["nki" + suffix] = m
    if simulator_names:
        root = types.ModuleType("nki_cpu_simulator")
        root.nki = mods[""]
        sys.modules["nki_cpu_simulator"] = root
        for suffix, m in mods.items():
            sys.modules["nki_cpu_simulator.nki" + suffix] = m
    try:
        import neuron_dtypes  # noqa: F401 - AWS's own package, where installed
    except ImportError:
        sys.modules["neuron_dtypes"] = _neuron_dtypes()
    # router_topk imports the legacy path ``neuronxcc.nki.typing`` (the compiler's copy), which AWS's simulation
    # setup does not alias: give it the emulator's typing module too.
    for name in ("neuronxcc", "neuronxcc.nki"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["neuronxcc.nki.typing"] = mods[".typing"]
    d = library_dir()
    for p in (str(d / "src"), str(d)):
        if p not in sys.path:
            sys.path.insert(0, p)


_OWNED_PREFIXES = ("nki", "nki_cpu_simulator", "neuron_dtypes", "neuronxcc", "nkilib_src", "test")


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """``install()`` plus ``patch_library_bugs()`` for the duration of the block; afterwards the ``nki*`` aliases, the
    snapshot's modules (``nkilib_src``, its ``test`` package) and its ``sys.path`` entries are removed again, so that
    the rest of a pytest session sees neither (``nki`` would otherwise shadow the genuine-package probe of
    kernels/nki_shim.py, and AWS's ``test`` package the standard library's)."""
    before_mods = set(sys.modules)
    before_path = list(sys.path)
    saved = {k: sys.modules[k] for k in before_mods if k.split(".")[0] in _OWNED_PREFIXES}
    try:
        install()
        patch_library_bugs()
        yield
    finally:
        for k in list(sys.modules):
            if k.split(".")[0] in _OWNED_PREFIXES and (k not in before_mods or sys.modules[k] is not saved.get(k)):
                del sys.modules[k]
        sys.modules.update(saved)
        sys.path[:] = before_path


def run_kernel(kernel: Any, inputs: dict[str, Any], lnc: int = 1) -> list[np.ndarray]:
    """Run ``kernel`` (an nki-library ``@nki.jit`` function, imported after ``install()``) on NumPy inputs at
    LNC=``lnc`` in the emulator, as AWS's ``simulate_kernel`` does; its outputs as a list."""
    cleaned = {k.removesuffix(".must_alias_input"): v for k, v in inputs.items()}
    out = mods_nki().cpu_simulate(kernel)[lnc](**cleaned)
    if out is None:
        return []
    return list(out) if isinstance(out, (list, tuple)) else [out]


def mods_nki() -> Any:
    return emulator_modules()[""]


def patch_library_bugs() -> list[str]:
    """Work around defects of the snapshot itself that stop a kernel in any Python runtime; returns what was patched.

    - ``MLPTKGConstantsDimensionSizes`` (core/mlp/mlp_tkg/mlp_tkg_constants.py) declares the dataclass field
      ``remainderIFused`` without a default, and ``calculate_constants`` never passes it (nor is it read anywhere):
      constructing it raises ``TypeError: __init__() missing 1 required positional argument: 'remainderIFused'``, which
      stops every MLP-TKG-based kernel (moe_tkg's selective and all-expert paths). The generated ``__init__`` is given
      ``None`` defaults from that field on (every later field is passed by keyword)."""
    patched = []
    from nkilib_src.nkilib.core.mlp.mlp_tkg import mlp_tkg_constants as c

    cls = c.MLPTKGConstantsDimensionSizes
    names = list(cls.__dataclass_fields__)
    if "remainderIFused" in names:
        tail = len(names) - names.index("remainderIFused")
        if len(cls.__init__.__defaults__ or ()) < tail:
            cls.__init__.__defaults__ = (None,) * tail
            patched.append("MLPTKGConstantsDimensionSizes.remainderIFused default")
    return patched
