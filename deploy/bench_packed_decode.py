"""Decode time per token: MLA-Trinity packed (MXFP4 -> FP8 at load) vs the same model in bf16, side by side.

Run (from the repository root)::

    .venv/bin/python deploy/bench_packed_decode.py                     # vocabulary 131072, hidden 1024, batch 1 and 8
    .venv/bin/python deploy/bench_packed_decode.py --residency fp8     # the packed engine holding FP8 bytes only
    .venv/bin/python deploy/bench_packed_decode.py --cap-isa avx2      # as an AVX2-only CPU would (isa_cap/)

What it does:
1. A random MLA-Trinity checkpoint in bf16 at Trinity-Mini's vocabulary (131072) and the given hidden size, few
   layers (`vllm_trn_plugin.demo.write_trinity_demo`: [S, S, S, F], one dense layer, then MoE), and its packed
   form (`vllm-trn pack`: MLPs and experts MXFP4, the LM head FP8).
2. Both served by `vllm.LLM` (CPU, bf16, eager unless --compiled, prefix caching off), both engines alive for the
   whole run. For each batch size, `--reps` rounds in ABBA order (bf16 then packed, then packed then bf16, ...), so
   the machine's drift hits both alike; each round generates `--output-len` tokens (greedy, ignore_eos) for
   `batch` short random prompts submitted together.
3. Decode time per step from vLLM's per-request timestamps (`RequestOutput.metrics`, log stats on):
   (last_token_ts - first_token_ts) / (tokens - 1), the median over the batch's requests, then over rounds; printed
   per engine with the packed / bf16 ratio (the target: <= 1.1).
The packed engine's FP8 matrices hold a compute copy on CPU by default (VLLM_TRN_FP8_RESIDENCY, docs/fp8.md);
`--residency fp8` measures FP8-only residency instead. `--cap-isa avx512|avx2` reruns the whole benchmark under
`isa_cap.cap_env`: both engines compute as an AVX-512 BF16 CPU without AMX, or an AVX2-only one, would, on this
machine's memory (a stand-in for that CPU; say so with its figures).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import decode_seconds
from isa_cap import CAPS, cap_env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=131072, help="vocabulary (Trinity-Mini: 131072)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4, help="a multiple of 4: [S, S, S, F] repeated")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="requests decoding together")
    p.add_argument("--output-len", type=int, default=16, help="tokens per request (default 16)")
    p.add_argument("--reps", type=int, default=4, help="rounds per engine and batch size (default 4, ABBA order)")
    p.add_argument("--residency", choices=["copy", "fp8"], default="copy", help="VLLM_TRN_FP8_RESIDENCY")
    p.add_argument("--compiled", action="store_true", help="torch.compile both engines (default eager)")
    p.add_argument("--model-dir", type=Path, help="write the checkpoints here (default: a temp dir)")
    p.add_argument("--cap-isa", choices=CAPS, default="native", help="compute as a lesser x86 CPU (isa_cap/)")
    return p.parse_args(argv)


def write_checkpoints(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    from vllm_trn_plugin.demo import write_trinity_demo
    from vllm_trn_plugin.loaders.packed import pack

    bf16 = write_trinity_demo(
        root / "bf16",
        seed=0,
        dtype=torch.bfloat16,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
        * (args.layers // 4),
        num_experts=args.experts,
    )
    return {"bf16": bf16, "packed": pack(bf16, root / "packed").dst}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cap_isa != "native" and os.environ.get("TRN_BENCH_ISA_CAP") != args.cap_isa:
        # Start again under the cap: torch, oneDNN and FBGEMM read it once, at each process's start.
        os.execve(
            sys.executable, [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)], cap_env(args.cap_isa)
        )
    os.environ["VLLM_TRN_FP8_RESIDENCY"] = args.residency  # read when the packed engine loads
    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory(prefix="bench-packed-decode-", dir=args.model_dir) as tmp:
        t0 = time.perf_counter()
        ckpts = write_checkpoints(args, Path(tmp))
        print(f"checkpoints written in {time.perf_counter() - t0:.0f} s: {ckpts}")
        engines = {}
        for key, path in ckpts.items():
            t0 = time.perf_counter()
            engines[key] = LLM(
                model=str(path),
                dtype="bfloat16",
                max_model_len=256,
                max_num_seqs=max(args.batches),
                enforce_eager=not args.compiled,
                enable_prefix_caching=False,
                disable_log_stats=False,  # fills RequestOutput.metrics
                kv_cache_memory_bytes=256 << 20,
                seed=0,
            )
            print(f"{key}: engine ready in {time.perf_counter() - t0:.0f} s")
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        g = torch.Generator().manual_seed(0)
        results: dict[int, dict[str, list[float]]] = {}
        for batch in args.batches:
            prompts = [{"prompt_token_ids": torch.randint(0, 256, (12,), generator=g).tolist()} for _ in range(batch)]
            for llm in engines.values():  # warm-up round, discarded
                llm.generate(prompts, params, use_tqdm=False)
            times: dict[str, list[float]] = {k: [] for k in engines}
            for rep in range(args.reps):
                for key in list(engines) if rep % 2 == 0 else list(engines)[::-1]:
                    outs = engines[key].generate(prompts, params, use_tqdm=False)
                    times[key].append(statistics.median(decode_seconds(outs, args.output_len)))
            results[batch] = times

    print(
        f"\n== Decode ms per step, MLA-Trinity packed vs bf16 (vocabulary {args.vocab}, hidden {args.hidden}, "
        f"{args.layers} layers, {args.experts} experts; median of {args.reps} rounds, ABBA; "
        f"{'compiled' if args.compiled else 'eager'}; packed residency {args.residency}; CPU {args.cap_isa}) =="
    )
    print(f"{'batch':>6} {'bf16 ms':>9} {'packed ms':>10} {'packed/bf16':>12}   rounds (bf16 | packed)")
    for batch, times in results.items():
        b, p = statistics.median(times["bf16"]), statistics.median(times["packed"])
        runs = (
            " ".join(f"{t * 1e3:.1f}" for t in times["bf16"])
            + " | "
            + " ".join(f"{t * 1e3:.1f}" for t in times["packed"])
        )
        print(f"{batch:>6} {b * 1e3:>9.1f} {p * 1e3:>10.1f} {p / b:>12.2f}   {runs}")


if __name__ == "__main__":
    main()
