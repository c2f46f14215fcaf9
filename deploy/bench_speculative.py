"""MLA-Trinity or Laplace with and without n-gram speculative decoding, side by side: tokens per verification step
and decode time per output token, on a repetitive workload and an unrepetitive one.

Run (from the repository root)::

    .venv/bin/python deploy/bench_speculative.py                  # MLA-Trinity's demo geometry, batch 1 and 8, k = 3
    .venv/bin/python deploy/bench_speculative.py --arch laplace   # Laplace (LAPLACE_BENCH geometry)
    .venv/bin/python deploy/bench_speculative.py --model DIR      # any checkpoint of either

What it does:
1. A random checkpoint (`vllm_trn_plugin.demo`, --dtype, bf16 by default) unless --model is given: MLA-Trinity's
   demo, or a Laplace of LAPLACE_BENCH's geometry (the demo's widened, so that the state a step reads weighs beside
   the weights about as at 3B: 2.3 MB per sequence beside 206 MB of bf16 weights, 1.1%; at 3B 28.75 MB beside 6 GB,
   0.5%).
2. Two engines alive for the whole run (vLLM's CPU build, --dtype, eager, prefix caching off): one plain, one with
   `--speculative-config {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}`.
3. Two workloads of `batch` prompts: "repetitive" (a short random motif repeated, so prompt lookup finds matches
   wherever the output echoes the prompt) and "unrepetitive" (random tokens). For each, `--reps` rounds in ABBA
   order, greedy, `--output-len` tokens per request.
4. Printed per workload and batch: decode ms per output token of each engine (vLLM's per-request timestamps, the
   median over requests and rounds), the ratio, and the speculating engine's mean tokens per verification step
   (1 + accepted / drafts, from vLLM's counters) and acceptance rate (accepted / draft tokens). Greedy outputs of
   the two engines are compared token for token: the count of equal requests, and for each other one the step
   where it parts and the plain engine's top-2 margin there (bf16: a margin of a few bf16 steps flips with the
   summation order, which a verification step's wider matrix products and token-by-token recurrence change; the
   same engine batched and alone parts as often: `--dtype float32` shows the outputs themselves, and the exactness
   tests are tests/test_trinity_speculative.py and tests/test_laplace_speculative.py).
Random weights echo their prompt only by chance, so the acceptance here is a floor, not what a trained model gets
(a trained model's repetitive text is what prompt lookup is for).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import decode_seconds

# Laplace for this benchmark: 8 layers of hidden 1024, 8 heads of 64 x 128 (the demo: 4 layers of 256)
LAPLACE_BENCH = dict(
    hidden_size=1024, num_hidden_layers=8, num_heads=8, head_k_dim=64, head_v_dim=128, intermediate_size=2816
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=("trinity", "laplace"), default="trinity", help="the model to generate")
    p.add_argument("--model", type=Path, help="a checkpoint of either model (default: a random one of --arch)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per step (num_speculative_tokens)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the engines' dtype")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--reps", type=int, default=2, help="rounds per engine, workload and batch (ABBA order)")
    return p.parse_args(argv)


def workload(kind: str, batch: int, seed: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    if kind == "repetitive":
        return [{"prompt_token_ids": torch.randint(0, 256, (6,), generator=g).tolist() * 12} for _ in range(batch)]
    return [{"prompt_token_ids": torch.randint(0, 256, (72,), generator=g).tolist()} for _ in range(batch)]


def first_parting(plain: Any, ngram: Any) -> tuple[int, float] | None:
    """Where two greedy completions first differ, with the plain engine's top-1 minus top-2 logprob there (a
    near-tie in bf16 flips with the summation order), or None if they are equal."""
    for i, (a, b) in enumerate(zip(plain.token_ids, ngram.token_ids)):
        if a != b:
            top = sorted((lp.logprob for lp in plain.logprobs[i].values()), reverse=True)
            return i, top[0] - top[1] if len(top) > 1 else float("inf")
    return None


def spec_counters(llm: Any) -> tuple[float, float, float]:
    """vLLM's cumulative drafts, draft tokens and accepted tokens."""
    got = {m.name: getattr(m, "value", 0.0) for m in llm.get_metrics()}
    return tuple(got.get(f"vllm:spec_decode_num_{n}", 0.0) for n in ("drafts", "draft_tokens", "accepted_tokens"))  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory(prefix="bench-speculative-") as tmp:
        model = args.model
        if model is None and args.arch == "trinity":
            from vllm_trn_plugin.demo import write_trinity_demo

            model = write_trinity_demo(Path(tmp) / "trinity", seed=0, dtype=getattr(torch, args.dtype))
        elif model is None:
            from vllm_trn_plugin.demo import write_laplace_demo

            model = write_laplace_demo(Path(tmp) / "laplace", seed=0, dtype=getattr(torch, args.dtype), **LAPLACE_BENCH)
        arch = json.loads((Path(model) / "config.json").read_text())["architectures"][0]
        common = dict(
            model=str(model),
            dtype=args.dtype,
            max_model_len=512,
            max_num_seqs=max(args.batches),
            enforce_eager=True,
            enable_prefix_caching=False,
            disable_log_stats=False,
            kv_cache_memory_bytes=256 << 20,
            seed=0,
        )
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
        engines = {}
        for key, extra in (("plain", {}), ("ngram", {"speculative_config": spec})):
            t0 = time.perf_counter()
            engines[key] = LLM(**common, **extra)
            print(f"{key}: engine ready in {time.perf_counter() - t0:.0f} s")
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True, logprobs=2)
        rows = []
        for kind in ("repetitive", "unrepetitive"):
            for batch in args.batches:
                prompts = workload(kind, batch, seed=batch)
                for llm in engines.values():  # warm-up, discarded
                    llm.generate(prompts, params, use_tqdm=False)
                times: dict[str, list[float]] = {k: [] for k in engines}
                outs: dict[str, list[Any]] = {}
                before = spec_counters(engines["ngram"])
                for rep in range(args.reps):
                    for key in list(engines) if rep % 2 == 0 else list(engines)[::-1]:
                        res = engines[key].generate(prompts, params, use_tqdm=False)
                        times[key] += decode_seconds(res, args.output_len)
                        outs[key] = [r.outputs[0] for r in res]
                drafts, draft_tokens, accepted = (a - b for a, b in zip(spec_counters(engines["ngram"]), before))
                parted = [first_parting(a, b) for a, b in zip(outs["plain"], outs["ngram"])]
                rows.append((kind, batch, times, drafts, draft_tokens, accepted, parted))

    print(
        f"\n== {arch} decode with and without n-gram speculation (k = {args.k}; {args.output_len} tokens per "
        f"request, median over requests and {args.reps} rounds, ABBA; eager, {args.dtype}) =="
    )
    print(
        f"{'workload':>13} {'batch':>5} {'plain ms/tok':>13} {'ngram ms/tok':>13} {'ngram/plain':>12} "
        f"{'tokens/step':>12} {'accepted':>9} {'equal outputs':>14}"
    )
    for kind, batch, times, drafts, draft_tokens, accepted, parted in rows:
        a, b = statistics.median(times["plain"]), statistics.median(times["ngram"])
        per_step = 1 + accepted / drafts if drafts else 1.0
        rate = accepted / draft_tokens if draft_tokens else 0.0
        print(
            f"{kind:>13} {batch:>5} {a * 1e3:>13.2f} {b * 1e3:>13.2f} {b / a:>12.2f} {per_step:>12.2f} "
            f"{rate:>9.1%} {parted.count(None):>8}/{batch}"
        )
        for step, margin in (p for p in parted if p is not None):
            print(f"{'':>19} a request parts at step {step}, where the plain engine's top-2 margin is {margin:.3g}")


if __name__ == "__main__":
    main()
