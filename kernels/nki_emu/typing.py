"""``nki.typing`` of the emulator: the tensor annotation names nki-library's kernels use (``nt.tensor``,
``nt.mutable_tensor``) [L-ACTE, L-RMSQ: ``import nki.typing as nt``]. The 0.6 API stubs do not document this module
(aws-neuron/aws-neuron-sdk @ 81ce03ae); in the emulator both names are the tensor class, for annotations only (a
"mutable" argument is one the kernel may write, which every HBM argument already is here: written arguments are
copied back to the caller [SIM]). UNCONFIRMED beyond that use."""

from __future__ import annotations

from .memory import NkiTensor

tensor = NkiTensor
mutable_tensor = NkiTensor

__all__ = ["mutable_tensor", "tensor"]
