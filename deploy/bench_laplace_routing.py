"""Laplace conversations through vllm-router over two prefix-caching replicas: a session-aware policy vs
conversation-blind ones, side by side in one run. Cached-token fraction and time to first token per turn.

Run (from the repository root; ~10 minutes on a 2-core machine)::

    pip install vllm-router==0.1.17        # anywhere; pass --router-bin if it is not on PATH
    .venv/bin/python deploy/bench_laplace_routing.py --router-bin /path/to/vllm-router

Laplace's prefix cache is its state checkpoints (docs/models.md, "Prefix caching"), kept by the replica that
computed them: a conversation's next turn is cheap only on the replica that served its last one. vllm-router's
`consistent_hash` policy sends every request with the same session key to the same replica; the key is the OpenAI
request's `user` field (or an `X-Session-Id` header), which chat clients set per end user. `cache_aware` (the router's
default) matches each request's text against a prefix tree of what it sent each replica, and balances load when it
skews. `round_robin` and `power_of_two` (the trn2 recipes' default, where prefix caching is off) spread a
conversation's turns over the replicas.

What it does:
1. Writes the Laplace demo checkpoint (float32) and starts two `vllm-trn serve` replicas of it with
   `--enable-prefix-caching` (a checkpoint every `--block-size` tokens) and `--enable-prompt-tokens-details`,
   replica i's compute threads on CPU i (VLLM_CPU_OMP_THREADS_BIND: what NEURON_RT_VISIBLE_CORES does on trn2).
2. One vllm-router per `--policies` entry, all over the same two replicas.
3. `--conversations` conversations per policy, each its own user messages (so no policy hits another's
   checkpoints), `--turns` turns each; every turn re-sends the whole conversation (chat completions, streamed,
   greedy) with `user` = the conversation's id. The policies take turns request by request (rotating order), one
   request in flight at a time.
4. Prints per policy and turn the median TTFT and the cached fraction of the prompt (`usage.prompt_tokens_details
   .cached_tokens` / prompt tokens, as the replica reports it), then over turns 2..N: the fraction of all prompt
   tokens served from the cache and the median TTFT, each against the session-aware policy's. JSON: `--out`.

Expect the session-aware policy to hit at every turn's previous prompt's last checkpoint; a policy that alternates
replicas hits one turn further back or not at all. Both replicas share this machine's cores with the routers and the
client: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from bench_laplace_chat import ENV, chat_turn, user_messages
from harness import save_result, scratch_dir

from vllm_trn_plugin.bench.local import LocalServer, free_port, serve_demo, vllm_trn_command

SESSION_AWARE = "consistent_hash"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router-bin", default=shutil.which("vllm-router"), help="the vllm-router executable")
    p.add_argument("--policies", nargs="+", default=[SESSION_AWARE, "cache_aware", "round_robin", "power_of_two"])
    p.add_argument("--conversations", type=int, default=4, help="per policy")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-tokens", type=int, default=256, help="user text per turn, byte-level tokens")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=128, help="--mamba-block-size: tokens between checkpoints")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, help="checkpoint and logs here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_laplace_routing.json"))
    return p.parse_args(argv)


def start(args: argparse.Namespace, root: Path) -> tuple[list[LocalServer], dict[str, LocalServer]]:
    """The two replicas, then one router per policy over them."""
    ckpt = root / "demo-laplace-float32"
    if not (ckpt / "config.json").exists():
        subprocess.run([vllm_trn_command(), "demo", "laplace", str(ckpt), "--dtype", "float32"], check=True)
    flags = ["--max-model-len", "8192", "--max-num-batched-tokens", "2048", "--max-num-seqs", "4"]
    flags += ["--served-model-name", "laplace-demo", "--kv-cache-memory-bytes", "256M"]
    flags += ["--enable-prefix-caching", "--mamba-block-size", str(args.block_size), "--enable-prompt-tokens-details"]
    replicas: list[LocalServer] = []
    routers: dict[str, LocalServer] = {}
    try:
        for i in range(2):  # both start at once: start-up is mostly single-threaded imports
            env = {**ENV, "VLLM_CPU_OMP_THREADS_BIND": str(i)}
            replicas.append(serve_demo(ckpt, root / f"replica-{i}.log", extra=flags, env=env, dtype="float32"))
        for r in replicas:
            r.wait_healthy(900)
        for policy in args.policies:
            port = free_port()
            cmd = [args.router_bin, "--host", "127.0.0.1", "--port", str(port), "--worker-urls"]
            cmd += [r.url for r in replicas] + ["--policy", policy, "--request-timeout-secs", "600"]
            cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
            url = f"http://127.0.0.1:{port}"
            routers[policy] = LocalServer(cmd, url, root / f"router-{policy}.log", model="laplace-demo")
            routers[policy].wait_healthy(120)
        print(f"replicas {[r.url for r in replicas]}; routers { ({p: r.url for p, r in routers.items()}) }", flush=True)
    except BaseException:
        for s in [*routers.values(), *replicas]:
            s.stop()
        raise
    return replicas, routers


async def converse(args: argparse.Namespace, routers: dict[str, LocalServer]) -> dict[str, list[list[dict]]]:
    """rows[policy][conversation][turn]: prompt tokens, cached tokens, TTFT."""
    policies = list(routers)
    rows: dict[str, list[list[dict]]] = {p: [] for p in policies}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        for c in range(args.conversations):
            users = {
                p: user_messages(args.turns, args.user_tokens, args.seed + 1000 * i + c) for i, p in enumerate(policies)
            }
            history: dict[str, list[dict[str, str]]] = {p: [] for p in policies}
            for p in policies:
                rows[p].append([])
            for turn in range(args.turns):
                k = (turn + c) % len(policies)
                for p in policies[k:] + policies[:k]:  # rotating order
                    history[p].append({"role": "user", "content": users[p][turn]})
                    res = await chat_turn(session, routers[p], history[p], args.output_tokens, user=f"{p}-conv{c}")
                    history[p].append({"role": "assistant", "content": res.text})
                    rows[p][-1].append(
                        {
                            "prompt_tokens": res.prompt_tokens,
                            "cached_tokens": res.cached_tokens,
                            "ttft_ms": res.ttft * 1e3,
                        }
                    )
                cells = "  ".join(
                    f"{p} {rows[p][-1][-1]['ttft_ms']:7.1f} ms ({rows[p][-1][-1]['cached_tokens']:5d}/"
                    f"{rows[p][-1][-1]['prompt_tokens']:5d})"
                    for p in policies
                )
                print(f"  conversation {c} turn {turn + 1:2d}: {cells}", flush=True)
    return rows


def report(rows: dict[str, list[list[dict]]], args: argparse.Namespace) -> dict[str, Any]:
    policies = list(rows)
    print(
        f"\n== Laplace chat through vllm-router over 2 prefix-caching replicas: per turn, median TTFT ms and cached "
        f"fraction of the prompt over {args.conversations} conversations ({args.turns} turns x ~{args.user_tokens} "
        f"user + {args.output_tokens} generated tokens; checkpoints every {args.block_size} tokens) =="
    )
    print(f"{'turn':>4} " + " ".join(f"{p:>26}" for p in policies))
    for t in range(args.turns):
        cells = []
        for p in policies:
            convs = [conv[t] for conv in rows[p]]
            ttft = statistics.median(r["ttft_ms"] for r in convs)
            frac = statistics.median(r["cached_tokens"] / r["prompt_tokens"] for r in convs)
            cells.append(f"{ttft:>17.1f} ({frac:>6.1%})")
        print(f"{t + 1:>4} " + " ".join(cells))
    summary: dict[str, Any] = {}
    for p in policies:
        later = [r for conv in rows[p] for r in conv[1:]]
        summary[p] = {
            "cached_fraction": sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later),
            "median_ttft_ms": statistics.median(r["ttft_ms"] for r in later),
        }
    base = summary.get(SESSION_AWARE)
    print("\nturns 2..N:")
    for p, s in summary.items():
        vs = f"; TTFT {s['median_ttft_ms'] / base['median_ttft_ms']:.2f}x {SESSION_AWARE}'s" if base else ""
        print(
            f"  {p:>16}: {s['cached_fraction']:6.1%} of prompt tokens from the cache, median TTFT "
            f"{s['median_ttft_ms']:.1f} ms{vs}"
        )
    return summary


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.router_bin:
        sys.exit("vllm-router not found: pip install vllm-router==0.1.17 and pass --router-bin")
    t0 = time.perf_counter()
    with scratch_dir(args.workdir, "bench-laplace-routing-") as root:
        replicas, routers = start(args, root)
        try:
            rows = asyncio.run(converse(args, routers))
        finally:
            for s in [*routers.values(), *replicas]:
                s.stop()
    summary = report(rows, args)
    save_result(args.out, {"args": vars(args), "turns": rows, "summary": summary}, t0)


if __name__ == "__main__":
    sys.exit(main())
