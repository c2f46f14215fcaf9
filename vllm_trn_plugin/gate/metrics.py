"""What the gate measures, position by position, accumulated window by window.

A *scored position* p of a window (tokens t[0..n-1]) is the prediction of t[p] from t[:p], p >= 1; its context length
is p, which is what the NLL buckets are keyed on. Each side gives, per position, the log-probability of the actual
token and its top-k (ids and log-probabilities, best first), and, for a local side, the full logits.

- Next-token agreement: candidate argmax == reference argmax, counted over positions where the reference's top-2
  margin is at least the tie margin; near-ties (margin below it, where either token is right: bench.ties) are
  counted apart.
- Logit agreement: the cosine of the *centred* logit vectors (each minus its mean), the shift-invariant cosine:
  softmax ignores a constant shift, and log-probabilities are logits shifted by log Z, so one side's logits and the
  other side's log-probabilities compare exactly. Over the full vocabulary (with the full KL(p_ref || p_cand)) when
  both sides are local; otherwise over the shared support of the two top-k sets, with KL between the two
  distributions renormalised on that support.
- NLL: mean -log p(t[p]) per bucket for each side, their difference (candidate - reference) with its standard error,
  and perplexity exp(mean NLL).
- Non-finite: a position where either side's logits or log-probabilities hold a NaN or +inf, its actual token has
  no finite log-probability, or (full logits) the cosine or KL comes out non-finite. Such a position is left out of
  every sum above (so they stay readable) and counted apart with where it was: any count fails the gate.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_trn_plugin.gate.errors import GateError
from vllm_trn_plugin.gate.ties import TIE_MARGIN

DEFAULT_BUCKETS = (0, 2048, 8192, 32768)  # context-length bucket edges, as the source document scores long context
NONFINITE_NAMED = 8  # non-finite positions named per bucket (all are counted)


@dataclass
class Scores:
    """Scored positions of one side (rows in position order).

    positions [n] int: context length of each prediction; target [n]: log-probability of the actual token;
    top_ids [n, k] / top_lp [n, k]: the k most likely tokens and their log-probabilities, best first (id -1 and
    -inf pad a row with fewer); logits [n, V] or None: full logits (or log-probabilities: see the module docstring).
    """

    positions: np.ndarray
    target: np.ndarray
    top_ids: np.ndarray
    top_lp: np.ndarray
    logits: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.positions)

    def slice(self, a: int, b: int) -> Scores:
        lg = None if self.logits is None else self.logits[a:b]
        return Scores(self.positions[a:b], self.target[a:b], self.top_ids[a:b], self.top_lp[a:b], lg)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def scores_from_logits(positions: np.ndarray, targets: np.ndarray, logits: np.ndarray, k: int) -> Scores:
    """Scores of full logits [n, V] whose rows predict `targets` [n]."""
    logits = np.asarray(logits, dtype=np.float64)
    lp = log_softmax(logits)
    k = min(k, logits.shape[1])
    top = np.argpartition(-lp, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(lp, top, 1), axis=1, kind="stable")
    top = np.take_along_axis(top, order, 1)
    target = np.take_along_axis(lp, np.asarray(targets)[:, None], 1)[:, 0]
    return Scores(np.asarray(positions), target, top, np.take_along_axis(lp, top, 1), logits)


def centred_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of a - mean(a) and b - mean(b) (float64)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    a = a - a.mean(-1, keepdims=True)
    b = b - b.mean(-1, keepdims=True)
    den = np.sqrt((a * a).sum(-1) * (b * b).sum(-1))
    return np.where(den > 0, (a * b).sum(-1) / np.where(den > 0, den, 1.0), 1.0)


def full_kl(ref_logits: np.ndarray, cand_logits: np.ndarray) -> np.ndarray:
    """Row-wise KL(p_ref || p_cand) in nats from full logits (or log-probabilities)."""
    lp, lq = log_softmax(ref_logits), log_softmax(cand_logits)
    p = np.exp(lp)
    return np.maximum((p * (lp - lq)).sum(-1), 0.0)


def topk_agreement(ref: Scores, cand: Scores) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """On the shared support S of each row's two top-k sets: (centred cosine of the two log-probability vectors on S,
    KL(p_ref|S || p_cand|S) with both renormalised on S, |S|). Rows with |S| < 2 get NaN cosine and KL (nothing to
    compare)."""
    eq = (ref.top_ids[:, :, None] == cand.top_ids[:, None, :]) & (ref.top_ids[:, :, None] >= 0)  # [n, k, k]
    shared = eq.any(2)  # [n, k] over the reference's order
    size = shared.sum(1)
    a = np.where(shared, ref.top_lp, 0.0)
    b = np.where(shared, (np.where(eq, cand.top_lp[:, None, :], 0.0)).sum(2), 0.0)
    cnt = np.maximum(size, 1)[:, None]
    ac = np.where(shared, a - a.sum(1, keepdims=True) / cnt, 0.0)
    bc = np.where(shared, b - b.sum(1, keepdims=True) / cnt, 0.0)
    den = np.sqrt((ac * ac).sum(1) * (bc * bc).sum(1))
    cos = np.where(den > 0, (ac * bc).sum(1) / np.where(den > 0, den, 1.0), 1.0)

    def renorm(x: np.ndarray) -> np.ndarray:
        m = np.where(shared, x, -np.inf).max(1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        z = np.log(np.maximum(np.where(shared, np.exp(x - m), 0.0).sum(1, keepdims=True), 1e-300))  # empty S
        return np.where(shared, x - m - z, 0.0)

    lp, lq = renorm(a), renorm(b)
    kl = np.maximum(np.where(shared, np.exp(lp) * (lp - lq), 0.0).sum(1), 0.0)
    bad = size < 2
    return np.where(bad, np.nan, cos), np.where(bad, np.nan, kl), size


def bucket_label(lo: int, hi: int) -> str:
    def k(x: int) -> str:
        return f"{x // 1024}k" if x % 1024 == 0 and x else str(x)

    return f"{k(lo)}-{k(hi)}"


@dataclass
class BucketStats:
    """Running sums over the positions of one bucket."""

    label: str
    lo: int
    hi: int
    n: int = 0
    nll_ref: float = 0.0
    nll_cand: float = 0.0
    diff_sq: float = 0.0  # sum of (nll_cand - nll_ref)^2 per position: the difference's standard error
    compared: int = 0  # positions outside near-ties
    agree: int = 0
    ties: int = 0
    tie_agree: int = 0
    cos_sum: float = 0.0
    cos_min: float = math.inf
    cos_n: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    support_sum: int = 0
    nonfinite: int = 0  # positions with a non-finite logit, log-probability or metric (left out of the sums)
    nonfinite_at: list[str] = field(default_factory=list)  # the first NONFINITE_NAMED of them

    def add(self, other: BucketStats) -> None:
        for name in ("n", "nll_ref", "nll_cand", "diff_sq", "compared", "agree", "ties", "tie_agree"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("cos_sum", "cos_n", "kl_sum", "support_sum", "nonfinite"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.cos_min = min(self.cos_min, other.cos_min)
        self.kl_max = max(self.kl_max, other.kl_max)
        self.nonfinite_at = (self.nonfinite_at + other.nonfinite_at)[:NONFINITE_NAMED]

    def summary(self) -> dict[str, Any]:
        n = max(self.n, 1)
        nr, nc = self.nll_ref / n, self.nll_cand / n
        diff = nc - nr
        var = max(self.diff_sq / n - diff * diff, 0.0)
        return {
            "bucket": self.label,
            "lo": self.lo,
            "hi": self.hi,
            "positions": self.n,
            "nll_reference": nr,
            "nll_candidate": nc,
            "nll_diff": diff,
            "nll_diff_stderr": math.sqrt(var / n) if self.n > 1 else None,
            "ppl_reference": math.exp(nr),
            "ppl_candidate": math.exp(nc),
            "agreement": self.agree / self.compared if self.compared else None,
            "compared": self.compared,
            "ties": self.ties,
            "tie_agreement": self.tie_agree / self.ties if self.ties else None,
            "cosine_mean": self.cos_sum / self.cos_n if self.cos_n else None,
            "cosine_min": self.cos_min if self.cos_n else None,
            "kl_mean": self.kl_sum / self.cos_n if self.cos_n else None,
            "kl_max": self.kl_max if self.cos_n else None,
            "support_mean": self.support_sum / self.cos_n if self.cos_n else None,
            "nonfinite": self.nonfinite,
            "nonfinite_at": list(self.nonfinite_at),
        }


@dataclass
class Accumulator:
    """Sums the per-position metrics of paired chunks into buckets; holds nothing per position."""

    edges: Sequence[int] = DEFAULT_BUCKETS
    tie_margin: float = TIE_MARGIN
    full: bool = True  # full-logit cosine / KL; False: over the shared top-k support
    buckets: list[BucketStats] = field(default_factory=list)

    def __post_init__(self) -> None:
        e = list(self.edges)
        if len(e) < 2 or any(b <= a for a, b in zip(e, e[1:])) or e[0] < 0:
            raise GateError(f"--buckets {','.join(map(str, e))}: need at least two increasing edges >= 0")
        self.buckets = [BucketStats(bucket_label(a, b), a, b) for a, b in zip(e, e[1:])]

    def add(self, ref: Scores, cand: Scores, where: str = "") -> None:
        """Accumulate one paired chunk; `where` names its window (e.g. "window 3") in the non-finite positions."""
        if not np.array_equal(ref.positions, cand.positions):
            raise GateError("internal: the two sides scored different positions")
        if self.full and (ref.logits is None or cand.logits is None):
            raise GateError("internal: full-logit metrics without full logits")
        tie = (ref.top_lp[:, 0] - ref.top_lp[:, 1]) < self.tie_margin
        agree = ref.top_ids[:, 0] == cand.top_ids[:, 0]
        if self.full:
            cos = centred_cosine(ref.logits, cand.logits)
            kl = full_kl(ref.logits, cand.logits)
            support = np.full(len(ref), ref.logits.shape[1])
        else:
            cos, kl, support = topk_agreement(ref, cand)
        nll_r, nll_c = -ref.target, -cand.target
        bad = ~(np.isfinite(nll_r) & np.isfinite(nll_c)) | _nonfinite_rows(ref) | _nonfinite_rows(cand)
        if self.full:
            bad |= ~(np.isfinite(cos) & np.isfinite(kl))
        which = np.searchsorted(np.asarray(self.edges), ref.positions, side="right") - 1
        for i, b in enumerate(self.buckets):
            nf = (which == i) & bad
            if nf.any():
                b.nonfinite += int(nf.sum())
                room = NONFINITE_NAMED - len(b.nonfinite_at)
                b.nonfinite_at += [f"{where + ' ' if where else ''}position {int(p)}" for p in ref.positions[nf][:room]]
            m = (which == i) & ~bad
            if not m.any():
                continue
            b.n += int(m.sum())
            b.nll_ref += float(nll_r[m].sum())
            b.nll_cand += float(nll_c[m].sum())
            b.diff_sq += float(((nll_c[m] - nll_r[m]) ** 2).sum())
            b.compared += int((m & ~tie).sum())
            b.agree += int((m & ~tie & agree).sum())
            b.ties += int((m & tie).sum())
            b.tie_agree += int((m & tie & agree).sum())
            ok = m & ~np.isnan(cos)
            if ok.any():
                b.cos_sum += float(cos[ok].sum())
                b.cos_min = min(b.cos_min, float(cos[ok].min()))
                b.cos_n += int(ok.sum())
                b.kl_sum += float(kl[ok].sum())
                b.kl_max = max(b.kl_max, float(kl[ok].max()))
                b.support_sum += int(support[ok].sum())

    def total(self) -> BucketStats:
        t = BucketStats("all", self.buckets[0].lo, self.buckets[-1].hi)
        for b in self.buckets:
            t.add(b)
        return t


def _nonfinite_rows(s: Scores) -> np.ndarray:
    """Rows holding a NaN anywhere or a +inf among the logits or top-k log-probabilities (-inf pads top-k rows)."""
    bad = np.isnan(s.top_lp).any(1) | (s.top_lp == np.inf).any(1)
    if s.logits is not None:
        bad |= ~np.isfinite(s.logits).all(1)
    return bad


def paired(ref: Iterator[Scores], cand: Iterator[Scores]) -> Iterator[tuple[Scores, Scores]]:
    """The two sides' chunks of one window cut to common stretches (each side may chunk differently), in order;
    raises GateError when one side scores fewer positions than the other."""
    a = b = None
    while True:
        if a is None or len(a) == 0:
            a = next(ref, None)
        if b is None or len(b) == 0:
            b = next(cand, None)
        if a is None or b is None:
            if (a is not None and len(a)) or (b is not None and len(b)):
                raise GateError("the reference and the candidate scored a different number of positions")
            return
        n = min(len(a), len(b))
        yield a.slice(0, n), b.slice(0, n)
        a, b = a.slice(n, len(a)), b.slice(n, len(b))


@dataclass(frozen=True)
class Thresholds:
    """What a pass needs, per bucket and overall (docs/gate.md says why each default)."""

    min_agreement: float = 0.99  # next-token agreement outside near-ties
    max_nll_diff: float = 0.01  # |mean NLL difference|, nats: twice the source document's 0.005 headline
    min_cosine: float = 0.999  # mean centred cosine of the full logits (both sides local)
    min_topk_cosine: float = 0.99  # mean centred cosine on the shared top-k support (an endpoint side)
    max_kl: float = 0.01  # mean KL(reference || candidate), nats (full, or on the shared top-k support)
    max_passkey_misses: int = 0  # passkey cells the reference retrieves and the candidate does not


def judge(summary: dict[str, Any], th: Thresholds, full: bool) -> list[str]:
    """The failed checks of one bucket's summary, each naming the metric, its value, the threshold and the bucket.
    Every comparison is written so that a NaN fails it."""
    where = f"bucket {summary['bucket']}"
    out = []
    nonfinite = summary.get("nonfinite", 0)
    if nonfinite:
        named = summary.get("nonfinite_at", [])
        more = f" and {nonfinite - len(named)} more" if nonfinite > len(named) else ""
        out.append(
            f"non-finite logits, log-probabilities or metrics at {nonfinite} position(s) ({where}): "
            f"{', '.join(named)}{more}"
        )
    if summary["positions"] == 0:
        return out
    agreement = summary["agreement"]
    if agreement is not None and not agreement >= th.min_agreement:
        out.append(
            f"next-token agreement {agreement:.4f} < {th.min_agreement} ({where}, {summary['compared']} positions "
            "outside near-ties)"
        )
    if not abs(summary["nll_diff"]) <= th.max_nll_diff:
        out.append(f"NLL difference {summary['nll_diff']:+.4f} nats exceeds +-{th.max_nll_diff} ({where})")
    min_cos, what = (th.min_cosine, "full-logit") if full else (th.min_topk_cosine, "top-k logit")
    cos = summary["cosine_mean"]
    if cos is not None and not cos >= min_cos:
        out.append(f"{what} cosine {cos:.5f} < {min_cos} ({where})")
    kl = summary["kl_mean"]
    if kl is not None and not kl <= th.max_kl:
        out.append(f"{'full' if full else 'top-k support'} KL {kl:.4g} nats > {th.max_kl} ({where})")
    return out
