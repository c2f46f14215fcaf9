"""When two greedy runs of one prompt count as the same: the tie rule.

Greedy decoding takes the largest logit. Where the two largest are nearly equal, a run in another batch
(other matrix shapes, other chunk boundaries, other rounding) may take the other one, and from there the
two paths part for good. So two runs agree when their tokens are equal, or when they part at a step
where the top-2 logprob margin is under a tolerance (a near-tie: either token is right); every step
before it must match exactly. The soak's stream judgement and the tests' greedy comparisons both use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Nats. float32 logits round at ~1e-6: a margin under 1e-3 is a tie.
TIE_MARGIN = 1e-3
# By served dtype. bf16 logits are spaced 2^-5 to 2^-4 apart at the demos' logit magnitudes, so a batched
# run's chosen-token logprob may move by a few of those steps against a run alone.
TIE_MARGIN_BY_DTYPE = {"float32": TIE_MARGIN, "bfloat16": 0.125}


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first step where `a` and `b` differ; when one is a strict prefix of the other, the shorter length;
    None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class Agreement:
    """How a run compares with a reference run: `step`, the first step where they part (None: equal);
    `tie`, they part at a near-tie."""

    step: int | None
    tie: bool = False

    @property
    def ok(self) -> bool:
        return self.step is None or self.tie


def compare_greedy(
    got: Sequence[int],
    want: Sequence[int],
    want_margins: Sequence[float],
    tol: float = TIE_MARGIN,
    got_margins: Sequence[float] | None = None,
) -> Agreement:
    """`got` against the reference `want`. `want_margins[j]`: the reference's top-1 minus top-2 logprob at
    step j. `got_margins[j]`, where the other run's logprobs are known: its logprob of its own pick minus
    its logprob of the reference's pick at step j (both runs must then have seen a near-tie). A step
    with no margin known is no tie."""
    j = first_divergence(got, want)
    if j is None:
        return Agreement(None)

    def near(margins: Sequence[float]) -> bool:
        return j < len(margins) and margins[j] < tol

    return Agreement(j, near(want_margins) and (got_margins is None or near(got_margins)))
