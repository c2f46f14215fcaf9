"""`vllm-trn bench`: load-test any OpenAI-compatible endpoint, alone or two side by side.

    vllm-trn bench --base-url http://127.0.0.1:8000 --concurrency 1,4,16 --num-requests 64 \\
        --prompt-len uniform:128-512 --output-len 128 --out bench-out/run1
    vllm-trn bench --base-url http://a:8000 --compare-url http://b:8000 --request-rate 1,2,4

Writes bench.json (configuration, per point and target: counts, throughputs, latency distributions;
ratios B/A side by side), summary.json (one `vllm bench serve` result per point and target, which
`vllm-trn vllm bench sweep plot OUT --curve-by target --var-x max_concurrency` reads), summary.csv (one
row per point and target), requests.csv (one row per request), ratios.csv (side by side), and
latency.png, e2e_latency.png, throughput.png, requests.png (against load; matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path
from typing import Any

from vllm_trn_plugin.bench.client import Target
from vllm_trn_plugin.bench.report import (
    check_plotting,
    flatten,
    format_ratios,
    format_table,
    plot_points,
    ratios,
    summarize,
    sweep_record,
    write_csv,
    write_json,
)
from vllm_trn_plugin.bench.runner import Load, run_point, warm_up
from vllm_trn_plugin.bench.workload import LengthDist, dataset_requests, random_requests


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def build_parser(prog: str = "vllm-trn bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("endpoints")
    t.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (no /v1)")
    t.add_argument("--model", help="model name to request (default: the first one at /v1/models)")
    t.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    t.add_argument("--compare-url", help="a second endpoint, loaded side by side with the first")
    t.add_argument("--compare-model", help="model name at --compare-url (default: its first model)")
    t.add_argument("--labels", default="A,B", help="names of the two endpoints in reports (default A,B)")
    t.add_argument("--interleave", choices=["pairs", "blocks"], default="pairs", help="side-by-side scheme")
    t.add_argument("--block-size", type=int, default=8, help="requests per block with --interleave blocks")
    t.add_argument("--api-key", help="sent as a Bearer token")

    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", "--num-prompts", type=int, default=64, help="requests per load point")
    w.add_argument("--prompt-len", default="128", help="N | uniform:LO-HI | file:PATH (tokens)")
    w.add_argument("--output-len", default="128", help="N | uniform:LO-HI | file:PATH (tokens)")
    w.add_argument("--dataset", help='JSONL of {"prompt": str | [ids], "output_tokens": N}; overrides --prompt-len')
    w.add_argument("--token-range", default="0,256", help="random prompt token ids are drawn from [LO, HI)")
    w.add_argument("--seed", type=int, default=0)

    lo = p.add_argument_group("load (one of; a comma-separated list is a sweep)")
    m = lo.add_mutually_exclusive_group()
    m.add_argument("--request-rate", help="Poisson arrivals, requests/s (inf: all at once)")
    m.add_argument("--concurrency", help="closed loop with this many requests in flight")
    m.add_argument("--batch-size", help="fixed batches sent at once, next batch when all finished")
    lo.add_argument("--max-concurrency", type=int, help="with --request-rate: cap on requests in flight")
    lo.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of the gaps (1 = Poisson)")
    lo.add_argument(
        "--plain-poisson",
        action="store_true",
        help="do not rescale the arrivals so the last lands at N/rate (vLLM's convention, the default)",
    )

    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: exact lengths)")

    o = p.add_argument_group("run and output")
    o.add_argument("--warmup", type=int, default=1, help="untimed requests per endpoint before the run")
    o.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    o.add_argument("--out", default="bench-out/bench", help="output directory")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    return p


def loads_from_args(args: argparse.Namespace) -> tuple[list[Load], str]:
    """The sweep's load points and the x-axis label of the plots."""
    if args.request_rate:
        vals = [float("inf") if v.strip() == "inf" else float(v) for v in args.request_rate.split(",")]
        loads = [Load("rate", v, args.max_concurrency, args.burstiness, not args.plain_poisson) for v in vals]
        return loads, "offered request rate (requests/s)"
    if args.batch_size:
        return [Load("batch", v) for v in _floats(args.batch_size)], "fixed batch size"
    return [Load("concurrency", v) for v in _floats(args.concurrency or "1")], "concurrent requests"


async def _resolve_models(targets: list[Target]) -> None:
    from vllm_trn_plugin.bench.client import first_model
    from vllm_trn_plugin.bench.runner import make_session

    async with make_session(timeout_s=30) as session:
        for t in targets:
            if t.model is None:
                t.model = await first_model(session, t)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the sweep described by `args` (see build_parser), write the outputs, return the summary."""
    if not args.no_plots:
        check_plotting()
    labels = [x.strip() for x in args.labels.split(",")][:2]
    targets = [Target(args.base_url, args.model, args.endpoint, labels[0], args.api_key)]
    if args.compare_url:
        targets.append(Target(args.compare_url, args.compare_model, args.endpoint, labels[1], args.api_key))
    asyncio.run(_resolve_models(targets))

    text = args.endpoint == "chat"
    out_len = LengthDist.parse(args.output_len)
    if args.dataset:
        specs = dataset_requests(args.dataset, args.num_requests, None, args.seed)
    else:
        lo, hi = (int(x) for x in args.token_range.split(","))
        prompt_len = LengthDist.parse(args.prompt_len)
        specs = random_requests(args.num_requests, prompt_len, out_len, args.seed, (lo, hi), text)
    params: dict[str, Any] = {"temperature": args.temperature}
    if not args.no_ignore_eos:
        params["ignore_eos"] = True
    loads, xlabel = loads_from_args(args)

    if args.warmup:
        asyncio.run(warm_up(targets, specs[0], params, args.warmup))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points: list[dict[str, Any]] = []
    ratio_rows: list[dict[str, Any]] = []
    request_rows: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    for load in loads:
        t_start = time.time()
        res = asyncio.run(
            run_point(
                targets,
                specs,
                load,
                params,
                seed=args.seed,
                interleave=args.interleave,
                block_size=args.block_size,
                progress=not args.no_progress,
                timeout_s=args.timeout,
            )
        )
        x = load.value if math.isfinite(load.value) else float(len(specs))
        for t in targets:
            summary = summarize(res.results[t.label], res.durations[t.label])
            points.append({"load": load.label, "x": x, "kind": load.kind, "target": t.label, "summary": summary})
            records.append(sweep_record(summary, load, t.label, t.model, len(specs)))
            request_rows += [{"load": load.label, **r.row()} for r in res.results[t.label]]
        if len(targets) == 2:
            r = ratios(points[-1]["summary"], points[-2]["summary"])
            ratio_rows.append({"load": load.label, "x": x, "ratios": r})
        print(format_table(points[-len(targets) :]), f"\n({time.time() - t_start:.1f} s)\n", file=sys.stderr)

    config = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
    config["targets"] = [{"label": t.label, "url": t.url, "model": t.model} for t in targets]
    config["prompt_len_dist"] = "dataset" if args.dataset else str(LengthDist.parse(args.prompt_len))
    config["output_len_dist"] = str(out_len)
    payload: dict[str, Any] = {"config": config, "points": points}
    if ratio_rows:
        payload["ratios"] = {"of": f"{labels[1]} / {labels[0]}", "points": ratio_rows}
    write_json(out / "bench.json", payload)
    write_json(out / "summary.json", records)
    rows = [{"load": p["load"], "x": p["x"], "target": p["target"], **flatten(p["summary"])} for p in points]
    write_csv(out / "summary.csv", rows)
    write_csv(out / "requests.csv", request_rows)
    if ratio_rows:
        write_csv(out / "ratios.csv", [{"load": r["load"], "x": r["x"], **r["ratios"]} for r in ratio_rows])
    if not args.no_plots:
        payload["plots"] = [str(f) for f in plot_points(out, points, xlabel)]
    print(format_table(points))
    if ratio_rows:
        print(format_ratios(ratio_rows, labels[1], labels[0]))
    print(f"wrote {out}/bench.json, summary.json, summary.csv, requests.csv" + (", plots" if not args.no_plots else ""))
    return payload


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    payload = run_bench(args)
    return 0 if any(p["summary"]["completed"] for p in payload["points"]) else 1


if __name__ == "__main__":
    sys.exit(main())
