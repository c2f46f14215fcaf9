"""The one error type of `vllm-trn gate`."""

from __future__ import annotations


class GateError(Exception):
    """Bad input or an unusable source (unreachable endpoint, tokenizer mismatch, text too short, no prompt
    logprobs). The command line prints its message and exits 2, writing no report: a gate that could not measure
    everything must never be read as a pass."""
