"""Decode throughput of MLA-Trinity at tensor parallelism 2 vs 1 on this machine's cores, side by side.

Run (from the repository root)::

    .venv/bin/python deploy/bench_trinity_tp.py        # the measurement: compiled, 3 reps, 64 output tokens
    .venv/bin/python deploy/bench_trinity_tp.py --reps 1 --output-len 16 --enforce-eager   # smoke run

Options: `--help`. Results: a table on stdout and JSON (`--out`, default bench-out/bench_trinity_tp.json); engine
logs in bench-out/bench_trinity_tp-logs/. Measured figures and run times: docs/mla-trinity.md.

What it measures and how:
1. One checkpoint: `vllm_trn_plugin.demo.write_trinity_demo` (random weights; hidden 512, 32 q / 4 KV heads x 128,
   latent 256, 4 layers [S, S, S, F], 8 experts top-2, byte vocabulary 259) in `--dtype` (bfloat16 default,
   float32 allowed), optionally packed first (`--packed`: `vllm_trn_plugin.loaders.packed.pack`, MXFP4 experts
   expanded to FP8 at load, FP8 LM head).
2. Two engines, each a `vllm.LLM` in its own child process (this script with `--child`), tensor_parallel_size 1 and
   2, otherwise identical (max_model_len, max_num_seqs = the largest batch, max_num_batched_tokens >= the largest
   batch's prompt tokens, kv_cache_memory_bytes, prefix caching off, seed 0, compiled by default or
   `--enforce-eager`). They are started one after the other (each until ready) so that their startups do not
   compete for the cores, and both stay alive for the whole measurement; only one works at a time (an idle engine
   blocks on its input; vLLM's processes busy-poll their shared-memory queues for 1 s after the last message, so
   the script waits 1.5 s whenever it switches engine). Reps visit every batch size for both engines in ABBA order
   (rep 0: batch 1 TP1 then TP2, batch 8 TP2 then TP1; rep 1 the batches descending, ...), so that the slow drift
   of a shared machine hits both alike; the TP2/TP1 ratio is taken of the medians and per rep.
3. One measurement = B random byte-token prompts (ids < 256, `--prompt-len`, the same for both engines, fresh per
   rep), temperature 0, ignore_eos, submitted together in one `llm.generate`, run twice back to back: with
   max_tokens=1 (prefill and the first token) and with max_tokens=N (`--output-len`). Decode throughput =
   B x (N - 1) / (t(N) - t(1)), wall times of the two calls: prefill, first token and per-call overhead cancel.
   This, not vLLM's per-request timestamps, is the figure because the B requests do not start together: the
   engine core starts a step as soon as the first request reaches it and takes the others in later steps, so
   per-request timestamps mix batch sizes; the difference of the two calls keeps only the N - 1
   extra steps of the batch (its error is the difference between the two calls' staggering, printed as the
   first-token spread of each; `--output-len` large keeps it small). Cross-check, printed beside it: sum over the
   requests of (n - 1) / (last_token_ts - first_token_ts) (`RequestOutput.metrics`, filled on 0.32 with log stats
   on), exact in lockstep and low when staggered. Also printed: output tokens/s of the whole max_tokens=N call
   (B x N / t(N), prefill included). One discarded warm-up call per engine and batch size.
4. Greedy tokens of the two engines on the warm-up prompt, printed only: the TP=2 engine sums partial products in
   another order, so in bfloat16 they may diverge after a few tokens.

Caveats (this host: 2 cores, one NUMA node):
- vLLM's CPU build always runs a separate engine-core process (scheduler; token ids in, token ids out) plus one
  worker process per rank, besides the child's front end. At TP=1 its automatic binding ("auto") puts the worker's
  OpenMP threads on one core and logs the other as reserved for the rest; at TP=2 the plugin
  (engine_checks.bind_cpu_workers) sets VLLM_CPU_OMP_THREADS_BIND to one core per worker and nothing is reserved.
  vLLM's "OpenMP thread binding info" log block and the workers' own affinity, printed, read on this host:
    TP=1: VLLM_CPU_OMP_THREADS_BIND='auto', local_world_size=1, reserve_cpu_num=1, local_rank=0 core ids=[0],
          reserved_cpus=[1]; worker affinity [0], 1 thread.
    TP=2: VLLM_CPU_OMP_THREADS_BIND='0|1' (set by the plugin in the child: vLLM's "auto" refuses two workers on
          one NUMA node), local_world_size=2, reserve_cpu_num=2 but reserved_cpus=[] (vLLM reserves only under
          "auto"); rank 0 on [0], rank 1 on [1], 1 thread each.
  "reserved" is not enforced: in both engines the engine-core process's affinity is [0, 1] (it and the front end
  are not pinned). So at TP=1 the scheduler and front end have a core of their own; at TP=2 they share both cores
  with the workers, whose waits (the shared-memory all-reduce, the step queues) busy-poll. TP=2 gets twice the
  compute but pays two all-reduces per layer and per-step overheads that do not shrink: the >= 1.6x target at
  batch 8 is reported, not asserted.
- The workers' binding is read with `LLM.collective_rpc` (affinity of each worker's main thread after the
  warm-up, OMP_NUM_THREADS and any OpenMP affinity variable, the engine core's affinity), hence
  VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the children: it lets vLLM ship a function to its workers, nothing else.
- Neither child inherits VLLM_CPU_OMP_THREADS_BIND (removed from their environment, with a warning if this shell
  set it): the plugin sets it inside the TP=2 child, in the process that builds the engine config, before its
  workers start; the TP=1 child keeps vLLM's "auto". The value the child saw is printed.
- Absolute tokens/s vary run to run on a shared machine; compare the ratios measured side by side in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness as local

REPO = Path(__file__).resolve().parents[1]
ENGINES = {"tp1": 1, "tp2": 2}  # key -> tensor_parallel_size
LABEL = {"tp1": "TP=1", "tp2": "TP=2"}
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
MiB = 1 << 20
SWITCH_PAUSE_S = 1.5  # > shm_broadcast.SpinCondition.busy_loop_s (1 s): the idle engine's workers stop spinning
TARGET_RATIO = 1.6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="requests per call (default 1 8)")
    p.add_argument("--reps", type=int, default=3, help="measurements per engine and batch size (default 3)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--output-len", type=int, default=64, help="N: output tokens per request (default 64)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="checkpoint and engine dtype")
    p.add_argument("--packed", action="store_true", help="pack the checkpoint first (MXFP4 experts, FP8 LM head)")
    p.add_argument("--enforce-eager", action="store_true", help="both engines eager (default: compiled)")
    p.add_argument(
        "--hidden",
        type=int,
        help="hidden size instead of the demo's 512 (Trinity-Mini: 2048), to see how the ratio "
        "grows with the work per step",
    )
    p.add_argument("--moe-intermediate", type=int, help="experts' intermediate size instead of the demo's 128")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-mib", type=int, default=512, help="kv_cache_memory_bytes per engine, MiB")
    p.add_argument("--model-dir", type=Path, help="write the checkpoint here (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_trinity_tp.json"))
    p.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "ENGINE_JSON"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def prompts_for(seed: int, batch: int, length: int) -> list[list[int]]:
    """`batch` random prompts of byte ids (< 256: valid tokens of the demo's 259-entry vocabulary, no specials)."""
    rng = random.Random(seed)
    return [rng.choices(range(256), k=length) for _ in range(batch)]


# --------------------------------------------------------------------------------------------
# Child: one vLLM engine, driven by JSON lines on stdin; answers go out through harness.answer
# --------------------------------------------------------------------------------------------


def _worker_info(worker: Any) -> dict[str, Any]:
    """Run in each vLLM worker (collective_rpc): where its threads may run, and its parent's (the engine core)."""
    import torch

    parent = os.getppid()
    try:
        parent_affinity: list[int] | str = sorted(os.sched_getaffinity(parent))
    except OSError as exc:
        parent_affinity = str(exc)
    return {
        "rank": getattr(worker, "rank", None),
        "pid": os.getpid(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        # vLLM sets one of these per OpenMP runtime (GNU libgomp unless LD_PRELOAD names one)
        "omp_env": {
            k: os.environ[k]
            for k in ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
            if k in os.environ
        },
        "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
        "engine_core_pid": parent,
        "engine_core_affinity": parent_affinity,
    }


def child_main(model_dir: str, engine_json: str) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = local.start_child_engine(model_dir, json.loads(engine_json))
    for cmd in local.child_commands():
        if cmd["cmd"] == "worker_info":
            try:
                local.answer({"workers": llm.collective_rpc(_worker_info, timeout=120)})
            except Exception as exc:  # noqa: BLE001  (diagnostic only: report it, keep the engine)
                local.answer({"workers": None, "error": f"{type(exc).__name__}: {exc}"})
            continue
        ids = prompts_for(cmd["prompt_seed"], cmd["batch"], cmd["len"])
        sampling = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], sampling, use_tqdm=False)
        wall = time.perf_counter() - t0
        ms = [o.metrics for o in outs]
        have = all(m is not None for m in ms)
        local.answer(
            {
                "wall_s": wall,
                "n_gen": [len(o.outputs[0].token_ids) for o in outs],
                "preemptions": sum(m.num_preemptions for m in ms) if have else None,
                # engine-core monotonic timestamps, made relative to the first request's scheduling
                "first_token_ts": [m.first_token_ts - ms[0].scheduled_ts for m in ms] if have else None,
                "last_token_ts": [m.last_token_ts - ms[0].scheduled_ts for m in ms] if have else None,
                "tokens0": list(outs[0].outputs[0].token_ids)[:16],
            }
        )
    llm.llm_engine.engine_core.shutdown()


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


def start_engine(key: str, model_dir: Path, engine_kw: dict[str, Any], log_path: Path) -> local.EngineChild:
    """This script with --child: one vLLM engine in its own process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(model_dir), json.dumps(engine_kw)]
    env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    # Each engine chooses its own binding: the plugin sets one in the TP=2 child; TP=1 keeps vLLM's "auto".
    env.pop(THREADS_BIND, None)
    return local.EngineChild(LABEL[key], cmd, log_path, env, REPO)


def binding_log(eng: local.EngineChild) -> list[str]:
    """vLLM's "OpenMP thread binding info" record (and any warning of ompmultiprocessing.py), one entry per line
    of its multi-line message; vLLM repeats the "(EngineCore pid=...) INFO date [file:line]" prefix on each."""
    return [line.split("] ", 1)[-1].strip() for line in eng.log_lines if "[ompmultiprocessing.py:" in line]


def write_checkpoint(args: argparse.Namespace, root: Path) -> Path:
    import torch

    from vllm_trn_plugin.demo import write_trinity_demo

    geometry = {"hidden_size": args.hidden, "moe_intermediate_size": args.moe_intermediate}
    overrides = {k: v for k, v in geometry.items() if v is not None}
    src = write_trinity_demo(root / "demo", seed=args.seed, dtype=getattr(torch, args.dtype), **overrides)
    if not args.packed:
        return src
    from vllm_trn_plugin.loaders.packed import pack

    report = pack(src, root / "packed")
    print(f"packed: {len(report.quantized)} MXFP4 matrices, FP8 {report.fp8 or 'none'}")
    return report.dst


def measure_one(eng: local.EngineChild, args: argparse.Namespace, batch: int, prompt_seed: int) -> dict[str, Any]:
    """The same B prompts with max_tokens=1 and =N, back to back; throughputs from the two wall times."""
    n = args.output_len
    base = {"cmd": "generate", "batch": batch, "len": args.prompt_len, "prompt_seed": prompt_seed}
    one = eng.request({**base, "max_tokens": 1})
    full = eng.request({**base, "max_tokens": n})
    for ans, want in ((one, 1), (full, n)):
        if ans["n_gen"] != [want] * batch:
            raise SystemExit(f"{eng.label}: expected {want} tokens per request, got {ans['n_gen']}")
        if ans["preemptions"]:
            raise SystemExit(f"{eng.label}: {ans['preemptions']} preemption(s): the timing would hold a re-prefill")
    res: dict[str, Any] = {
        "t1_s": one["wall_s"],
        "tN_s": full["wall_s"],
        "decode_tok_s": batch * (n - 1) / (full["wall_s"] - one["wall_s"]),
        "call_tok_s": batch * n / full["wall_s"],
        "tokens0": full["tokens0"],
        "metrics_decode_tok_s": None,
        "first_token_spread_ms": None,
    }
    if full["first_token_ts"] is not None:
        first, last = full["first_token_ts"], full["last_token_ts"]
        # Each request's own decode rate, summed: right in lockstep; with staggered first tokens (see the
        # description) an early request's rate also pays for the later ones' prefill, so this reads low.
        res["metrics_decode_tok_s"] = sum((n - 1) / (b - a) for a, b in zip(first, last) if b > a) or None
        res["first_token_spread_ms"] = 1e3 * (max(first) - min(first))
        res["first_token_spread_ms_t1"] = 1e3 * (max(one["first_token_ts"]) - min(one["first_token_ts"]))
    return res


def measure(engines: dict[str, local.EngineChild], args: argparse.Namespace) -> list[dict[str, Any]]:
    keys = list(engines)
    runs: list[dict[str, Any]] = []
    total = args.reps * len(args.batch_sizes) * len(keys)
    last_key = None
    for rep in range(args.reps):
        batches = args.batch_sizes if rep % 2 == 0 else args.batch_sizes[::-1]
        for i, batch in enumerate(batches):
            order = keys if (rep + i) % 2 == 0 else keys[::-1]
            prompt_seed = args.seed * 1_000_003 + rep * 1009 + batch  # same prompts for both engines
            for key in order:
                if key != last_key:
                    time.sleep(SWITCH_PAUSE_S)  # the other engine's workers go from spinning to sleeping
                last_key = key
                r = measure_one(engines[key], args, batch, prompt_seed)
                runs.append({"engine": key, "rep": rep, "batch": batch, **r})
                check = (
                    "" if r["metrics_decode_tok_s"] is None else f" (vLLM timestamps {r['metrics_decode_tok_s']:.0f})"
                )
                print(
                    f"  [{len(runs)}/{total}] rep {rep} batch {batch:>2} {LABEL[key]}: decode {r['decode_tok_s']:7.1f} "
                    f"tok/s{check}; whole call {r['call_tok_s']:6.1f} tok/s; t(1) {r['t1_s']:.2f} s, "
                    f"t({args.output_len}) {r['tN_s']:.2f} s",
                    flush=True,
                )
    return runs


def _med(xs: list[float | None]) -> float | None:
    ys = [x for x in xs if x is not None]
    return statistics.median(ys) if ys else None


def summarize(runs: list[dict[str, Any]], batch_sizes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for b in batch_sizes:
        row: dict[str, Any] = {}
        for key in ENGINES:
            rs = [r for r in runs if r["engine"] == key and r["batch"] == b]
            dec = [r["decode_tok_s"] for r in rs]
            row[key] = {
                "decode_tok_s": dec,
                "median": statistics.median(dec),
                "min": min(dec),
                "max": max(dec),
                "call_tok_s_median": statistics.median(r["call_tok_s"] for r in rs),
                "metrics_decode_tok_s_median": _med([r["metrics_decode_tok_s"] for r in rs]),
                "first_token_spread_ms_max": max((r["first_token_spread_ms"] or 0.0) for r in rs),
                "first_token_spread_ms_t1_max": max((r.get("first_token_spread_ms_t1") or 0.0) for r in rs),
            }
        row["ratio_of_medians"] = row["tp2"]["median"] / row["tp1"]["median"]
        m1, m2 = row["tp1"]["metrics_decode_tok_s_median"], row["tp2"]["metrics_decode_tok_s_median"]
        row["metrics_ratio_of_medians"] = m2 / m1 if m1 and m2 else None
        row["call_ratio_of_medians"] = row["tp2"]["call_tok_s_median"] / row["tp1"]["call_tok_s_median"]
        per_rep = []
        for rep in sorted({r["rep"] for r in runs}):
            by = {r["engine"]: r for r in runs if r["rep"] == rep and r["batch"] == b}
            if set(by) == set(ENGINES):
                per_rep.append(by["tp2"]["decode_tok_s"] / by["tp1"]["decode_tok_s"])
        row["per_rep_ratios"] = per_rep
        out[str(b)] = row
    return out


def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    s = res["summary"]
    n = args.output_len
    print(
        f"\n== Decode throughput, tokens/s (median of {args.reps}; B x {n - 1} tokens / (t(max_tokens={n}) - "
        f"t(max_tokens=1)), prompts of {args.prompt_len}) =="
    )
    print(
        f"{'batch':>5}{'TP=1':>9}{'TP=2':>9}{'TP2/TP1':>9}  {'per-rep ratios':24}{'whole call TP1/TP2 (ratio)':>30}"
        f"{'vLLM ts ratio':>15}  target"
    )
    for b in args.batch_sizes:
        row = s[str(b)]
        t1, t2 = row["tp1"], row["tp2"]
        reps = ", ".join(f"{x:.2f}" for x in row["per_rep_ratios"])
        call = f"{t1['call_tok_s_median']:.0f} / {t2['call_tok_s_median']:.0f} ({row['call_ratio_of_medians']:.2f})"
        mr = row["metrics_ratio_of_medians"]
        target = (
            f">= {TARGET_RATIO} ({'met' if row['ratio_of_medians'] >= TARGET_RATIO else 'NOT met'})" if b == 8 else ""
        )
        print(
            f"{b:>5}{t1['median']:>9.1f}{t2['median']:>9.1f}{row['ratio_of_medians']:>9.2f}  {reps:24}{call:>30}"
            f"{(f'{mr:.2f}' if mr else '-'):>15}  {target}"
        )
    print(
        "spread (min-max decode tok/s); vLLM per-request timestamps, sum of (n-1)/(last-first) (median); "
        "max first-token spread in a batch, calls max_tokens=N / =1:"
    )
    for b in args.batch_sizes:
        for key in ENGINES:
            x = s[str(b)][key]
            mt = x["metrics_decode_tok_s_median"]
            print(
                f"  batch {b:>2} {LABEL[key]}: {x['min']:.1f}-{x['max']:.1f}; vLLM ts {mt:.1f}; "
                f"first-token spread {x['first_token_spread_ms_max']:.0f} / {x['first_token_spread_ms_t1_max']:.0f} ms"
                if mt
                else f"  batch {b:>2} {LABEL[key]}: {x['min']:.1f}-{x['max']:.1f}; no vLLM timestamps"
            )

    print("\n== Engines ==")
    for key, info in res["engines"].items():
        print(
            f"{LABEL[key]}: startup {info['startup_s']:.0f} s, {info['compilation_mode']}, quantization "
            f"{info['quantization']}, max_num_batched_tokens {info['max_num_batched_tokens']}, "
            f"{info['num_blocks']} KV blocks of {info['block_size']}; {THREADS_BIND} in the engine's process after "
            f"its config: {info['threads_bind_env']!r}"
        )
        for line in info["log_binding"]:
            print(f"  log: {line}")
        for w in info.get("workers") or []:
            print(
                f"  worker rank {w['rank']} (pid {w['pid']}): affinity {w['affinity']}, torch threads "
                f"{w['torch_threads']}, OMP_NUM_THREADS {w['OMP_NUM_THREADS']}, "
                f"{w['omp_env'] or 'no OMP affinity variable'}; "
                f"engine core (pid {w['engine_core_pid']}) affinity {w['engine_core_affinity']}"
            )
        if info.get("workers_error"):
            print(f"  worker info failed: {info['workers_error']}")
    g = res["greedy_check"]
    print(
        f"greedy tokens, TP=2 vs TP=1 (first request of the warm-up at batch {g['batch']}, {args.dtype}): "
        f"{g['same_prefix']} of the first {g['compared']} identical (printed only)"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(*args.child)
        return
    t_all = time.perf_counter()
    args.batch_sizes = sorted(set(args.batch_sizes))
    if args.output_len < 2:
        raise SystemExit("--output-len must be >= 2 (decode is the tokens after the first)")
    if args.prompt_len + args.output_len > args.max_model_len:
        raise SystemExit("--prompt-len + --output-len exceeds --max-model-len")
    out_dir = args.out.parent
    log_dir = out_dir / "bench_trinity_tp-logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    import vllm

    cores = sorted(os.sched_getaffinity(0))
    print(f"== MLA-Trinity decode throughput, tensor parallelism 2 vs 1 (cores allowed: {cores})")
    print(f"vllm {vllm.__version__}; plugin source: {local.plugin_state(REPO)}")
    if THREADS_BIND in os.environ:
        print(
            f"WARNING: {THREADS_BIND}={os.environ[THREADS_BIND]!r} is set here; it is removed for both engines "
            "(each chooses its own binding)"
        )
    max_batch = max(args.batch_sizes)
    engine_kw = dict(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max_batch,
        # The whole batch's prompts in one step: every request gets its first token together (lockstep decode).
        max_num_batched_tokens=max(args.max_model_len, max_batch * args.prompt_len),
        enable_prefix_caching=False,  # the max_tokens=N call must prefill again, as the max_tokens=1 call did
        kv_cache_memory_bytes=args.kv_cache_mib * MiB,
        enforce_eager=args.enforce_eager,
        disable_log_stats=False,  # fills RequestOutput.metrics (the cross-check)
        seed=0,
    )
    result: dict[str, Any] = {
        "args": vars(args),
        "cores": cores,
        "engine_kw": engine_kw,
        "plugin_state": local.plugin_state(REPO),
        "vllm": vllm.__version__,
    }
    engines: dict[str, local.EngineChild] = {}
    with local.scratch_dir(args.model_dir, "bench-trinity-tp-") as root, contextlib.ExitStack() as running:
        t0 = time.perf_counter()
        model_dir = write_checkpoint(args, root)
        cfg = json.loads((model_dir / "config.json").read_text())
        print(
            f"checkpoint ({time.perf_counter() - t0:.0f} s): write_trinity_demo, {args.dtype}"
            f"{', packed' if args.packed else ''}; hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
            f"{cfg['num_attention_heads']} q / {cfg['num_key_value_heads']} KV heads x {cfg['head_dim']}, latent "
            f"{cfg['kv_lora_rank']}, {cfg['num_experts']} experts top-{cfg['num_experts_per_tok']}"
        )
        print(
            f"engines: max_model_len {args.max_model_len}, max_num_seqs {max_batch}, max_num_batched_tokens "
            f"{engine_kw['max_num_batched_tokens']}, kv_cache {args.kv_cache_mib} MiB, prefix caching off, "
            f"{'eager' if args.enforce_eager else 'compiled'}; batches {args.batch_sizes}, {args.reps} reps, "
            f"prompt {args.prompt_len}, output {args.output_len}"
        )
        info: dict[str, dict[str, Any]] = {}
        for key, tp in ENGINES.items():  # one after the other: startups must not share the cores
            t0 = time.perf_counter()
            kw = {**engine_kw, "tensor_parallel_size": tp}
            engines[key] = running.enter_context(start_engine(key, model_dir, kw, log_dir / f"{key}.log"))
            info[key] = engines[key].wait()
            print(f"{LABEL[key]} engine up ({time.perf_counter() - t0:.0f} s)", flush=True)

        print("warm-up: one call per engine and batch size")
        warm: dict[str, dict[int, dict[str, Any]]] = {key: {} for key in engines}
        for key, eng in engines.items():
            time.sleep(SWITCH_PAUSE_S)
            for b in args.batch_sizes:
                warm[key][b] = eng.request(
                    {
                        "cmd": "generate",
                        "batch": b,
                        "len": args.prompt_len,
                        "max_tokens": args.output_len,
                        "prompt_seed": 7,
                    }
                )
            w = eng.request({"cmd": "worker_info"})
            info[key]["workers"] = w["workers"]
            info[key]["workers_error"] = w.get("error")
            info[key]["log_binding"] = binding_log(eng)
        result["engines"] = info
        result["warmup"] = {key: {str(b): v for b, v in d.items()} for key, d in warm.items()}
        a, b_ = warm["tp1"][max_batch]["tokens0"], warm["tp2"][max_batch]["tokens0"]
        result["greedy_check"] = {
            "batch": max_batch,
            "compared": min(len(a), len(b_)),
            "same_prefix": same_prefix(a, b_),
            "tp1": a,
            "tp2": b_,
        }

        t0 = time.perf_counter()
        result["runs"] = measure(engines, args)
        result["measure_s"] = time.perf_counter() - t0
        result["summary"] = summarize(result["runs"], args.batch_sizes)

    report(result, args)
    local.save_result(args.out, result, t_all, log_dir)


if __name__ == "__main__":
    main()
