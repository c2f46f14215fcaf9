"""`vllm-trn bench` against `vllm bench serve` (installed with vLLM): same server, same prompts, same load.

Run (from the repository root)::

    .venv/bin/python deploy/compare_vllm_bench.py                 # serves a demo Laplace checkpoint itself
    .venv/bin/python deploy/compare_vllm_bench.py --base-url http://127.0.0.1:8000   # an existing server

The workload is vLLM's own `random` dataset (`--dataset-name random`, the given input/output lengths and
seed), drawn in this process with vLLM's sampler and tokenizer exactly as `vllm bench serve` draws it,
written to a JSONL and fed to `vllm-trn bench --dataset`: both tools send the same prompt texts with the
same `max_tokens`, `ignore_eos`, temperature 0. Each `vllm bench serve` run is a fresh process (vLLM's
own CLI, `vllm-trn vllm bench serve`), each of ours a `run_bench` call in this process; both results are
compared in `vllm bench serve`'s keys (ours as `summary.json` writes them). Each load point runs the two tools
alternately, vLLM ours ours vLLM vLLM ours ... (`--rounds` runs each), so drift on a noisy machine hits
both; the table shows every run, the means, ours / vLLM, and the run-to-run spread of each tool
((max - min) / mean), which is the noise the ratio should be judged against. The last rows
(`server_*`) are the server's own mean TTFT, inter-token and E2E latency during each run, from its
Prometheus histograms: when a run is slow on the client side and on the server side alike, the server
was slow (machine noise), not the tool. The `tool/server` rows divide, run by run, what each tool
measured by what the server measured in the same run; machine noise cancels there, so those rows
compare the two tools' measurements most directly.

Known difference: `vllm bench` sends one readiness request before timing, ours one warm-up request.
Results: a table on stdout and JSON (`--out`, default bench-out/compare_vllm_bench.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# `vllm bench serve`'s result keys compared, in the order printed
METRICS = ["completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput"]
METRICS += ["output_throughput"]
METRICS += [f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p99")]


def vllm_args(a: argparse.Namespace, base_url: str, model: str, load: tuple[str, float], result: Path) -> list[str]:
    kind, value = load
    args = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model]
    args += ["--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len"]
    args += [str(a.output_len), "--num-prompts", str(a.num_prompts), "--seed", str(a.seed), "--temperature", "0"]
    args += ["--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    args += ["--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name]
    args += ["--disable-tqdm", "--num-warmups", "0"]
    if a.tokenizer:
        args += ["--tokenizer", a.tokenizer]
    if kind == "concurrency":
        args += ["--request-rate", "inf", "--max-concurrency", str(int(value))]
    else:
        args += ["--request-rate", str(value)]
    return args


def write_vllm_workload(a: argparse.Namespace, base_url: str, model: str, path: Path) -> list[int]:
    """Draw vLLM's random dataset as `vllm bench serve` does and write it as JSONL; return prompt lengths."""
    from vllm_trn_plugin.compat import ensure_vllm_version_lookup

    ensure_vllm_version_lookup()
    import vllm_trn_plugin

    vllm_trn_plugin.register()  # the tokenizer loader reads config.json: `laplace` must be a known type
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import _align_prompts_to_server_tokenizer, add_cli_args
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(vllm_args(a, base_url, model, ("concurrency", 1), path))
    tokenizer = get_tokenizer(ns.tokenizer or model, tokenizer_mode=ns.tokenizer_mode)
    reqs = get_samples(ns, tokenizer)
    reqs = asyncio.run(_align_prompts_to_server_tokenizer(base_url, model, reqs))
    with open(path, "w") as fh:
        for r in reqs:
            fh.write(json.dumps({"prompt": r.prompt, "output_tokens": r.expected_output_len}) + "\n")
    return [r.prompt_len for r in reqs]


def run_vllm(a: argparse.Namespace, base_url: str, model: str, load: tuple[str, float], work: Path, k: int) -> dict:
    """`vllm bench serve` in a fresh process, as a user runs it (repeated runs inside one process drift:
    docs/serving-trn2.md)."""
    from vllm_trn_plugin.bench.local import vllm_trn_command

    result = work / f"vllm-{load[0]}-{load[1]:g}-{k}.json"
    cmd = [vllm_trn_command(), "vllm", "bench", "serve", *vllm_args(a, base_url, model, load, result)]
    with open(result.with_suffix(".log"), "w") as fh:
        subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=True, timeout=1800)
    return json.loads(result.read_text())


def run_ours(a: argparse.Namespace, base_url: str, model: str, load: tuple[str, float], work: Path, k: int) -> dict:
    from vllm_trn_plugin.bench import build_parser, run_bench

    out = work / f"ours-{load[0]}-{load[1]:g}-{k}"
    out.mkdir(parents=True, exist_ok=True)
    argv = ["--base-url", base_url, "--model", model, "--dataset", str(work / "workload.jsonl")]
    argv += ["--num-requests", str(a.num_prompts), "--seed", str(a.seed), "--temperature", "0"]
    argv += ["--out", str(out), "--no-plots", "--no-progress", "--warmup", "1"]
    argv += ["--concurrency", str(int(load[1]))] if load[0] == "concurrency" else ["--request-rate", str(load[1])]
    with open(out / "console.log", "w") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
        run_bench(build_parser().parse_args(argv))
    return json.loads((out / "summary.json").read_text())[0]


SERVER_HISTOGRAMS = {
    "server_ttft_ms_mean": "vllm:time_to_first_token_seconds",
    "server_itl_ms_mean": "vllm:inter_token_latency_seconds",
    "server_e2el_ms_mean": "vllm:e2e_request_latency_seconds",
}


TOOL_VS_SERVER = [
    ("mean_ttft_ms", "server_ttft_ms_mean"),
    ("mean_itl_ms", "server_itl_ms_mean"),
    ("mean_e2el_ms", "server_e2el_ms_mean"),
]


def scrape_histograms(base_url: str) -> dict[str, float]:
    """Sums and counts of the server's own latency histograms."""
    from vllm_trn_plugin.bench.metrics import scrape

    m = scrape(base_url)
    return {
        name + suffix: m.total(name + suffix) for name in SERVER_HISTOGRAMS.values() for suffix in ("_sum", "_count")
    }


def server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean TTFT / inter-token / E2E latency the server itself measured between two scrapes (ms)."""
    out = {}
    for key, name in SERVER_HISTOGRAMS.items():
        n = after.get(name + "_count", 0) - before.get(name + "_count", 0)
        out[key] = (after.get(name + "_sum", 0) - before.get(name + "_sum", 0)) / n * 1e3 if n else math.nan
    return out


def comparison_row(name: str, v: list[float], o: list[float]) -> dict[str, Any]:
    """One metric's per-round values for vLLM's tool (v) and ours (o), their means, ratio and spreads."""
    mv, mo = sum(v) / len(v), sum(o) / len(o)
    return {
        "metric": name,
        "vllm": v,
        "ours": o,
        "vllm_mean": mv,
        "ours_mean": mo,
        "ratio": mo / mv if mv else math.nan,
        "vllm_spread": spread(v),
        "ours_spread": spread(o),
    }


def spread(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return (max(xs) - min(xs)) / m if m else math.nan


def compare(a: argparse.Namespace, base_url: str) -> dict[str, Any]:
    from vllm_trn_plugin.bench.client import Target, first_model
    from vllm_trn_plugin.bench.runner import make_session

    async def model_name() -> str:
        async with make_session(timeout_s=30) as s:
            return await first_model(s, Target(base_url))

    model = a.model or asyncio.run(model_name())
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="compare-vllm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    lens = write_vllm_workload(a, base_url, model, work / "workload.jsonl")
    print(f"workload: {len(lens)} prompts of vLLM's random dataset, {sum(lens)} prompt tokens, {work}", flush=True)
    loads = [(k, float(v)) for k, _, v in (x.partition(":") for x in a.loads.split(","))]
    report: dict[str, Any] = {"model": model, "base_url": base_url, "workload_prompt_tokens": sum(lens), "points": []}
    for load in loads:
        runs: dict[str, list[dict]] = {"vllm": [], "ours": []}
        for k in range(a.rounds):
            for tool in ("vllm", "ours") if k % 2 == 0 else ("ours", "vllm"):
                t = time.time()
                before = scrape_histograms(base_url)
                res = (run_vllm if tool == "vllm" else run_ours)(a, base_url, model, load, work, k)
                # The server's own view of the same run (includes the tool's one untimed request).
                res["server"] = server_means(before, scrape_histograms(base_url))
                runs[tool].append(res)
                print(f"{load[0]} {load[1]:g} round {k}: {tool} {time.time() - t:.0f} s", flush=True)
        rows = [
            comparison_row(key, [float(r[key]) for r in runs["vllm"]], [float(r[key]) for r in runs["ours"]])
            for key in METRICS
        ]
        rows += [
            comparison_row(key, [r["server"][key] for r in runs["vllm"]], [r["server"][key] for r in runs["ours"]])
            for key in SERVER_HISTOGRAMS
        ]
        by = {r["metric"]: r for r in rows}
        for client, server in TOOL_VS_SERVER:
            # Per run, what the tool measured over what the server measured: noise cancels within a run.
            v = [c / sv for c, sv in zip(by[client]["vllm"], by[server]["vllm"])]
            o = [c / sv for c, sv in zip(by[client]["ours"], by[server]["ours"])]
            rows.append(comparison_row(f"{client.removesuffix('_ms')} tool/server", v, o))
        report["points"].append({"load": f"{load[0]} {load[1]:g}", "rows": rows})
        print_point(report["points"][-1], a.rounds)
    return report


def print_point(pt: dict[str, Any], rounds: int) -> None:
    runs = " ".join(f"{'vllm ' + str(k):>10} {'ours ' + str(k):>10}" for k in range(rounds))
    means = f"{'vllm mean':>10} {'ours mean':>10} {'ours/vllm':>9} {'spread v':>8} {'spread o':>8}"
    print(f"\n== {pt['load']}\n{'metric':>22} {runs} {means}")
    for r in pt["rows"]:
        cells = " ".join(f"{x:>10.2f} {y:>10.2f}" for x, y in zip(r["vllm"], r["ours"]))
        print(
            f"{r['metric']:>22} {cells} {r['vllm_mean']:>10.2f} {r['ours_mean']:>10.2f} {r['ratio']:>9.3f} "
            f"{r['vllm_spread']:>8.3f} {r['ours_spread']:>8.3f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="an existing server; default: serve a demo Laplace checkpoint here")
    p.add_argument("--model", help="model name (default: the server's first)")
    p.add_argument("--tokenizer", help="tokenizer path for vLLM's sampler (default: the model name)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--loads", default="concurrency:1,concurrency:4,rate:1.5", help="kind:value,... (concurrency|rate)")
    p.add_argument("--rounds", type=int, default=4, help="runs of each tool per load point, alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "bench-out" / "compare_vllm_bench.json"))
    p.add_argument("--work-dir", help="workload and per-run outputs (default: a new temporary directory)")
    a = p.parse_args()

    if a.base_url:
        report = compare(a, a.base_url)
    else:
        from vllm_trn_plugin.bench.local import serve_new_demo

        root = Path(a.work_dir or tempfile.mkdtemp(prefix="compare-vllm-bench-")) / "server"
        with serve_new_demo("laplace", root, "bfloat16") as server:
            server.wait_healthy()
            report = compare(a, server.url)
            report["server"] = {"checkpoint": "demo Laplace (bf16, random weights)", "args": server.cmd[2:]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
