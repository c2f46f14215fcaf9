"""A multi-turn chat with Laplace through the OpenAI server: time to first token per turn with prefix caching on vs
off, side by side in one run.

Run (from the repository root)::

    .venv/bin/python deploy/bench_laplace_chat.py                          # 12 turns, checkpoints every 256 tokens
    .venv/bin/python deploy/bench_laplace_chat.py --block-sizes 128 256 512  # one caching server per size

An OpenAI chat client re-sends the whole conversation every turn. Without prefix caching the server prefills all
of it again (turn N costs O(history)); with it, vLLM restores the state checkpoint at the previous prompt's last
block boundary and prefills from there (turn N costs its new tokens plus at most one block).

What it does:
1. Writes the Laplace demo checkpoint (`vllm-trn demo laplace`, `--dtype`, default float32: the fast dtype on an
   AVX2 CPU) and starts `vllm-trn serve` on it once with `--no-enable-prefix-caching` and once per block size with
   `--enable-prefix-caching --mamba-block-size B`, one after the other, all alive for the whole measurement (same
   max-model-len, token budget and max-num-seqs).
2. One conversation per server, the same user messages (random ASCII words, ~`--user-tokens` byte-level tokens
   each), each turn sent as vLLM's chat completions API gets it from a client: every message so far, streamed,
   `--output-tokens` tokens greedy (`ignore_eos`). The servers take turns (ABBA order per turn), one request in
   flight at a time, so slow drift of this shared machine hits all alike. TTFT is measured as `vllm bench serve`
   does (vllm_trn_plugin.bench.client); the prompt's cached tokens are what the server reports for that request
   (`usage.prompt_tokens_details.cached_tokens`, `--enable-prompt-tokens-details`). `--conversations` (default 3)
   conversations per server, each with its own user messages; per turn the median over them.
3. Prints, per turn: prompt tokens, TTFT per server, cached tokens; the ratio turn 12 / turn 1 per server (target
   with caching: <= 1.3, flat; without: growing with the history), and the pages a conversation leaves in the pool
   (one checkpoint per turn: its prompt's last boundary, each a whole state page). Plot (matplotlib, the `bench`
   extra): TTFT by turn per server. JSON: `--out`.

Greedy replies agree between the servers up to float32 summation order (tests/test_laplace_prefix_caching.py); each
server continues its own conversation, and the prompt lengths printed show whether they stayed identical.
The machines are noisy: compare the ratios measured side by side in one run, not absolute seconds across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from harness import save_result, scratch_dir

from vllm_trn_plugin.bench.client import RequestResult, Target, stream_request
from vllm_trn_plugin.bench.local import LocalServer, serve_demo, vllm_trn_command
from vllm_trn_plugin.bench.workload import RequestSpec

# Idle servers must not spin on the cores the measured one uses: OpenMP's threads sleep when they wait.
ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
WORDS = "the of and to in is was for on are with as at be by this from or have an they which one you were".split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--user-tokens", type=int, default=512, help="user text per turn, byte-level tokens (default 512)")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--conversations", type=int, default=3, help="per server; per-turn medians (default 3)")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[256], help="one caching server per size")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, help="checkpoint and server logs here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_laplace_chat.json"))
    p.add_argument("--plot", type=Path, default=Path("bench-out/bench_laplace_chat.png"))
    return p.parse_args(argv)


def user_messages(turns: int, tokens: int, seed: int) -> list[str]:
    """`turns` texts of random words, each `tokens` bytes long (one token per byte for the demo's tokenizer)."""
    rng = random.Random(seed)
    out = []
    for _ in range(turns):
        words: list[str] = []
        while len(" ".join(words)) < tokens:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words)[:tokens])
    return out


def start_servers(args: argparse.Namespace, root: Path) -> dict[str, LocalServer]:
    ckpt = root / f"demo-laplace-{args.dtype}"
    if not (ckpt / "config.json").exists():
        subprocess.run([vllm_trn_command(), "demo", "laplace", str(ckpt), "--dtype", args.dtype], check=True)
    common = ["--max-model-len", str(args.max_model_len), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    common += ["--max-num-seqs", "4", "--served-model-name", "laplace-demo", "--kv-cache-memory-bytes", "256M"]
    common += ["--enable-prompt-tokens-details"]  # each reply's usage says how many prompt tokens were cached
    variants = {"off": ["--no-enable-prefix-caching"]}
    for b in args.block_sizes:
        variants[f"cache/{b}"] = ["--enable-prefix-caching", "--mamba-block-size", str(b)]
    servers: dict[str, LocalServer] = {}
    try:
        for name, flags in variants.items():
            t0 = time.perf_counter()
            log = root / f"server-{name.replace('/', '-')}.log"
            servers[name] = serve_demo(ckpt, log, extra=common + flags, env=ENV, dtype=args.dtype).wait_healthy(900)
            print(f"  server {name}: up in {time.perf_counter() - t0:.0f} s ({servers[name].url}; log {log})")
    except BaseException:
        for s in servers.values():
            s.stop()
        raise
    return servers


async def chat_turn(
    session: aiohttp.ClientSession, server: LocalServer, messages: list[dict[str, str]], n: int, user: str | None = None
) -> RequestResult:
    """One streamed turn, greedy; its `cached_tokens` as the server reports them for this request. `user`: the
    OpenAI request's end-user id (what a session-aware router keys on)."""
    target = Target(server.url, model=server.model, endpoint="chat")
    params: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True} | ({"user": user} if user else {})
    res = await stream_request(session, target, RequestSpec(0, messages, n), params, time.perf_counter(), True)
    if not res.ok:
        raise RuntimeError(f"{server.url}: {res.error}")
    if res.cached_tokens is None:
        raise RuntimeError(f"{server.url}: no usage.prompt_tokens_details.cached_tokens in its reply")
    return res


async def converse(args: argparse.Namespace, servers: dict[str, LocalServer]) -> dict[str, list[list[dict[str, Any]]]]:
    """`--conversations` conversations per server; rows[server][conversation][turn]."""
    names = list(servers)
    rows: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in servers}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        for c in range(args.conversations):
            users = user_messages(args.turns, args.user_tokens, args.seed + c)
            history: dict[str, list[dict[str, str]]] = {name: [] for name in servers}
            for name in names:
                rows[name].append([])
            for turn, text in enumerate(users, 1):
                for name in names if (turn + c) % 2 else names[::-1]:  # ABBA over turns and conversations
                    history[name].append({"role": "user", "content": text})
                    res = await chat_turn(session, servers[name], history[name], args.output_tokens)
                    history[name].append({"role": "assistant", "content": res.text})
                    rows[name][-1].append(
                        {
                            "turn": turn,
                            "prompt_tokens": res.prompt_tokens,
                            "cached_tokens": res.cached_tokens,
                            "ttft_ms": res.ttft * 1e3,
                            "output_tokens": res.output_tokens,
                        }
                    )
                cells = "  ".join(
                    f"{n} {rows[n][-1][-1]['ttft_ms']:8.1f} ms ({rows[n][-1][-1]['cached_tokens']:5d})" for n in names
                )
                print(
                    f"  conversation {c} turn {turn:2d}: prompt {rows[names[0]][-1][-1]['prompt_tokens']:6d} | {cells}"
                )
    return rows


def medians(rows: dict[str, list[list[dict[str, Any]]]], key: str) -> dict[str, list[float]]:
    """Per server, the median of `key` over the conversations, turn by turn."""
    return {
        n: [statistics.median(conv[i][key] for conv in convs) for i in range(len(convs[0]))]
        for n, convs in rows.items()
    }


def report(rows: dict[str, list[list[dict[str, Any]]]], args: argparse.Namespace) -> dict[str, Any]:
    names = list(rows)
    ttft, cached, prompt = medians(rows, "ttft_ms"), medians(rows, "cached_tokens"), medians(rows, "prompt_tokens")
    print(
        f"\n== TTFT per turn, ms, median of {args.conversations} conversations (median cached prompt tokens in "
        f"brackets); {args.turns} turns x ~{args.user_tokens} user + {args.output_tokens} generated tokens, greedy =="
    )
    print(f"{'turn':>4} {'prompt':>7} " + " ".join(f"{n:>20}" for n in names))
    for i in range(args.turns):
        cells = " ".join(f"{ttft[n][i]:>11.1f} ({cached[n][i]:>6.0f})" for n in names)
        print(f"{i + 1:>4} {prompt[names[0]][i]:>7.0f} {cells}")
    summary: dict[str, Any] = {}
    for n in names:
        summary[n] = {"turn1_ms": ttft[n][0], "last_ms": ttft[n][-1], "last_over_first": ttft[n][-1] / ttft[n][0]}
        summary[n]["same_prompt_lengths_as_off"] = prompt[n] == prompt["off"]
    print("\nlast turn / turn 1 TTFT: " + ", ".join(f"{n} {s['last_over_first']:.2f}x" for n, s in summary.items()))
    for n in names:
        if n != "off":
            ratio = summary["off"]["last_ms"] / summary[n]["last_ms"]
            summary[n]["last_speedup_vs_off"] = ratio
            flat = summary[n]["last_over_first"] <= 1.3
            print(f"  {n}: last turn {ratio:.2f}x faster than without caching; flat (<= 1.3x turn 1): {flat}")
    print(
        "pages per conversation with caching: 1 running state page (2 while a step crosses a block boundary) + one "
        f"checkpoint page per turn left in the pool ({args.turns} after {args.turns} turns, evictable LRU); a page is "
        "the whole state: 28.75 MB at the 3B geometry"
    )
    return summary


def plot(rows: dict[str, list[list[dict[str, Any]]]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'vllm-trn-plugin[bench]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, t in medians(rows, "ttft_ms").items():
        ax.plot(range(1, len(t) + 1), t, marker="o", label=f"prefix caching {name}")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token, ms (median)")
    ax.set_title("Laplace multi-turn chat: TTFT per turn")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    with scratch_dir(args.workdir, "bench-laplace-chat-") as root:
        print(f"== Laplace multi-turn chat, prefix caching on vs off ({args.dtype}, block sizes {args.block_sizes})")
        servers = start_servers(args, root)
        try:
            rows = asyncio.run(converse(args, servers))
        finally:
            for s in servers.values():
                s.stop()
    summary = report(rows, args)
    plot(rows, args.plot)
    save_result(args.out, {"args": vars(args), "turns": rows, "summary": summary}, t0)


if __name__ == "__main__":
    sys.exit(main())
