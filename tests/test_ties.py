"""The tie rule for comparing two greedy runs (`vllm_trn_plugin.gate.ties`) on hand-made token paths, and the
soak's stream judgement built on it (`vllm_trn_plugin.bench.soak.judge`) on hand-made streams."""

from __future__ import annotations

import pytest

from vllm_trn_plugin.bench.soak import Stream, judge
from vllm_trn_plugin.gate.ties import TIE_MARGIN, compare_greedy, first_divergence

WANT = [5, 6, 7, 8]
# Reference top-1 minus top-2 logprob at each step: a clear pick at steps 0, 1 and 3, a near-tie at step 2.
MARGINS = [2.0, 0.5, TIE_MARGIN / 4, 1.0]


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 9, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # a strict prefix parts where it ends
    assert first_divergence([], []) is None


def test_equal_paths_agree() -> None:
    a = compare_greedy(WANT, WANT, MARGINS)
    assert a.ok and a.step is None


def test_divergence_after_a_near_tie_passes() -> None:
    a = compare_greedy([5, 6, 9, 4], WANT, MARGINS)  # parts at the near-tie; what follows may differ
    assert a.ok and a.tie and a.step == 2


@pytest.mark.parametrize("got,step", [([5, 9, 7, 8], 1), ([5, 6, 7, 9], 3), ([4, 6, 7, 8], 0)])
def test_divergence_after_a_clear_margin_fails(got: list[int], step: int) -> None:
    a = compare_greedy(got, WANT, MARGINS)
    assert not a.ok and not a.tie and a.step == step


def test_margin_at_the_tolerance_is_no_tie() -> None:
    assert not compare_greedy([9], [5], [TIE_MARGIN]).ok
    assert compare_greedy([9], [5], [0.9 * TIE_MARGIN]).ok
    assert compare_greedy([9], [5], [0.1], tol=0.125).ok  # a looser tolerance (bf16)


def test_both_runs_must_see_the_near_tie_when_both_margins_are_known() -> None:
    got = [5, 6, 9, 4]
    assert compare_greedy(got, WANT, MARGINS, got_margins=[0.0, 0.0, TIE_MARGIN / 2, 0.0]).ok
    assert not compare_greedy(got, WANT, MARGINS, got_margins=[0.0, 0.0, 0.3, 0.0]).ok  # a clear pick in `got`
    assert not compare_greedy([5, 6, 9], WANT[:3], MARGINS[:2]).ok  # no margin known at the step: no tie


def _stream(tokens: list[int], top: list[dict[int, float]], **kw: object) -> Stream:
    s = Stream(index=0, prompt=0, tokens=tokens, top=top, finish_reason="length", done=True)
    s.usage_tokens = len(tokens)
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def test_soak_judgement_of_streams() -> None:
    # Alone: a near-tie at position 1 (7 vs 8 within 1e-4 nats), a clear pick elsewhere.
    ref = _stream([3, 7, 2], [{3: -0.1, 4: -3.0}, {7: -0.69310, 8: -0.69320}, {2: -0.2, 1: -2.5}])
    assert judge(ref, ref, 3, TIE_MARGIN) == "correct"
    # The batched run took 8 at the tie, seeing the same near-equal pair: a tie.
    tie = _stream([3, 8, 5], [{3: -0.1, 4: -3.0}, {8: -0.69312, 7: -0.69318}, {5: -0.3, 6: -2.0}])
    assert judge(tie, ref, 3, TIE_MARGIN) == "tie"
    # Took 8 with a clear margin over 7 in its own logprobs: wrong, though alone saw a near-tie.
    far = _stream([3, 8, 5], [{3: -0.1, 4: -3.0}, {8: -0.1, 7: -2.4}, {5: -0.3, 6: -2.0}])
    assert judge(far, ref, 3, TIE_MARGIN) == "wrong"
    # Parted at a clear pick: wrong.
    assert judge(_stream([4, 7, 2], [{4: -0.1, 3: -0.2}, {7: -0.7, 8: -0.7}, {2: -0.2}]), ref, 3, TIE_MARGIN) == "wrong"
    # Disconnected after two tokens: a prefix of alone, or not.
    assert judge(_stream([3, 7], ref.top[:2], disconnected=True, done=False), ref, 3, TIE_MARGIN) == "prefix"
    assert judge(_stream([3, 8], tie.top[:2], disconnected=True, done=False), ref, 3, TIE_MARGIN) == "prefix-tie"
    assert judge(_stream([4], [{4: -0.1, 3: -3.0}], disconnected=True), ref, 3, TIE_MARGIN) == "prefix-wrong"
    # Complete but short, counted wrong by `usage`, or with an error.
    assert judge(_stream([3, 7], ref.top[:2]), ref, 3, TIE_MARGIN) == "incomplete"
    assert judge(_stream([3, 7, 2], ref.top, usage_tokens=2), ref, 3, TIE_MARGIN) == "incomplete"
    assert judge(_stream([3, 7, 2], ref.top, finish_reason="stop"), ref, 3, TIE_MARGIN) == "incomplete"
    assert judge(_stream([], [], error="HTTP 500"), ref, 3, TIE_MARGIN) == "error"
