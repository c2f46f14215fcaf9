"""Laplace decode benchmark: time per output token at two prompt lengths, and state bytes vs a Llama KV cache.

Run (from the repository root)::

    .venv/bin/python deploy/bench_laplace.py

Options: `--help`. `--full` benchmarks the true 3B geometry (spec §2): writing its random checkpoint
peaks at ~18 GB of RAM (fp32 draws + bf16 copy), serving needs 6-12 GB, and on 2 cores each 4096-token
prefill takes minutes, so it needs a bigger machine than the 2-core, 24 GiB development boxes.
`--state-only` prints part 2 without starting vLLM.

dtype: `auto` picks bfloat16 only where the CPU has native bf16 matmul (AVX512-BF16 or AMX); on an
AVX2-only CPU torch emulates the bf16 GEMM, several times slower than fp32, so it uses float32 there.

1. Decode time per output token for prompt lengths 512 and 4096 (design: ratio ~1.0, since a decode
   step is O(1) in context). One `vllm.LLM` serves a random Laplace demo checkpoint; one request at a
   time, random prompt token ids, fixed output length (`ignore_eos`, temperature 0). Decode time per
   token comes from vLLM's own per-request timestamps (`RequestOutput.metrics`, a `RequestStateStats`:
   (last_token_ts - first_token_ts) / (num_generation_tokens - 1)), never from the difference of two
   runs. The lengths are interleaved ABBA-style (512, 4096, 4096, 512, ...) after one discarded
   warm-up request per length; reported: medians and the ratio of medians. Prefill time
   (first_token_ts - scheduled_ts) is reported alongside (expected ~x8, since chunked prefill is O(T)).
2. Recurrent-state bytes per sequence (the plugin's own state shapes/dtypes, i.e. what
   `LaplaceMixer.get_state_shape/get_state_dtype` return, via `LaplaceForCausalLM.get_mamba_state_*_from_config`
   on vLLM's resolved engine config, packed by vLLM's `MambaSpec`) vs a same-size Llama's KV cache at 8192
   tokens (vLLM's `FullAttentionSpec`, bf16, block 16), for the full 3B geometry and the benchmarked one.
   The decode run checks that vLLM's state pool holds exactly kv_cache_memory_bytes // these bytes pages.

Results: a table on stdout and JSON (`--out`, default bench-out/bench_laplace.json). The machines are
noisy: compare the ratios measured side by side in one run, not absolute seconds across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import save_result, scratch_dir

# --flag -> (LaplaceConfig field, benchmarked value). The benchmarked geometry is the demo's structure scaled up as
# far as a 2-core machine allows in a few minutes (~100M parameters; per layer H * d_v = D as in the 3B model).
GEOMETRY_FLAGS = {
    "hidden": ("hidden_size", 1024),
    "layers": ("num_hidden_layers", 8),
    "heads": ("num_heads", 8),
    "head_k_dim": ("head_k_dim", 64),
    "head_v_dim": ("head_v_dim", 128),
    "intermediate": ("intermediate_size", 2816),
    "vocab": ("vocab_size", 259),
    "decay_tiers": ("num_decay_tiers", 4),
}
BENCH_GEOMETRY: dict[str, Any] = {key: value for key, value in GEOMETRY_FLAGS.values()} | {"conv_size": 4}
LLAMA_CONTEXT = 8192
LLAMA_HEAD_DIM = 128
LLAMA_BLOCK = 16
MiB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--full", action="store_true", help="true 3B geometry (needs a bigger machine, see the description)")
    for flag, (key, _) in GEOMETRY_FLAGS.items():
        p.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, help=f"override {key}")
    p.add_argument("--lengths", type=int, nargs=2, default=[512, 4096], metavar=("SHORT", "LONG"))
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--reps", type=int, default=7, help="measured requests per prompt length (default 7)")
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="auto: bfloat16 where the CPU has native bf16 matmul (AVX512-BF16/AMX), else float32",
    )
    p.add_argument("--kv-cache-bytes", type=int, default=512 * MiB, help="vLLM kv_cache_memory_bytes (state pool)")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (default: compiled)")
    p.add_argument(
        "--model-dir",
        type=Path,
        help="write the random checkpoint here, a new or empty directory (default: a temp dir)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state-only", action="store_true", help="only part 2 (no vLLM engine)")
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_laplace.json"))
    return p.parse_args(argv)


def cpu_info() -> dict[str, Any]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return {
        "model": model,
        "cpus": os.cpu_count(),
        "simd": simd,
        "native_bf16": bool({"avx512_bf16", "amx_bf16"} & flags),
    }


def full_geometry() -> dict[str, Any]:
    """The true Laplace 3B (spec §2): LaplaceConfig's defaults."""
    from vllm_trn_plugin.configs import LaplaceConfig

    cfg = LaplaceConfig()
    return {key: getattr(cfg, key) for key in BENCH_GEOMETRY}


def bench_geometry(args: argparse.Namespace) -> dict[str, Any]:
    geo = full_geometry() if args.full else dict(BENCH_GEOMETRY)
    for flag, (key, _) in GEOMETRY_FLAGS.items():
        if getattr(args, flag) is not None:
            geo[key] = getattr(args, flag)
    return geo


def laplace_params(geo: dict[str, Any]) -> int:
    D, L, H = geo["hidden_size"], geo["num_hidden_layers"], geo["num_heads"]
    dk, dv, F, V, W = (
        geo["head_k_dim"],
        geo["head_v_dim"],
        geo["intermediate_size"],
        geo["vocab_size"],
        geo["conv_size"],
    )
    per_layer = 4 * D + D * W + D + H * (2 * dk + 2 * dv) * D + H * dk + geo["num_decay_tiers"] * dv
    per_layer += D * H * dv + 3 * F * D
    return L * per_layer + 2 * V * D + 2 * D


# --------------------------------------------------------------------------------------------
# Part 2: state bytes per sequence
# --------------------------------------------------------------------------------------------


def laplace_state(geo: dict[str, Any], model_dtype: str) -> dict[str, Any]:
    """Per-sequence state as vLLM sizes it: the plugin's state shapes/dtypes (the functions
    LaplaceMixer.get_state_shape/get_state_dtype return) for vLLM's resolved engine config of a
    config-only checkpoint, packed into one page by vLLM's MambaSpec."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_trn_plugin import register
    from vllm_trn_plugin.configs import LaplaceConfig
    from vllm_trn_plugin.model_executors.laplace import LaplaceForCausalLM

    register()
    cfg = LaplaceConfig(**geo)
    cfg.architectures = ["LaplaceForCausalLM"]
    with tempfile.TemporaryDirectory(prefix="bench-laplace-config-") as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg.to_dict()))
        args = EngineArgs(
            model=d,
            max_model_len=LLAMA_CONTEXT,
            dtype=model_dtype,
            skip_tokenizer_init=True,
            enable_prefix_caching=False,
        )
        vc = args.create_engine_config()
    shapes = tuple(tuple(s) for s in LaplaceForCausalLM.get_mamba_state_shape_from_config(vc))
    dtypes = tuple(LaplaceForCausalLM.get_mamba_state_dtype_from_config(vc))
    spec = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=vc.cache_config.mamba_block_size)
    per_layer = spec.page_size_bytes
    layers = vc.model_config.hf_config.num_hidden_layers
    return {
        "layers": layers,
        "state_shapes": [list(s) for s in shapes],
        "state_dtypes": [str(d).removeprefix("torch.") for d in dtypes],
        "state_block_tokens": vc.cache_config.mamba_block_size,
        "bytes_per_layer": per_layer,
        "bytes_per_sequence": per_layer * layers,
    }


def llama_kv(layers: int, heads: int, kv_heads: int, context: int) -> dict[str, Any]:
    """KV bytes of `context` tokens for a Llama with these attention shapes, via vLLM's FullAttentionSpec."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=LLAMA_BLOCK, num_kv_heads=kv_heads, head_size=LLAMA_HEAD_DIM, dtype=torch.bfloat16
    )
    blocks = -(-context // LLAMA_BLOCK)
    return {
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": LLAMA_HEAD_DIM,
        "kv_dtype": "bfloat16",
        "context": context,
        "bytes_per_token": spec.page_size_bytes * layers // LLAMA_BLOCK,
        "bytes_per_sequence": spec.page_size_bytes * blocks * layers,
    }


def state_comparison(name: str, geo: dict[str, Any], model_dtype: str) -> dict[str, Any]:
    lap = laplace_state(geo, model_dtype)
    D, L = geo["hidden_size"], geo["num_hidden_layers"]
    heads = max(1, D // LLAMA_HEAD_DIM)
    # GQA: 8 KV heads at the 3B size (24 query heads, as in Llama-3.2-3B); 4 query heads per KV head
    # otherwise.
    gqa_kv = 8 if heads == 24 else max(1, heads // 4)
    llamas = {
        f"mha_{heads}kv": llama_kv(L, heads, heads, LLAMA_CONTEXT),
        f"gqa_{gqa_kv}kv": llama_kv(L, heads, gqa_kv, LLAMA_CONTEXT),
    }
    for ll in llamas.values():
        ll["ratio_llama_over_laplace"] = ll["bytes_per_sequence"] / lap["bytes_per_sequence"]
        ll["break_even_tokens"] = -(-lap["bytes_per_sequence"] // ll["bytes_per_token"])
    return {"name": name, "geometry": geo, "laplace": lap, "llama": llamas}


# --------------------------------------------------------------------------------------------
# Part 1: decode time per token
# --------------------------------------------------------------------------------------------


def run_decode_bench(args: argparse.Namespace, geo: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_trn_plugin.demo import write_laplace_demo

    short, long_ = args.lengths
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    write_laplace_demo(model_dir, seed=args.seed, dtype=getattr(torch, args.dtype), **geo)
    t_write = time.perf_counter() - t0

    max_model_len = long_ + args.output_len + 16
    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        dtype=args.dtype,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,  # one state page per sequence, no checkpoints (gla_state.py)
        enforce_eager=args.enforce_eager,
        disable_log_stats=False,  # fills RequestOutput.metrics
        seed=args.seed,
    )
    t_start = time.perf_counter() - t0
    vcfg = llm.llm_engine.vllm_config
    engine = {
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": args.kv_cache_bytes,
        "state_pages": vcfg.cache_config.num_gpu_blocks,
        "max_num_batched_tokens": vcfg.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "enforce_eager": args.enforce_eager,
        "startup_s": round(t_start, 1),
        "checkpoint_write_s": round(t_write, 1),
    }
    sampling = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def one(length: int) -> dict[str, float]:
        ids = [rng.randrange(256) for _ in range(length)]  # byte ids: valid for any vocab >= 259
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], sampling, use_tqdm=False)
        m = out.metrics
        if m is None:
            raise SystemExit("RequestOutput.metrics is None: vLLM was started with log stats disabled")
        n_gen = len(out.outputs[0].token_ids)
        if n_gen != args.output_len or m.num_generation_tokens != n_gen:
            raise SystemExit(f"expected {args.output_len} output tokens, got {n_gen} ({m.num_generation_tokens})")
        if m.num_preemptions:
            raise SystemExit(f"request was preempted {m.num_preemptions}x: timings would include a re-prefill")
        return {
            "prompt_len": length,
            "decode_s_per_token": (m.last_token_ts - m.first_token_ts) / (n_gen - 1),
            "prefill_s": m.first_token_ts - m.scheduled_ts,
        }

    warmup = [one(short), one(long_)]
    order: list[int] = []
    for r in range(args.reps):
        order += [short, long_] if r % 2 == 0 else [long_, short]
    t0 = time.perf_counter()
    runs = [one(n) for n in order]
    t_measure = time.perf_counter() - t0
    engine["measure_s"] = round(t_measure, 1)

    def summary(length: int) -> dict[str, Any]:
        tpot = [r["decode_s_per_token"] for r in runs if r["prompt_len"] == length]
        pre = [r["prefill_s"] for r in runs if r["prompt_len"] == length]
        return {
            "prompt_len": length,
            "n": len(tpot),
            "decode_ms_per_token_median": 1e3 * statistics.median(tpot),
            "decode_ms_per_token_min": 1e3 * min(tpot),
            "decode_ms_per_token_max": 1e3 * max(tpot),
            "prefill_s_median": statistics.median(pre),
        }

    s, lg = summary(short), summary(long_)
    # Each ABBA half (runs 2i, 2i+1) holds one request of each length, measured back to back: their ratio is
    # the least exposed to the machine's drift.
    pair_ratios = []
    for a, b in zip(runs[::2], runs[1::2]):
        by_len = {a["prompt_len"]: a["decode_s_per_token"], b["prompt_len"]: b["decode_s_per_token"]}
        pair_ratios.append(by_len[long_] / by_len[short])
    return {
        "engine": engine,
        "order": order,
        "warmup": warmup,
        "runs": runs,
        "short": s,
        "long": lg,
        "decode_ratio_long_over_short": lg["decode_ms_per_token_median"] / s["decode_ms_per_token_median"],
        "prefill_ratio_long_over_short": lg["prefill_s_median"] / s["prefill_s_median"],
        "decode_pair_ratios": pair_ratios,
        "decode_pair_ratio_median": statistics.median(pair_ratios),
    }


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def geo_line(geo: dict[str, Any]) -> str:
    return (
        f"D={geo['hidden_size']}, layers={geo['num_hidden_layers']}, H={geo['num_heads']}, "
        f"d_k={geo['head_k_dim']}, d_v={geo['head_v_dim']}, conv={geo['conv_size']}, "
        f"FFN={geo['intermediate_size']}, vocab={geo['vocab_size']}, tiers={geo['num_decay_tiers']} "
        f"({laplace_params(geo) / 1e6:.0f}M params)"
    )


def print_decode(d: dict[str, Any], args: argparse.Namespace) -> None:
    e = d["engine"]
    print(f"\n== 1. Decode time per output token (vLLM RequestOutput.metrics; {args.output_len} output tokens)")
    print(
        f"engine: dtype={args.dtype}, max_model_len={e['max_model_len']}, kv_cache_memory_bytes="
        f"{fmt_bytes(e['kv_cache_memory_bytes'])} -> {e['state_pages']} state pages, max_num_batched_tokens="
        f"{e['max_num_batched_tokens']}, {'eager' if e['enforce_eager'] else 'compiled'}"
    )
    print(
        f"timing: checkpoint write {e['checkpoint_write_s']} s, vLLM startup {e['startup_s']} s, "
        f"measured requests {e['measure_s']} s"
    )
    print("order (after 1 discarded warm-up per length): " + ", ".join(str(n) for n in d["order"]))
    print(f"{'prompt':>7} {'n':>3} {'decode ms/tok median':>21} {'min':>8} {'max':>8} {'prefill s median':>17}")
    for s in (d["short"], d["long"]):
        print(
            f"{s['prompt_len']:>7} {s['n']:>3} {s['decode_ms_per_token_median']:>21.2f} "
            f"{s['decode_ms_per_token_min']:>8.2f} {s['decode_ms_per_token_max']:>8.2f} {s['prefill_s_median']:>17.3f}"
        )
    sl, ll = d["short"]["prompt_len"], d["long"]["prompt_len"]
    print(
        f"ratio of medians {ll}/{sl}: decode per token {d['decode_ratio_long_over_short']:.3f} "
        f"(design: ~1.0, O(1) in context); prefill {d['prefill_ratio_long_over_short']:.2f} "
        f"(O(T) would be {ll / sl:.0f})"
    )
    pr = d["decode_pair_ratios"]
    print(
        f"decode ratio per adjacent pair: median {d['decode_pair_ratio_median']:.3f}, "
        f"range {min(pr):.3f}-{max(pr):.3f} ({len(pr)} pairs)"
    )
    print(
        "per request (ms/token): "
        + ", ".join(f"{r['prompt_len']}:{1e3 * r['decode_s_per_token']:.2f}" for r in d["runs"])
    )


def print_state(comparisons: list[dict[str, Any]]) -> None:
    print(f"\n== 2. State bytes per sequence: Laplace (fixed) vs same-size Llama KV cache at {LLAMA_CONTEXT} tokens")
    print("Laplace: the plugin's state shapes/dtypes (LaplaceMixer.get_state_shape/get_state_dtype) for vLLM's engine")
    print("  config, packed by vLLM's MambaSpec: one fixed page per sequence, whatever the context;")
    print(
        f"Llama: vLLM FullAttentionSpec, bf16 K and V, head_dim {LLAMA_HEAD_DIM}, block {LLAMA_BLOCK}, same D, layers."
    )
    for c in comparisons:
        lap = c["laplace"]
        shapes = " + ".join(f"{tuple(s)} {dt}" for s, dt in zip(lap["state_shapes"], lap["state_dtypes"], strict=True))
        print(f"\n[{c['name']}] {geo_line(c['geometry'])}")
        print(f"  Laplace state per layer: {shapes} = {lap['bytes_per_layer']:,} B")
        print(f"{'model':>36} {'bytes/sequence':>16} {'':>10} {'Llama/Laplace':>14} {'break-even ctx':>15}")
        print(
            f"{'Laplace (' + str(lap['layers']) + ' layers, any context)':>36} "
            f"{lap['bytes_per_sequence']:>16,} {fmt_bytes(lap['bytes_per_sequence']):>10} {'1.0':>14} {'-':>15}"
        )
        for ll in c["llama"].values():
            name = f"Llama {ll['layers']}L {ll['heads']}q/{ll['kv_heads']}kv x{ll['head_dim']} @{ll['context']}"
            print(
                f"{name:>36} {ll['bytes_per_sequence']:>16,} {fmt_bytes(ll['bytes_per_sequence']):>10} "
                f"{ll['ratio_llama_over_laplace']:>14.1f} {ll['break_even_tokens']:>11,} tok"
            )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t_all = time.perf_counter()
    geo = bench_geometry(args)
    if geo["num_heads"] % geo["num_decay_tiers"]:
        raise SystemExit(f"--heads {geo['num_heads']} is not divisible by --decay-tiers {geo['num_decay_tiers']}")
    cpu = cpu_info()
    dtype_note = ""
    if args.dtype == "auto":
        # Without AVX512-BF16/AMX, torch's bf16 GEMM is emulated, several times slower than fp32.
        args.dtype = "bfloat16" if cpu["native_bf16"] else "float32"
        dtype_note = (
            " (auto: " + ("native bf16 matmul" if cpu["native_bf16"] else "no native bf16 matmul on this CPU") + ")"
        )
    model_dtype = args.dtype
    result: dict[str, Any] = {
        "host": {**cpu, "python": sys.version.split()[0]},
        "bench_geometry": geo,
        "args": vars(args),
    }
    full = full_geometry()
    comparisons = [state_comparison("Laplace 3B (full, spec §2)", full, "bfloat16")]
    if geo != full or model_dtype != "bfloat16":
        comparisons.append(state_comparison("benchmarked geometry", geo, model_dtype))
    result["state"] = comparisons
    bench_state_bytes = comparisons[-1]["laplace"]["bytes_per_sequence"]

    print("== Laplace benchmark")
    print(f"host: {cpu['model']}, {cpu['cpus']} CPUs, SIMD {'/'.join(cpu['simd']) or '?'}")
    print(f"benchmarked geometry: {geo_line(geo)}; dtype {args.dtype}{dtype_note}")
    if not args.state_only:
        import vllm

        print(f"vllm {vllm.__version__}, prompts {args.lengths}, {args.reps} reps each, output {args.output_len}")
        with scratch_dir(args.model_dir, "bench-laplace-") as model_dir:
            result["decode"] = run_decode_bench(args, geo, model_dir)
        print_decode(result["decode"], args)
        # The engine sized its state pool from the real mixers: its page count must match the analytic bytes.
        pages = result["decode"]["engine"]["state_pages"]
        expected = args.kv_cache_bytes // bench_state_bytes
        result["decode"]["engine"]["analytic_state_pages"] = expected
        verdict = "match" if pages == expected else "MISMATCH: part 2 does not describe what vLLM allocated"
        print(
            f"state pool check: vLLM allocated {pages} pages in {fmt_bytes(args.kv_cache_bytes)}; "
            f"{fmt_bytes(args.kv_cache_bytes)} // {bench_state_bytes:,} B per sequence (part 2) = {expected}: {verdict}"
        )
    print_state(comparisons)

    save_result(args.out, result, t_all)


if __name__ == "__main__":
    main()
