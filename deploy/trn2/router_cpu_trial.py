"""Multi-replica serving tried on CPU: two demo-Laplace replicas behind vllm-router vs one replica alone.

Run (from the repository root; ~4 minutes on a 2-core machine)::

    pip install vllm-router==0.1.17        # anywhere; pass --router-bin if it is not on PATH
    .venv/bin/python deploy/trn2/router_cpu_trial.py --router-bin /path/to/vllm-router

What it does: writes a demo Laplace checkpoint, starts two `vllm-trn serve` replicas of it, replica 1
with its compute threads bound to CPU 0 and replica 2 to CPU 1 (VLLM_CPU_OMP_THREADS_BIND: what
NEURON_RT_VISIBLE_CORES does for NeuronCores), and vllm-router over both (the router of
deploy/trn2/launch-instance.sh and k8s/router.yaml). Then `vllm-trn bench` side by side with
`--interleave blocks`: A = replica 1 alone (one core's worth of engine, the other replica idle),
B = the router over both replicas (two cores), same workload and load, blocks in the order A B B A ...
so drift cancels. Ratio B / A of output tokens/s is the scaling from one replica to two.

Expect little: on a 2-core machine each replica's API-server process, the router and the load
generator all share the same two cores with the engines, and other jobs on the machine add noise.
Everything it starts is stopped at the end (process groups). Results in --out (default
bench-out/router_cpu_trial/): the bench outputs (summary.json, CSVs, PNGs) and trial.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router-bin", default=shutil.which("vllm-router"), help="the vllm-router executable")
    p.add_argument("--policy", default="power_of_two", help="vllm-router --policy")
    p.add_argument("--concurrency", default="2,4,8", help="load points (requests in flight)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", default="uniform:64-192")
    p.add_argument("--output-len", default="64")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--work-dir", help="checkpoint and logs (default: a new temporary directory)")
    p.add_argument("--out", default=str(REPO / "bench-out" / "router_cpu_trial"))
    a = p.parse_args()
    if not a.router_bin:
        sys.exit("vllm-router not found: pip install vllm-router==0.1.17 and pass --router-bin")

    from vllm_trn_plugin.bench import build_parser, run_bench
    from vllm_trn_plugin.bench.local import LocalServer, free_port, serve_demo
    from vllm_trn_plugin.demo import write_laplace_demo

    work = Path(a.work_dir or tempfile.mkdtemp(prefix="router-cpu-trial-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "demo-laplace"
    if not (ckpt / "config.json").is_file():  # a reused --work-dir keeps its demo (the writer refuses to overwrite)
        write_laplace_demo(ckpt)
    started: list[LocalServer] = []
    try:
        t0 = time.time()
        for i in range(2):  # both start at once: start-up is mostly single-threaded imports
            env = {"VLLM_CPU_OMP_THREADS_BIND": str(i)}
            started.append(serve_demo(ckpt, work / f"replica-{i}.log", env=env))
        for s in started:
            s.wait_healthy()
        print(f"replicas up in {time.time() - t0:.0f} s: {[s.url for s in started]}", flush=True)
        port, prom = free_port(), free_port()
        router_cmd = [a.router_bin, "--host", "127.0.0.1", "--port", str(port), "--worker-urls"]
        router_cmd += [s.url for s in started] + ["--policy", a.policy, "--prometheus-host", "127.0.0.1"]
        router_cmd += ["--prometheus-port", str(prom), "--request-timeout-secs", "600"]
        router = LocalServer(router_cmd, f"http://127.0.0.1:{port}", work / "router.log")
        started.append(router)
        router.wait_healthy(120)
        routes = {}
        for path in ("/health", "/v1/models"):
            with urllib.request.urlopen(router.url + path, timeout=10) as r:
                routes[path] = r.status
        print(f"router up at {router.url} ({a.policy}); {routes}", flush=True)

        argv = ["--base-url", started[0].url, "--compare-url", router.url, "--labels", "1 replica,2 replicas"]
        argv += ["--interleave", "blocks", "--block-size", str(a.block_size), "--concurrency", a.concurrency]
        argv += ["--num-requests", str(a.num_requests), "--prompt-len", a.prompt_len, "--output-len", a.output_len]
        argv += ["--out", a.out, "--no-progress"]
        payload = run_bench(build_parser().parse_args(argv))
        with urllib.request.urlopen(f"http://127.0.0.1:{prom}/metrics", timeout=10) as r:
            router_metrics = [ln for ln in r.read().decode().splitlines() if ln and not ln.startswith("#")]
        trial = {
            "router": {"cmd": router_cmd[1:], "routes": routes, "metrics_sample": router_metrics[:40]},
            "replicas": [{"url": s.url, "cmd": s.cmd[1:]} for s in started[:2]],
            "omp_bind": ["0", "1"],
            "scaling": [
                {"load": r["load"], "output_throughput_2_over_1": r["ratios"]["output_throughput"]}
                for r in payload["ratios"]["points"]
            ],
        }
        Path(a.out, "trial.json").write_text(json.dumps(trial, indent=2) + "\n")
        print(json.dumps(trial["scaling"], indent=2))
    finally:
        for s in reversed(started):
            s.stop()
    print(f"stopped everything; logs in {work}")


if __name__ == "__main__":
    main()
