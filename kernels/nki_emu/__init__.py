"""A NumPy emulator of the NKI 0.6 subset the project's kernels use (the real ``nki`` wheel and its
simulator are not installable here).

Use it through ``vllm_trn_plugin.kernels.nki_shim`` (``nki``, ``nl``, ``nisa``, ``simulate``), which
picks the genuine package when present. Layout: ``language`` (= ``nki.language``), ``isa``
(= ``nki.isa``), ``memory`` (buffers, views, allocation accounting, counters, emitted-instruction tracing),
``dtypes`` (casts), ``ops`` (ALU and activation tables, the numerics model ``numerics``), ``cost`` (DMA descriptors and
time), ``lnc`` (``core_barrier``, ``sendrecv``), ``runtime`` (``jit``, ``simulate``, LNC launches, torch/NumPy
conversion), ``errors`` (what the checks raise). The semantics follow docs/nki.md; docstrings cite its source tags.
Nothing on the serving path imports this package unless ``VLLM_TRN_KERNELS=emulate`` asks for it.
"""

from __future__ import annotations

from . import errors, isa, language, lnc
from .memory import Counters, NkiTensor, VirtualRegister
from .ops import Numerics, numerics
from .runtime import Kernel, Simulated, jit, last_counters, simulate

__all__ = [
    "Counters",
    "Kernel",
    "NkiTensor",
    "Numerics",
    "Simulated",
    "VirtualRegister",
    "errors",
    "isa",
    "jit",
    "language",
    "last_counters",
    "lnc",
    "numerics",
    "simulate",
]
