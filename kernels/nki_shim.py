"""One import for NKI kernels: the genuine NKI 0.6 package when it is installed, the emulator otherwise.

Kernels do ``from vllm_trn_plugin.kernels.nki_shim import nki, nl, nisa`` and are written once in real
NKI syntax. ``USING_EMULATOR`` says which one was picked. ``simulate(kernel)`` is ``nki.simulate``
with the real package (CPU simulator shipped in the wheel; documented, not runnable here) and the
emulator's ``simulate`` otherwise: both take torch tensors and return torch tensors, and in-place
writes to input HBM tensors land in the caller's tensors [SIM] (tags: the sources in docs/nki.md).

Importing this module imports the emulator when the genuine package is missing: the dispatch imports it
only when a kernel may run (``VLLM_TRN_KERNELS=emulate`` or ``nki``, or ``auto`` with tensors on a Neuron
device).

The PyPI name ``nki`` is an empty placeholder: a candidate counts as genuine only if it has
``jit``, ``simulate``, ``language.ndarray`` and ``isa.nc_matmul`` / ``isa.dma_copy``; any exception while
importing or probing it selects the emulator.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def genuine_nki() -> tuple[ModuleType, ModuleType, ModuleType] | None:
    """(nki, nki.language, nki.isa) of the genuine NKI package, or None (not installed, or the placeholder)."""
    try:
        import nki as real_nki  # type: ignore[import-not-found]
        import nki.isa as real_isa  # type: ignore[import-not-found]
        import nki.language as real_nl  # type: ignore[import-not-found]

        if not (
            callable(getattr(real_nki, "jit", None))
            and callable(getattr(real_nki, "simulate", None))
            and callable(getattr(real_nl, "ndarray", None))
            and callable(getattr(real_isa, "nc_matmul", None))
            and callable(getattr(real_isa, "dma_copy", None))
        ):
            return None
        if getattr(real_nki, "__file__", "") and "nki_emu" in str(real_nki.__file__):
            return None
        return real_nki, real_nl, real_isa
    except Exception:  # noqa: BLE001 - any failure means "not the genuine package"
        return None


_real = genuine_nki()
USING_EMULATOR: bool = _real is None

if _real is not None:
    nki, nl, nisa = _real
    simulate: Any = nki.simulate
else:
    from . import nki_emu as nki  # type: ignore[no-redef]
    from .nki_emu import isa as nisa  # type: ignore[no-redef]
    from .nki_emu import language as nl  # type: ignore[no-redef]

    simulate = nki.simulate

__all__ = ["USING_EMULATOR", "nisa", "nki", "nl", "simulate"]
