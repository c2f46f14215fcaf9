"""Exceptions of the emulator.

``NkiValidationError`` is the 0.6 name for "raised when hardware constraints are violated" [ISA];
which class the real simulator raises per check is UNCONFIRMED (its docs show ``AssertionError``
[SIM]). Every check here raises a subclass of ``NkiValidationError`` whose message names the
instruction and the operand.
"""

from __future__ import annotations


class NkiValidationError(Exception):
    """A hardware or API constraint was violated (shape, buffer, dtype, size limit)."""


class PartitionLimitError(NkiValidationError):
    """An on-chip operand spans more than 128 partitions."""


class MatmulLimitError(NkiValidationError):
    """An ``nc_matmul`` / ``nc_transpose`` size or layout rule was violated."""


class MemorySpaceError(NkiValidationError):
    """An operand lives in a buffer the instruction cannot access (e.g. DMA from PSUM)."""


class CapacityError(NkiValidationError):
    """Live SBUF or PSUM allocations exceed the per-partition capacity, or a PSUM bank overflows."""


class DtypeError(NkiValidationError):
    """An operand dtype is not allowed for the instruction."""


class ShapeError(NkiValidationError):
    """Operand shapes / element counts do not match the instruction's rule."""


class OutOfBoundsError(NkiValidationError, IndexError):
    """A static view, or a dynamic index under ``oob_mode.error``, addresses outside its tensor."""


class RegisterError(NkiValidationError, TypeError):
    """A ``VirtualRegister`` was used as a Python value, or read before being written."""


class LncError(NkiValidationError):
    """An LNC launch rule was violated: the kernel's LNC degree differs from the compiler's (NCC_EVRF066 [EVRF066]),
    an unsupported degree, programs that return different outputs, or a cross-core operation (``core_barrier``,
    ``sendrecv``) that the other program never reaches."""


class LoopBodyError(NkiValidationError):
    """A compiled loop (``nl.fori_loop``) whose iterations emit different instruction sequences: the compiler traces
    the body once [CF], so a body whose instructions depend on Python state that changes per iteration cannot be a
    compiled loop."""
