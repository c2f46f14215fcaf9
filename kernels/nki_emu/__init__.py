"""A NumPy emulator of the NKI 0.6 subset the project's kernels use (the real ``nki`` wheel and its
simulator are not installable here).

Use it through ``vllm_trn_plugin.kernels.nki_shim`` (``nki``, ``nl``, ``nisa``, ``simulate``), which
picks the genuine package when present. Layout: ``language`` (= ``nki.language``), ``isa``
(= ``nki.isa``), ``memory`` (buffers, views, allocation accounting, counters), ``dtypes`` (casts),
``ops`` (ALU and activation tables), ``runtime`` (``jit``, ``simulate``, torch/NumPy conversion).
Semantics follow /work/shared/notes/nki-0.6-reference.md; docstrings cite its tags.
"""

from __future__ import annotations

from . import isa, language
from .errors import (
    CapacityError,
    DtypeError,
    MatmulLimitError,
    MemorySpaceError,
    NkiValidationError,
    OutOfBoundsError,
    PartitionLimitError,
    RegisterError,
    ShapeError,
)
from .memory import Counters, NkiTensor, VirtualRegister
from .runtime import Kernel, Simulated, jit, last_counters, simulate

__all__ = [
    "CapacityError",
    "Counters",
    "DtypeError",
    "Kernel",
    "MatmulLimitError",
    "MemorySpaceError",
    "NkiTensor",
    "NkiValidationError",
    "OutOfBoundsError",
    "PartitionLimitError",
    "RegisterError",
    "ShapeError",
    "Simulated",
    "VirtualRegister",
    "isa",
    "jit",
    "language",
    "last_counters",
    "simulate",
]
