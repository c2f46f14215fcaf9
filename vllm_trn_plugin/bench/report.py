"""Statistics of a load point, side-by-side ratios, and the JSON / CSV / PNG outputs.

Statistics are numpy's, as in `vllm bench serve`: percentiles interpolate linearly between order statistics,
std is the population std (ddof 0). Throughputs divide by the wall time the target was under load (first
send to last completion). `sweep_record` writes a point in `vllm bench serve`'s result keys, so that
`vllm bench sweep plot` reads the bench's results.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vllm_trn_plugin.bench.client import RequestResult
from vllm_trn_plugin.bench.runner import Load

PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
THROUGHPUTS = ("request_throughput", "output_throughput", "total_token_throughput")


def describe(values: Sequence[float], percentiles: Iterable[float] = PERCENTILES) -> dict[str, float]:
    """n, mean, std (population), min, max and the percentiles (keys p50, p90, ...) of `values`."""
    ps = list(percentiles)
    if len(values) == 0:
        return {"n": 0, "mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan} | {
            f"p{p:g}": math.nan for p in ps
        }
    a = np.asarray(values, dtype=np.float64)
    out = {"n": len(a), "mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()), "max": float(a.max())}
    return out | {f"p{p:g}": float(q) for p, q in zip(ps, np.percentile(a, ps))}


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """Counts, throughputs and latency distributions (milliseconds) of one target at one load point."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "errors": dict(Counter(r.error.split("\n")[0][:120] for r in failed).most_common(5)),
        "duration_s": duration_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "streamed_fraction": sum(r.chunks > 1 for r in ok) / len(ok) if ok else 0.0,
        "mean_chunks_per_request": sum(r.chunks for r in ok) / len(ok) if ok else 0.0,
        "ttft_ms": describe([r.ttft * 1e3 for r in ok]),
        "tpot_ms": describe([t * 1e3 for t in tpots]),
        "itl_ms": describe([x * 1e3 for r in ok for x in r.itl]),
        "e2el_ms": describe([r.latency * 1e3 for r in ok]),
    }


def flatten(summary: dict[str, Any]) -> dict[str, Any]:
    """One flat row: scalar metrics as they are, distributions as `ttft_ms_p50`, `ttft_ms_mean`, ..."""
    row: dict[str, Any] = {}
    for k, v in summary.items():
        if k == "errors":
            row[k] = "; ".join(f"{n}x {msg}" for msg, n in v.items())
        elif isinstance(v, dict):
            row.update({f"{k}_{s}": x for s, x in v.items() if s != "n"})
        else:
            row[k] = v
    return row


def ratios(b: dict[str, Any], a: dict[str, Any]) -> dict[str, float]:
    """B / A for every throughput and every latency statistic (a ratio < 1 on latency means B is faster)."""
    fa, fb = flatten(a), flatten(b)
    keys = [k for k in fa if k in THROUGHPUTS or k.startswith(LATENCIES)]
    return {k: (fb[k] / fa[k] if fa[k] not in (0, None) and not math.isnan(fa[k]) else math.nan) for k in keys}


def _clean(x: Any) -> Any:
    """JSON has no NaN: write null."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def write_json(path: Path, payload: dict[str, Any] | list[dict[str, Any]]) -> None:
    path.write_text(json.dumps(_clean(payload), indent=2) + "\n")


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()})


def format_table(points: Sequence[dict[str, Any]]) -> str:
    """A fixed-width text table: one line per (load point, target)."""
    head = (
        f"{'load':>26} {'target':>8} {'ok':>5} {'err':>4} {'req/s':>7} {'out tok/s':>9} "
        f"{'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'E2E p50':>9} {'p99':>9}"
    )
    lines = [head, "-" * len(head)]
    for pt in points:
        s = pt["summary"]

        def ms(metric: str, stat: str, w: int, s: dict[str, Any] = s) -> str:
            v = s[metric][stat]
            return f"{v:>{w}.1f}" if v == v else f"{'-':>{w}}"

        lines.append(
            f"{pt['load']:>26} {pt['target']:>8} {s['completed']:>5} {s['failed']:>4} "
            f"{s['request_throughput']:>7.2f} {s['output_throughput']:>9.1f} "
            f"{ms('ttft_ms', 'p50', 9)} {ms('ttft_ms', 'p99', 8)} {ms('tpot_ms', 'p50', 9)} {ms('tpot_ms', 'p99', 8)} "
            f"{ms('itl_ms', 'p50', 8)} {ms('itl_ms', 'p99', 8)} {ms('e2el_ms', 'p50', 9)} {ms('e2el_ms', 'p99', 9)}"
        )
    return "\n".join(lines) + "\n(latencies in ms)"


def format_ratios(rows: Sequence[dict[str, Any]], b: str, a: str) -> str:
    keys = ["output_throughput", "request_throughput", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99"]
    keys += ["itl_ms_p50", "itl_ms_p99", "e2el_ms_p50", "e2el_ms_p99"]
    head = f"{'load':>26} " + " ".join(f"{k:>12}" for k in keys)
    lines = [f"ratios {b} / {a} (throughput > 1 or latency < 1: {b} better)", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['load']:>26} " + " ".join(f"{r['ratios'].get(k, math.nan):>12.3f}" for k in keys))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# `vllm bench serve`'s result keys, for `vllm bench sweep plot`


def sweep_record(
    summary: dict[str, Any], load: Load, target: str, model: str | None, num_prompts: int
) -> dict[str, Any]:
    """A `summarize` result of one target at one load point as a `vllm bench serve` result: its metric keys
    (`median_ttft_ms`, `p99_itl_ms`, `output_throughput`, ...) and traffic keys (`request_rate`, `max_concurrency`),
    plus the bench's own: `target`, `load` (its label) and `batch_size`."""
    s = summary
    value: float | int = int(load.value) if float(load.value).is_integer() else load.value
    rec: dict[str, Any] = {
        "backend": "openai",
        "label": target,
        "target": target,
        "model_id": model,
        "num_prompts": num_prompts,
        "load": load.label,
        "request_rate": value if load.kind == "rate" else math.inf,
        "burstiness": load.burstiness,
        "max_concurrency": value if load.kind == "concurrency" else load.max_concurrency,
        "batch_size": value if load.kind == "batch" else None,
        "duration": s["duration_s"],
        "completed": s["completed"],
        "failed": s["failed"],
        "total_input_tokens": s["input_tokens"],
        "total_output_tokens": s["output_tokens"],
        "request_throughput": s["request_throughput"],
        "output_throughput": s["output_throughput"],
        "total_token_throughput": s["total_token_throughput"],
        "run_number": 0,
    }
    for metric in LATENCIES:
        d, name = s[metric], metric.removesuffix("_ms")
        rec |= {f"mean_{name}_ms": d["mean"], f"median_{name}_ms": d["p50"], f"std_{name}_ms": d["std"]}
        rec |= {f"p{p:g}_{name}_ms": d[f"p{p:g}"] for p in PERCENTILES}
    if math.isinf(rec["request_rate"]):
        rec["request_rate"] = "inf"  # as vLLM writes it; `sweep plot` reads it back as a float
    return rec


# ---------------------------------------------------------------------------------------------------
# Plots (matplotlib, the `bench` extra)

# file, title, y label, [(series, summary key, statistic or None, scale)]: one color per series, solid for the
# first target, dashed for the second.
CHARTS = (
    (
        "latency.png",
        "Token latency vs load",
        "milliseconds",
        [
            ("TTFT p50", "ttft_ms", "p50", 1.0),
            ("TTFT p99", "ttft_ms", "p99", 1.0),
            ("TPOT p50", "tpot_ms", "p50", 1.0),
            ("TPOT p99", "tpot_ms", "p99", 1.0),
            ("ITL p99", "itl_ms", "p99", 1.0),
        ],
    ),
    (
        "e2e_latency.png",
        "End-to-end latency vs load",
        "seconds",
        [("E2E p50", "e2el_ms", "p50", 1e-3), ("E2E p99", "e2el_ms", "p99", 1e-3)],
    ),
    (
        "throughput.png",
        "Output throughput vs load",
        "output tokens / s",
        [("output tok/s", "output_throughput", None, 1.0)],
    ),
    ("requests.png", "Request throughput vs load", "requests / s", [("requests/s", "request_throughput", None, 1.0)]),
)


def check_plotting() -> None:
    """Fail early, with what to install, where matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "the plots need matplotlib: pip install 'vllm-trn-plugin[bench]', or pass --no-plots"
        ) from None


def plot_points(out_dir: Path, points: Sequence[dict[str, Any]], xlabel: str) -> list[Path]:
    """latency.png (TTFT, TPOT, ITL percentiles vs load), e2e_latency.png, throughput.png (output tokens/s)
    and requests.png (requests/s)."""
    from matplotlib.figure import Figure

    targets = list(dict.fromkeys(pt["target"] for pt in points))
    files = []
    for name, title, ylabel, series in CHARTS:
        fig = Figure(figsize=(9, 5.4))
        ax = fig.add_subplot()
        for color, (label, key, stat, scale) in enumerate(series):
            for ti, target in enumerate(targets):
                xy = sorted(
                    (pt["x"], (pt["summary"][key] if stat is None else pt["summary"][key][stat]) * scale)
                    for pt in points
                    if pt["target"] == target
                )
                ax.plot(
                    [x for x, _ in xy],
                    [y for _, y in xy],
                    color=f"C{color}",
                    linestyle="--" if ti else "-",
                    marker="o",
                    markerfacecolor="white" if ti else None,
                    label=f"{target} {label}" if len(targets) > 1 else label,
                )
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5))
        files.append(out_dir / name)
        fig.savefig(files[-1], bbox_inches="tight", dpi=100)
    return files
