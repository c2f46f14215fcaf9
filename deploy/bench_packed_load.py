"""Packed MXFP4 checkpoints: expansion speed, startup time, peak memory and resident expert bytes, side by side.

Run (from the repository root)::

    .venv/bin/python deploy/bench_packed_load.py                # ~15 min, ~9 GB of disk under bench-out/
    .venv/bin/python deploy/bench_packed_load.py --moe-layers 1 # quick look (packed checkpoint < 2 GB)

1. Expansion throughput: `loaders.mxfp4.expand_rows` on a random [65536 x 2048] MXFP4 matrix (by the compiled
   loop, and again on torch ops, the fallback where no C compiler is found) vs this machine's memcpy (torch copy of
   a buffer the size of the FP8 output), interleaved reps, same thread count; printed side by
   side as output bytes per second and as a ratio of memcpy bandwidth (target >= 0.3). Then a rank's expansion
   time under tensor parallelism: rank 0 of 2 expanding only the part it keeps (the output rows of a
   column-parallel matrix, the input columns of a row-parallel one, as `packed_weights` does at TP=2) against the
   whole matrix (TP=1), timed in-process (no engine). `--expansion-only` stops after this part.
2. One MLA-Trinity checkpoint at Trinity-Mini's layer geometry (hidden 2048, 128 experts x 1024, 32 q / 4 KV
   heads x 128, latent 256, [S, S, S, F] pattern) with `--moe-layers` MoE layers after one dense layer, written
   in bf16 tensor by tensor (shards of ~1 GB), and its packed form (`vllm-trn pack`). Each is loaded by vLLM
   (`vllm.LLM`, CPU, enforce_eager, one in-process executor) in a fresh child process: time to a ready engine
   (construction of LLM, which includes building, loading and the profile run) and the child's peak RSS
   (VmHWM: the file pages of the checkpoint being read count while mapped), then the bytes of the routed-expert
   parameters resident in the model (w13/w2 weights, plus scales and bias-correction vectors for FP8).
The bf16 engine runs first, then the packed one, then both again (two reps each, interleaved), and the medians
are compared: the machine is noisy, the ratios are what count.
3. Per rank under tensor parallelism (`--tensor-parallel-sizes`, default 1 2): the packed checkpoint loaded by
   `vllm.LLM` with worker processes (`distributed_executor_backend="mp"`, so TP=1 is measured in a worker
   process too), and every worker reports, through `apply_model`, the bytes of the parameters it holds (its
   shard), its routed-expert bytes, its anonymous resident memory after the load (RssAnon: the shard plus the
   runtime, not the checkpoint's file pages) and its peak RSS (VmHWM, file pages included). The claim checked:
   a rank's memory is about its shard, not the whole checkpoint (the reader streams one matrix at a time; each
   rank expands only the part of each MLP matrix it keeps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from vllm import LLM
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=512, enforce_eager=True,
          kv_cache_memory_bytes=64 << 20, distributed_executor_backend="uni", skip_tokenizer_init=False)
ready = time.perf_counter() - t0

def expert_bytes(model):
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name and (".w13_" in name or ".w2_" in name):
            total += p.numel() * p.element_size()
    return total

nbytes = llm.apply_model(expert_bytes)[0]
# VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child would report its parent's peak.
hwm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print("RESULT" + json.dumps({"ready_s": ready, "peak_rss": hwm, "expert_bytes": nbytes}))
"""


def worker_memory(model: torch.nn.Module) -> dict[str, int]:
    """For `LLM.apply_model` (shipped to the workers by value: this script is the child's __main__): the bytes of the
    parameters the worker holds, of its routed experts, its anonymous resident memory (RssAnon) and its peak RSS
    (VmHWM, file pages included)."""
    status = {}
    for line in open("/proc/self/status"):
        if line.startswith(("Vm", "Rss")):
            status[line.split(":")[0]] = int(line.split()[1]) * 1024
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if ".experts." in n and (".w13_" in n or ".w2_" in n)
    )
    return {"param_bytes": params, "expert_bytes": experts, "rss_anon": status["RssAnon"], "peak_rss": status["VmHWM"]}


def child_per_rank(ckpt: str, tp: int) -> None:
    """The child process of part 3 (this script with --child-tp): one engine, each worker's figures on stdout."""
    from vllm import LLM

    llm = LLM(
        model=ckpt,
        dtype="bfloat16",
        max_model_len=512,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
    )
    print("RESULT" + json.dumps(llm.apply_model(worker_memory)), flush=True)


def load_per_rank(ckpt: Path, tp: int) -> list[dict]:
    """The packed checkpoint at tensor-parallel size `tp` in a fresh engine: each worker's memory figures."""
    env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # apply_model ships a function to the workers
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the plugin binds the workers itself
    cmd = [sys.executable, __file__, "--child-tp", str(ckpt), str(tp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    if not line:
        raise SystemExit(f"engine on {ckpt} at TP={tp} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[0].removeprefix("RESULT"))


def expansion(reps: int, rows: int) -> dict:
    """Part 1: `expand_rows` on a random [rows x 2048] MXFP4 matrix against memcpy of its FP8 output's size, and a
    tensor-parallel rank's share of it: rank 0 of 2 expanding its output rows (column-parallel gate/up) and its input
    columns (row-parallel down, into a column slice of the whole-size tensor, as vLLM's loaders narrow it) against
    the whole matrix (TP=1). Both writers run twice over: into a destination written before (the ratio the target is
    about: the work of the copy itself) and into a fresh one (what a load pays: the first touch of every page, the
    same for any writer, which narrows the ratio). Interleaved reps, medians, same thread count."""
    from vllm_trn_plugin.envs import NATIVE_EXPAND
    from vllm_trn_plugin.loaders.mxfp4 import expand_rows

    def on_torch_ops(run: object) -> object:  # the fallback where no C compiler is found
        def wrapped() -> object:
            os.environ[NATIVE_EXPAND] = "0"
            try:
                return run()
            finally:
                del os.environ[NATIVE_EXPAND]

        return wrapped

    g = torch.Generator().manual_seed(0)
    cols = 2048
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    scales = (118 + torch.randint(0, 8, (rows, cols // 32), generator=g)).to(torch.uint8)  # spread 7, as shipped
    src, dst = torch.ones(rows * cols, dtype=torch.uint8), torch.empty(rows * cols, dtype=torch.uint8)
    dst.copy_(src)
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    out.view(torch.uint8).fill_(0)
    runs = {
        "memcpy": lambda: dst.copy_(src),
        "expand": lambda: expand_rows(packed, scales, file="bench", tensor="w", out=out),
        "expand_torch_ops": on_torch_ops(lambda: expand_rows(packed, scales, file="bench", tensor="w", out=out)),
        "memcpy_fresh": lambda: torch.empty_like(src).copy_(src),
        "expand_fresh": lambda: expand_rows(packed, scales, file="bench", tensor="w"),
        "tp2_rows": lambda: expand_rows(
            packed, scales, file="bench", tensor="w", rows=(0, rows // 2), out=out[: rows // 2]
        ),
        "tp2_cols": lambda: expand_rows(
            packed, scales, file="bench", tensor="w", cols=(0, cols // 2), out=out[:, : cols // 2]
        ),
    }
    for f in runs.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for k, f in runs.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    out_bytes = rows * cols
    return {
        "elements": out_bytes,
        "expand_GBps": out_bytes / med["expand"] / 1e9,
        "memcpy_GBps": out_bytes / med["memcpy"] / 1e9,
        "ratio": med["memcpy"] / med["expand"],
        "expand_torch_ops_GBps": out_bytes / med["expand_torch_ops"] / 1e9,
        "ratio_torch_ops": med["memcpy"] / med["expand_torch_ops"],
        "expand_fresh_GBps": out_bytes / med["expand_fresh"] / 1e9,
        "memcpy_fresh_GBps": out_bytes / med["memcpy_fresh"] / 1e9,
        "ratio_fresh": med["memcpy_fresh"] / med["expand_fresh"],
        "threads": torch.get_num_threads(),
        "tp1_s": med["expand"],
        "tp2_rows_s": med["tp2_rows"],
        "tp2_cols_s": med["tp2_cols"],
    }


def report_expansion(ex: dict) -> None:
    print(
        f"{ex['elements'] / 1e6:.0f}M elements, {ex['threads']} threads: expand {ex['expand_GBps']:.2f} GB/s of FP8 "
        f"output | memcpy {ex['memcpy_GBps']:.2f} GB/s | ratio {ex['ratio']:.3f} x memcpy (target >= 0.3)"
    )
    print(
        f"the same on torch ops (no C compiler; VLLM_TRN_NATIVE_EXPAND=0): {ex['expand_torch_ops_GBps']:.2f} GB/s | "
        f"ratio {ex['ratio_torch_ops']:.3f}"
    )
    print(
        f"into fresh memory (first touch of every page, as at load): expand {ex['expand_fresh_GBps']:.2f} GB/s | "
        f"memcpy {ex['memcpy_fresh_GBps']:.2f} GB/s | ratio {ex['ratio_fresh']:.3f}"
    )
    print(
        f"per-rank expansion of that matrix: TP=1 {ex['tp1_s'] * 1e3:.1f} ms | TP=2 rank 0, output rows "
        f"(gate/up) {ex['tp2_rows_s'] * 1e3:.1f} ms ({ex['tp2_rows_s'] / ex['tp1_s']:.2f}x) | TP=2 rank 0, input "
        f"columns (down) {ex['tp2_cols_s'] * 1e3:.1f} ms ({ex['tp2_cols_s'] / ex['tp1_s']:.2f}x)"
    )


def write_bf16(out: Path, moe_layers: int) -> Path:
    """The bf16 MLA-Trinity checkpoint of part 2: one dense layer, then `moe_layers` MoE layers, in ~1 GB shards."""
    from vllm_trn_plugin.demo import TRINITY_MINI, write_trinity_demo

    n = 1 + moe_layers
    types = ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(n)]
    geometry = {**TRINITY_MINI, "num_hidden_layers": n, "num_dense_layers": 1, "layer_types": types, "vocab_size": 259}
    return write_trinity_demo(out, dtype=torch.bfloat16, **geometry)


def dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.glob("*.safetensors"))


def load_once(ckpt: Path) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ckpt)], capture_output=True, text=True, env=env)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    if not line:
        raise SystemExit(f"engine on {ckpt} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[0].removeprefix("RESULT"))


def report_medians(b: dict, p: dict) -> None:
    """Part 2's medians, packed vs bf16."""
    print("== medians (packed vs bf16)")
    print(
        f"startup to ready engine: {p['ready_s']:.1f} s vs {b['ready_s']:.1f} s "
        f"(ratio {p['ready_s'] / b['ready_s']:.2f})"
    )
    print(
        f"peak RSS: {p['peak_rss'] / 2**30:.2f} vs {b['peak_rss'] / 2**30:.2f} GiB "
        f"(ratio {p['peak_rss'] / b['peak_rss']:.2f})"
    )
    print(
        f"resident expert bytes: {p['expert_bytes'] / 2**30:.3f} vs {b['expert_bytes'] / 2**30:.3f} GiB "
        f"(bf16 / FP8 = {b['expert_bytes'] / p['expert_bytes']:.2f}x)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe-layers", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tensor-parallel-sizes", type=int, nargs="*", default=[1, 2], help="part 3 (none: skip)")
    ap.add_argument("--out", default="bench-out/bench_packed_load")
    ap.add_argument("--expansion-reps", type=int, default=7)
    ap.add_argument("--expansion-only", action="store_true", help="part 1 only (a minute, no checkpoint)")
    ap.add_argument("--child-tp", nargs=2, metavar=("CKPT", "TP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_tp:
        child_per_rank(args.child_tp[0], int(args.child_tp[1]))
        return
    from vllm_trn_plugin.loaders.packed import pack

    root = Path(args.out)
    print("== expansion throughput (loaders.mxfp4.expand_rows) vs memcpy, same run")
    ex = expansion(reps=args.expansion_reps, rows=65536)  # 128 MB of output: more than any L3 here
    report_expansion(ex)
    if args.expansion_only:
        return

    bf16, packed = root / "bf16", root / "packed"
    if not (bf16 / "config.json").exists():
        t = time.perf_counter()
        write_bf16(bf16, args.moe_layers)
        print(f"wrote {bf16} in {time.perf_counter() - t:.0f} s")
    if not (packed / "config.json").exists():
        t = time.perf_counter()
        pack(bf16, packed)
        print(f"packed to {packed} in {time.perf_counter() - t:.0f} s")
    sizes = {"bf16": dir_bytes(bf16), "packed": dir_bytes(packed)}
    print(f"checkpoint bytes: bf16 {sizes['bf16'] / 1e9:.2f} GB, packed {sizes['packed'] / 1e9:.2f} GB")

    runs: dict[str, list[dict]] = {"bf16": [], "packed": []}
    for rep in range(args.reps):
        for kind, ckpt in (("bf16", bf16), ("packed", packed)):
            r = load_once(ckpt)
            runs[kind].append(r)
            print(
                f"  rep {rep} {kind:>6}: ready {r['ready_s']:.1f} s, peak RSS {r['peak_rss'] / 2**30:.2f} GiB, "
                f"expert params {r['expert_bytes'] / 2**30:.3f} GiB"
            )
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items() if v}
    b, p = med.get("bf16"), med.get("packed")
    if b and p:
        report_medians(b, p)
    per_rank = {}
    if args.tensor_parallel_sizes:
        print(f"== per rank, packed checkpoint ({sizes['packed'] / 2**30:.2f} GiB on disk)")
    for tp in args.tensor_parallel_sizes:
        per_rank[tp] = load_per_rank(packed, tp)
        for r, m in enumerate(per_rank[tp]):
            print(
                f"  TP={tp} rank {r}: params {m['param_bytes'] / 2**30:.3f} GiB (experts "
                f"{m['expert_bytes'] / 2**30:.3f}), RssAnon {m['rss_anon'] / 2**30:.2f} GiB, "
                f"peak RSS {m['peak_rss'] / 2**30:.2f} GiB"
            )
    if 1 in per_rank:
        one = per_rank[1][0]
        for tp, ranks in per_rank.items():
            if tp == 1:
                continue
            ratio = {k: max(m[k] for m in ranks) / one[k] for k in one}
            print(
                f"TP={tp} vs TP=1, largest rank: params {ratio['param_bytes']:.2f}x, experts "
                f"{ratio['expert_bytes']:.2f}x, RssAnon {ratio['rss_anon']:.2f}x, peak RSS {ratio['peak_rss']:.2f}x"
            )
    root.mkdir(parents=True, exist_ok=True)
    (root / "result.json").write_text(
        json.dumps(
            {"expansion": ex, "checkpoint_bytes": sizes, "runs": runs, "medians": med, "per_rank": per_rank}, indent=2
        )
    )


if __name__ == "__main__":
    main()
