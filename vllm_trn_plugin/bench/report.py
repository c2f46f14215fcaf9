"""Statistics of a load point, side-by-side ratios, and the JSON / CSV / PNG outputs.

Percentiles interpolate linearly between order statistics (Hyndman-Fan type 7: numpy's and
`vllm bench serve`'s default); std is the population std (ddof 0), as numpy's and vLLM's.
Throughputs divide by the wall time the target was under load (first send to last completion).
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from vllm_trn_plugin.bench.client import RequestResult

PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
THROUGHPUTS = ("request_throughput", "output_throughput", "total_token_throughput")


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) with linear interpolation: rank (n-1)p/100 between order statistics."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} outside [0, 100]")
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def describe(values: Sequence[float], percentiles: Iterable[float] = PERCENTILES) -> dict[str, float]:
    """n, mean, std (population), min, max and the percentiles (keys p50, p90, ...) of `values`."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan} | {
            f"p{p:g}": math.nan for p in percentiles
        }
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / n)
    out = {"n": n, "mean": mean, "std": std, "min": min(values), "max": max(values)}
    return out | {f"p{p:g}": percentile(values, p) for p in percentiles}


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


def write_json(path: Path, payload: dict[str, Any]) -> None:
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
# PNG line charts with Pillow (a vLLM dependency, so no plotting library is needed).

_COLORS = [
    (31, 119, 180),
    (214, 39, 40),
    (44, 160, 44),
    (255, 127, 14),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
]


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0, 1.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    ticks = [round(math.floor(lo / step) * step, 10)]
    while ticks[-1] < hi:
        ticks.append(round(ticks[-1] + step, 10))
    return ticks


def line_chart(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: dict[str, list[tuple[float, float]]],
    styles: dict[str, tuple[int, bool]] | None = None,
    size: tuple[int, int] = (900, 540),
) -> None:
    """Write a PNG line chart of `series` (name -> [(x, y), ...]); NaN points are skipped. `styles`
    gives a series its (color index, dashed); by default each series gets the next color, solid."""
    from PIL import Image, ImageDraw, ImageFont

    w, h = size
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    font, small, big = (ImageFont.load_default(size=s) for s in (15, 13, 18))
    left, right, top, bottom = 90, 210, 50, 70
    pts = [(x, y) for s in series.values() for x, y in s if math.isfinite(x) and math.isfinite(y)]
    xs = [p[0] for p in pts] or [0.0, 1.0]
    ys = [p[1] for p in pts] or [0.0, 1.0]
    xt = _nice_ticks(min(xs), max(xs))
    yt = _nice_ticks(min(0.0, min(ys)), max(ys))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]

    def px(x: float, y: float) -> tuple[float, float]:
        return (
            left + (x - x0) / ((x1 - x0) or 1) * (w - left - right),
            h - bottom - (y - y0) / ((y1 - y0) or 1) * (h - top - bottom),
        )

    for t in yt:
        _, y = px(x0, t)
        d.line([(left, y), (w - right, y)], fill=(225, 225, 225))
        d.text((left - 8, y), f"{t:g}", fill="black", font=small, anchor="rm")
    for t in xt:
        x, _ = px(t, y0)
        d.line([(x, top), (x, h - bottom)], fill=(235, 235, 235))
        d.text((x, h - bottom + 8), f"{t:g}", fill="black", font=small, anchor="mt")
    d.rectangle([left, top, w - right, h - bottom], outline="black")
    d.text(((left + w - right) / 2, 15), title, fill="black", font=big, anchor="mt")
    d.text(((left + w - right) / 2, h - 25), xlabel, fill="black", font=font, anchor="mm")
    label_img = Image.new("RGBA", (h, 30), (255, 255, 255, 0))
    ImageDraw.Draw(label_img).text((h / 2, 15), ylabel, fill="black", font=font, anchor="mm")
    img.paste(label_img.rotate(90, expand=True), (10, 0), label_img.rotate(90, expand=True))
    for k, (name, s) in enumerate(series.items()):
        ci, dashed = (styles or {}).get(name, (k, False))
        color = _COLORS[ci % len(_COLORS)]
        p = [px(x, y) for x, y in sorted(s) if math.isfinite(x) and math.isfinite(y)]
        _polyline(d, p, color, dashed)
        for x, y in p:
            box = [x - 4, y - 4, x + 4, y + 4]
            d.ellipse(box, fill="white" if dashed else color, outline=color, width=2)
        ly = top + 10 + 22 * k
        _polyline(d, [(w - right + 12, ly), (w - right + 42, ly)], color, dashed)
        d.text((w - right + 48, ly), name, fill="black", font=small, anchor="lm")
    img.save(path)


def _polyline(d: Any, p: list[tuple[float, float]], color: tuple[int, int, int], dashed: bool) -> None:
    if len(p) < 2:
        return
    if not dashed:
        d.line(p, fill=color, width=3)
        return
    for (xa, ya), (xb, yb) in zip(p, p[1:]):
        n = max(1, int(math.hypot(xb - xa, yb - ya) // 8))
        for i in range(0, n, 2):  # 8 px on, 8 px off
            t0, t1 = i / n, min(i + 1, n) / n
            d.line(
                [(xa + (xb - xa) * t0, ya + (yb - ya) * t0), (xa + (xb - xa) * t1, ya + (yb - ya) * t1)],
                fill=color,
                width=3,
            )


def plot_points(out_dir: Path, points: Sequence[dict[str, Any]], xlabel: str) -> list[Path]:
    """latency.png (TTFT, TPOT, ITL percentiles vs load), e2e_latency.png, throughput.png (output tokens/s)
    and requests.png (requests/s): one color per statistic, solid for the first target, dashed for the
    second."""
    targets = list(dict.fromkeys(pt["target"] for pt in points))
    charts: dict[str, dict[str, list[tuple[float, float]]]] = {"lat": {}, "e2e": {}, "tput": {}, "rps": {}}
    styles: dict[str, tuple[int, bool]] = {}
    stats = [("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"), ("tpot_ms", "p99"), ("itl_ms", "p99")]
    for pt in points:
        s, x, ti = pt["summary"], pt["x"], targets.index(pt["target"])
        tag = f"{pt['target']} " if len(targets) > 1 else ""

        def add(chart: str, name: str, color: int, y: float, ti: int = ti, tag: str = tag, x: float = x) -> None:
            charts[chart].setdefault(tag + name, []).append((x, y))
            styles[tag + name] = (color, ti > 0)

        for c, (metric, stat) in enumerate(stats):
            add("lat", f"{metric[:-3].upper()} {stat}", c, s[metric][stat])
        for c, stat in enumerate(("p50", "p99")):
            add("e2e", f"E2E {stat}", c, s["e2el_ms"][stat] / 1e3)
        add("tput", "output tok/s", 0, s["output_throughput"])
        add("rps", "requests/s", 0, s["request_throughput"])
    files = [out_dir / "latency.png", out_dir / "e2e_latency.png", out_dir / "throughput.png", out_dir / "requests.png"]
    line_chart(files[0], "Token latency vs load", xlabel, "milliseconds", charts["lat"], styles)
    line_chart(files[1], "End-to-end latency vs load", xlabel, "seconds", charts["e2e"], styles)
    line_chart(files[2], "Output throughput vs load", xlabel, "output tokens / s", charts["tput"], styles)
    line_chart(files[3], "Request throughput vs load", xlabel, "requests / s", charts["rps"], styles)
    return files
