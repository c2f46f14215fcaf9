"""The gate's report: JSON, a human-readable table, and a plot (NLL difference by position bucket, passkey grid)
when matplotlib is installed (the `bench` extra)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(report: dict[str, Any]) -> str:
    """The verdict, the metrics by bucket, the passkey grid and the failures, as plain text."""
    r, c = report["reference"], report["candidate"]
    lines = [
        f"reference: {r['kind']} {r['spec']}",
        f"candidate: {c['kind']} {c['spec']}",
        f"text: {report['text']['tokens']} tokens, {report['text']['windows']} window(s) of up to "
        f"{report['text']['window']}; logit agreement: {report['logit_metric']}; tie margin {report['tie_margin']}",
        "",
        f"{'bucket':>10} {'positions':>9} {'NLL ref':>8} {'NLL cand':>8} {'diff':>9} {'+-':>7} {'PPL ref':>8} "
        f"{'PPL cand':>8} {'agree':>7} {'ties':>5} {'cosine':>8} {'KL':>9}",
    ]
    rows = [*report["buckets"], report["overall"]] + ([report["decode"]] if report.get("decode") else [])
    for s in rows:
        lines.append(
            f"{s['bucket']:>10} {s['positions']:>9} {s['nll_reference']:>8.4f} {s['nll_candidate']:>8.4f} "
            f"{s['nll_diff']:>+9.5f} {_f(s['nll_diff_stderr'], '.5f'):>7} {s['ppl_reference']:>8.3f} "
            f"{s['ppl_candidate']:>8.3f} {_f(s['agreement'], '.4f'):>7} {s['ties']:>5} "
            f"{_f(s['cosine_mean'], '.6f'):>8} {_f(s['kl_mean'], '.2e'):>9}"
        )
    if report.get("decode"):
        d = report["decode"]
        lines.append(
            f"(decode: the candidate's greedy continuations, {d['prompts']} x {d['tokens']} tokens after "
            f"{d['context']}, generated token by token and scored teacher-forced by the reference; NLL/PPL: sampled "
            "perplexity)"
        )
    pk = report.get("passkey")
    if pk:
        n = len(pk["cells"])
        lines += [
            "",
            f"passkey: reference retrieves {pk['reference_retrieved']}/{n}, candidate {pk['candidate_retrieved']}/{n}, "
            f"candidate misses {pk['misses']}, same text {pk['same_text']}/{n}",
        ]
        depths = pk["depths"]
        lines.append(f"{'length':>8} " + " ".join(f"{d:>6.0%}" for d in depths) + "   (R/C: retrieved by each)")
        for length in pk["lengths"]:
            row = [x for x in pk["cells"] if x["length"] == length]
            cells = [("R" if x["reference_ok"] else "-") + ("C" if x["candidate_ok"] else "-") for x in row]
            lines.append(f"{length:>8} " + " ".join(f"{x:>6}" for x in cells))
    lines.append("")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    if report["failures"]:
        lines.append(f"FAIL ({len(report['failures'])}):")
        lines += [f"  - {f}" for f in report["failures"]]
    else:
        lines.append("PASS")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def plot(report: dict[str, Any], path: Path) -> bool:
    """NLL difference by bucket (with its standard error) and the passkey grid, as one PNG; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    pk = report.get("passkey")
    fig, axes = plt.subplots(1, 2 if pk else 1, figsize=(11 if pk else 6, 4), squeeze=False)
    ax = axes[0][0]
    b = report["buckets"] + ([report["decode"]] if report.get("decode") else [])
    x = range(len(b))
    err = [s["nll_diff_stderr"] or 0.0 for s in b]
    colors = ["tab:purple" if s["bucket"] == "decode" else "tab:blue" for s in b]
    ax.bar(x, [s["nll_diff"] for s in b], yerr=err, color=colors, capsize=4)
    limit = report["thresholds"]["max_nll_diff"]
    for y in (limit, -limit):
        ax.axhline(y, color="tab:red", linestyle="--", linewidth=1)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xticks(list(x), [s["bucket"] for s in b])
    ax.set_xlabel("context length (tokens); decode: the candidate's continuations")
    ax.set_ylabel("mean NLL, candidate - reference (nats)")
    ax.set_title(f"NLL difference by position ({report['verdict'].upper()})")
    if pk:
        import numpy as np

        ax = axes[0][1]
        lengths, depths = pk["lengths"], pk["depths"]
        code = {(True, True): 3, (True, False): 0, (False, True): 2, (False, False): 1}
        grid = np.zeros((len(lengths), len(depths)))
        for cell in pk["cells"]:
            grid[lengths.index(cell["length"]), depths.index(cell["depth"])] = code[
                cell["reference_ok"], cell["candidate_ok"]
            ]
        cmap = matplotlib.colors.ListedColormap(["tab:red", "lightgray", "tab:orange", "tab:green"])
        ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=3.5, aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("key depth")
        ax.set_ylabel("prompt length (tokens)")
        ax.set_title("passkey: green both, red candidate misses,\norange candidate only, gray neither")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
