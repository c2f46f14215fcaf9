"""Decode time per output token at long context: MLA-Trinity (the plugin) vs vLLM's built-in AFMoE, side by side.

Run (from the repository root)::

    .venv/bin/python deploy/bench_trinity_decode.py --reuse-prefill   # only the first request per context prefilled
    .venv/bin/python deploy/bench_trinity_decode.py                   # every request prefilled: several times longer

What takes the time (float32, one core per engine) is prefill: a 32k prompt costs 32 q heads x 128 x 32768^2 / 2
x 4 flop ~ 8.8 TFLOP of causal attention on the one global layer plus ~3 TFLOP on the three sliding layers,
whatever the hidden size. By default prefix caching is off and every request is prefilled. `--reuse-prefill`
turns prefix caching on and uses one fixed prompt per context (the same for both models), so only the first
request per context and model is prefilled; the later ones take the prompt from the cache (their
`num_cached_tokens` is printed; MLA's cache group has 512-token blocks, so up to 512 prompt tokens are
recomputed) and decode over the identical cached context. Decode reads the same cache either way; the
per-request list marks the cache hits, so decode after a real prefill and after a hit can be compared.
Options: `--help`. `--no-profile` skips part 3. Measured figures and run times: docs/mla-trinity.md.

What it does:
1. One random float32 AFMoE checkpoint with Trinity-Mini's attention geometry (head_dim 128, 32 q heads,
   4 KV heads, layers [S, S, S, F], sliding window 2048, muP, sandwich norms, gated output) and a small
   MLP/MoE (hidden 512, 4 experts, top-2): `vllm_trn_plugin.demo.write_afmoe_demo(..., kv_rank=256)`, whose
   global layer's [k_proj; v_proj] has rank 256 by construction, and its MLA conversion
   `vllm_trn_plugin.tools.convert_mla.convert_mla(..., latent=256)` on random calibration tokens, exact at
   that rank. The two directories compute the same function (up to float32 rounding); the first output
   tokens are compared as a check.
2. Two engines, each a `vllm.LLM` in its own child process (this script with `--child`), both alive for the
   whole measurement: the plugin's TrinityMLAForCausalLM and vLLM's built-in AfmoeForCausalLM, same
   max_model_len, max_num_batched_tokens (512, see below), kv_cache_memory_bytes (computed below),
   enable_prefix_caching=False (True with --reuse-prefill), max_num_seqs=1, compiled (default) or
   `--enforce-eager`. Only one engine works at a time (an idle engine blocks on its input queue), so the
   two never compete for the core vLLM pins its worker to; keeping both alive lets every rep visit each
   context for both models back to back (ABBA: rep 0 runs MLA then built-in, rep 1 built-in then MLA, ...;
   the contexts alternate ascending and descending), so slow drift of this shared, noisy machine hits both
   models alike. The alternative (start A, measure, stop, start B) would put minutes between the two
   models' numbers at each context.
   max_num_batched_tokens is 512 (`--max-num-batched-tokens`): small prefill chunks keep the sliding layers'
   per-request reservation (window - 1 + in-flight tokens) and the prefill's rebuilt K/V small.
   One request at a time: random byte-token prompt (the same ids for both models), `--output-len` tokens,
   ignore_eos, temperature 0. Decode time per token from vLLM's own per-request timestamps
   (`RequestOutput.metrics`): (last_token_ts - first_token_ts) / (num_generation_tokens - 1). One discarded
   warm-up request per engine at the smallest context.
   kv_cache_memory_bytes: exactly what one max_model_len request of the built-in needs by vLLM 0.32's own
   rule (CPU block 128; full layers cdiv(max_model_len, 128) blocks; sliding layers
   cdiv(window - 1 + max_num_batched_tokens, 128) + 1 blocks (no async scheduling on CPU, so
   max_in_flight_tokens = max_num_batched_tokens; checked against the engine); float32 K+V page
   128 x 2 x 4 x 128 x 4 B), rounded up to MiB. With --reuse-prefill: one request of every context at once,
   so that the ABBA order never evicts a prompt that is about to be reused. vLLM's logged
   "Maximum concurrency" lines of both engines at that budget are printed, with their ratio.
3. Profile (default on): one more request per engine at the largest context with vLLM's torch profiler
   (`start_profile(delay_iterations=..., max_iterations=...)`, shapes recorded) over a few decode steps only;
   the trace is split into the attention custom ops (plugin: trn::latent_attention, whose children are
   grouped: key-scale recompute = the [L, r] x [r, 4 x 128] einsum + pow/mean/rsqrt; history gather; scores /
   softmax / latent sum; ...; built-in: vllm::unified_attention_with_output + unified_kv_cache_update) and
   everything else (the compiled rest of the model, sampling).

`--latent-fp8`: instead of MLA vs built-in, MLA-Trinity's latent cache in the model dtype vs in FP8
(`additional_config={"latent_cache_dtype": "fp8"}`: Trainium2 E4M3 codes + one fp32 scale per token), two engines of
the same MLA checkpoint with the same settings otherwise, measured ABBA as above; the table shows the FP8 / model-dtype
decode ratio per context. With `--dtype bfloat16` the model-dtype latent is bf16 (the default float32 keeps the
original comparison's dtype). E.g. (prefill of 32k takes minutes per engine on one core)::

    .venv/bin/python deploy/bench_trinity_decode.py --latent-fp8 --dtype bfloat16 --reuse-prefill \
        --contexts 8192 32768 --no-profile

The engines are started one after the other (each waits for the previous one to be up), never two at once.

Results: tables on stdout and JSON (`--out`, default bench-out/bench_trinity_decode.json); engine logs in
bench-out/bench_trinity_decode-logs/. The machine is noisy: compare the ratios measured side by side in one run,
not absolute milliseconds across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness as local

REPO = Path(__file__).resolve().parents[1]
MODELS = {"mla": "TrinityMLAForCausalLM", "afmoe": "AfmoeForCausalLM"}
LABEL = {"mla": "MLA-Trinity", "afmoe": "built-in AFMoE", "mla_fp8": "MLA-Trinity FP8"}
FP8_LATENT = {"latent_cache_dtype": "fp8"}  # --additional-config of the --latent-fp8 comparison's second engine
CPU_BLOCK = 128  # vLLM 0.32 CPU default block size (platforms/cpu.py) when the model is not DeepSeek-MLA
MiB = 1 << 20
INTERESTING_LOG = re.compile(
    r"Maximum concurrency|KV cache size|kv cache group|block_size|sliding|Hybrid|fall(ing)? back|"
    r"Traceback|Error|error:",
    re.IGNORECASE,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768], help="prompt lengths")
    p.add_argument("--reps", type=int, default=3, help="measured requests per model and context (default 3)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request (default 32)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4, help="a multiple of 4: [S, S, S, F] repeated")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--experts-per-tok", type=int, default=2)
    p.add_argument("--window", type=int, default=2048, help="sliding window (Trinity-Mini: 2048)")
    p.add_argument("--kv-lora-rank", type=int, default=256)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="prefill chunk (max_num_batched_tokens)",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        help="default: one max_model_len request of the built-in (--reuse-prefill: one request per context at once)",
    )
    p.add_argument(
        "--reuse-prefill",
        action="store_true",
        help="prefix caching on and one fixed prompt per context: only the first request per context and model "
        "is really prefilled (see the description)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="both engines eager (default: compiled)")
    p.add_argument(
        "--latent-fp8",
        action="store_true",
        help="MLA-Trinity with its latent cache in the model dtype vs in FP8 (latent_cache_dtype fp8), not vs built-in",
    )
    p.add_argument("--dtype", default="float32", help="both engines' dtype (default float32; bfloat16: a bf16 latent)")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip part 3")
    p.add_argument("--profile-steps", type=int, default=6, help="decode steps profiled (default 6)")
    p.add_argument("--model-dir", type=Path, help="write the two checkpoints here (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_trinity_decode.json"))
    p.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "ENGINE_JSON"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------
# Child: one vLLM engine, driven by JSON lines on stdin; answers go out through harness.answer
# --------------------------------------------------------------------------------------------


def child_main(model_dir: str, engine_json: str) -> None:
    from vllm import SamplingParams
    from vllm.config import ProfilerConfig
    from vllm.inputs import TokensPrompt

    kw = json.loads(engine_json)
    profile_dir = kw.pop("profile_dir", None)
    if profile_dir:
        kw["profiler_config"] = ProfilerConfig(
            profiler="torch",
            torch_profiler_dir=profile_dir,
            torch_profiler_with_stack=False,
            torch_profiler_record_shapes=True,
            torch_profiler_use_gzip=True,
        )
    llm = local.start_child_engine(model_dir, kw)
    for cmd in local.child_commands():
        ids = random.Random(cmd["prompt_seed"]).choices(range(256), k=cmd["len"])  # bytes: valid for vocab 259
        sampling = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
        profiling = cmd["cmd"] == "profile"
        if profiling:
            llm.start_profile(delay_iterations=cmd["delay_iterations"], max_iterations=cmd["max_iterations"])
        t0 = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], sampling, use_tqdm=False)
        wall = time.perf_counter() - t0
        if profiling:
            llm.stop_profile()
        m = out.metrics
        tokens = list(out.outputs[0].token_ids)
        n = len(tokens)
        local.answer(
            {
                "len": cmd["len"],
                "n_gen": n,
                "metrics_n_gen": None if m is None else m.num_generation_tokens,
                "preemptions": None if m is None else m.num_preemptions,
                "decode_s_per_token": None if m is None else (m.last_token_ts - m.first_token_ts) / max(n - 1, 1),
                "prefill_s": None if m is None else m.first_token_ts - m.scheduled_ts,
                "wall_s": wall,
                "num_cached_tokens": out.num_cached_tokens,
                "tokens": tokens[:16],
            }
        )
    llm.llm_engine.engine_core.shutdown()


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


def start_engine(key: str, model_dir: Path, engine_kw: dict[str, Any], log_path: Path) -> local.EngineChild:
    """This script with --child: one vLLM engine in its own process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(model_dir), json.dumps(engine_kw)]
    env = {**os.environ}
    return local.EngineChild(key, cmd, log_path, env, REPO)


def write_checkpoints(args: argparse.Namespace, root: Path, max_pos: int) -> tuple[dict[str, Path], dict[str, Any]]:
    """The random AFMoE checkpoint whose global layers' [k_proj; v_proj] has rank --kv-lora-rank, and its
    MLA conversion at that latent (exact)."""
    import torch

    from vllm_trn_plugin.demo import write_afmoe_demo
    from vllm_trn_plugin.tools.convert_mla import convert_mla

    if args.layers % 4:
        raise SystemExit(f"--layers {args.layers}: must be a multiple of 4 ([S, S, S, F] blocks)")
    afmoe = write_afmoe_demo(
        root / "afmoe",
        seed=args.seed,
        kv_rank=args.kv_lora_rank,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * (args.layers // 4),
        num_experts=args.experts,
        num_experts_per_tok=args.experts_per_tok,
        sliding_window=args.window,
        max_position_embeddings=max_pos,
    )
    # Calibration: more tokens than the hidden size, so that the whitening covariance has full rank.
    calib = torch.randint(0, 256, (max(4, 2 * args.hidden // 256), 256), generator=torch.Generator().manual_seed(0))
    mla = convert_mla(afmoe, root / "mla", latent=args.kv_lora_rank, calib=calib, progress=False).dst
    cfg = json.loads((afmoe / "config.json").read_text())
    return {"mla": mla, "afmoe": afmoe}, cfg


def builtin_kv_bytes(cfg: dict[str, Any], lengths: list[int], mnbt: int, block: int = CPU_BLOCK) -> dict[str, Any]:
    """Bytes the built-in AFMoE needs for one request of each length at once, by vLLM 0.32's sizing rule
    (KVCacheSpec.max_memory_usage_bytes; float32; no async scheduling on CPU, so max_in_flight_tokens =
    max_num_batched_tokens; each sliding layer holds window - 1 + in-flight tokens, + 1 block)."""
    page = block * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    n_full = sum(t == "full_attention" for t in cfg["layer_types"])
    n_slide = len(cfg["layer_types"]) - n_full
    blocks = 0
    for length in lengths:
        full_blocks = cdiv(length, block)
        slide_blocks = cdiv(min(cfg["sliding_window"] - 1 + mnbt, length), block) + 1
        blocks += n_full * full_blocks + n_slide * slide_blocks
    return {
        "lengths": lengths,
        "page_bytes": page,
        "blocks": blocks,
        "assumed_max_in_flight_tokens": mnbt,
        "bytes": cdiv(blocks * page, MiB) * MiB,
    }


def measure(engines: dict[str, local.EngineChild], args: argparse.Namespace, max_tokens: int) -> list[dict[str, Any]]:
    keys = list(engines)
    runs: list[dict[str, Any]] = []
    total = args.reps * len(args.contexts) * len(keys)
    for rep in range(args.reps):
        contexts = args.contexts if rep % 2 == 0 else args.contexts[::-1]
        for i, ctx in enumerate(contexts):
            order = keys if (rep + i) % 2 == 0 else keys[::-1]
            prompt_seed = prompt_seed_for(args, rep, ctx)  # same prompt for both models
            for key in order:
                ans = engines[key].request(
                    {"cmd": "generate", "len": ctx, "max_tokens": max_tokens, "prompt_seed": prompt_seed}
                )
                check(ans, max_tokens, key)
                runs.append({"model": key, "rep": rep, "context": ctx, **ans})
                print(
                    f"  [{len(runs)}/{total}] rep {rep} {LABEL[key]:15} ctx {ctx:>6}: decode "
                    f"{1e3 * ans['decode_s_per_token']:7.2f} ms/token, prefill {ans['prefill_s']:7.1f} s "
                    f"({ans['num_cached_tokens']} prompt tokens from the prefix cache)",
                    flush=True,
                )
    return runs


def prompt_seed_for(args: argparse.Namespace, rep: int, ctx: int) -> int:
    """A fresh prompt per rep; with --reuse-prefill one prompt per context (its cached prefix is reused)."""
    return args.seed * 1_000_003 + (0 if args.reuse_prefill else rep) * 100_003 + ctx


def check(ans: dict[str, Any], max_tokens: int, key: str) -> None:
    if ans["decode_s_per_token"] is None:
        raise SystemExit("RequestOutput.metrics is None: vLLM was started with log stats disabled")
    if ans["n_gen"] != max_tokens or ans["metrics_n_gen"] != max_tokens:
        raise SystemExit(f"{key}: expected {max_tokens} output tokens, got {ans['n_gen']} ({ans['metrics_n_gen']})")
    if ans["preemptions"]:
        raise SystemExit(f"{key}: request preempted {ans['preemptions']}x; its timing would include a re-prefill")


def summarize(
    runs: list[dict[str, Any]], contexts: list[int], pair: tuple[str, str] = ("mla", "afmoe")
) -> dict[str, Any]:
    """Per model and context; `pair` (numerator, denominator): the per-rep ratio of adjacent measurements."""
    out: dict[str, Any] = {}
    for key in pair:
        per_ctx = {}
        for ctx in contexts:
            tpot = [1e3 * r["decode_s_per_token"] for r in runs if r["model"] == key and r["context"] == ctx]
            pre = [r["prefill_s"] for r in runs if r["model"] == key and r["context"] == ctx]
            per_ctx[ctx] = {
                "decode_ms_per_token": tpot,
                "median": statistics.median(tpot),
                "min": min(tpot),
                "max": max(tpot),
                "prefill_s_median": statistics.median(pre),
            }
        out[key] = per_ctx
    # pair[0] / pair[1] (MLA / built-in by default) per adjacent pair (same rep, same context, back to back).
    pairs: dict[int, list[float]] = {ctx: [] for ctx in contexts}
    agree: dict[int, list[int]] = {ctx: [] for ctx in contexts}
    for ctx in contexts:
        for rep in sorted({r["rep"] for r in runs}):
            a = [r for r in runs if r["rep"] == rep and r["context"] == ctx]
            by = {r["model"]: r for r in a}
            if set(by) == set(pair):
                pairs[ctx].append(by[pair[0]]["decode_s_per_token"] / by[pair[1]]["decode_s_per_token"])
                same = 0
                for x, y in zip(by[pair[0]]["tokens"], by[pair[1]]["tokens"]):
                    if x != y:
                        break
                    same += 1
                agree[ctx].append(same)
    out["pair_ratios"] = pairs
    out["agreeing_prefix_tokens"] = agree
    return out


# --- profile ---------------------------------------------------------------------------------------------


def load_trace(profile_dir: Path) -> list[dict[str, Any]]:
    files = sorted(profile_dir.glob("*.json*"), key=lambda f: f.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no trace in {profile_dir}")
    raw = files[-1].read_bytes()
    if files[-1].suffix == ".gz":
        raw = gzip.decompress(raw)
    return [e for e in json.loads(raw)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def nest(events: list[dict[str, Any]]) -> None:
    """Give each event `_parent` (index of its innermost enclosing event on the same thread)."""
    order = sorted(
        range(len(events)), key=lambda i: (str(events[i].get("pid")), str(events[i].get("tid")), events[i]["ts"])
    )
    stack: list[int] = []
    last_thread = None
    for i in order:
        e = events[i]
        thread = (e.get("pid"), e.get("tid"))
        if thread != last_thread:
            stack, last_thread = [], thread
        while stack and events[stack[-1]]["ts"] + events[stack[-1]]["dur"] <= e["ts"]:
            stack.pop()
        e["_parent"] = stack[-1] if stack else None
        stack.append(i)


def child_label(e: dict[str, Any], r: int, hkv: int, hd: int) -> str:
    """Name a direct child of the latent-attention op by what it does in latent_attention.py (batch 1)."""
    name = e["name"]
    dims = (e.get("args") or {}).get("Input Dims") or []
    if name == "aten::einsum" and len(dims) > 1 and len(dims[1]) == 2:
        a, b = dims[1]
        weight = list(b) == [hkv, hd, r]  # W_k or W_v, [Hkv, hd, r]; else the latents C [B, L, r]
        if len(a) == 3 and weight:
            return "key-scale recompute: einsum C[L,r] x W_k^T -> [L, 4, 128]"
        if len(a) == 4 and weight:
            return "einsum q -> q_lat (W_k^T q)" if a[-1] == hd else "einsum W_v u (output)"
        if len(a) == 4 and len(b) == 3:
            return "einsum scores q_lat . C" if a[-1] == r else "einsum u = p . C (latent sum)"
        return "einsum (other)"
    if name in ("aten::pow", "aten::mean", "aten::rsqrt"):
        return f"key-scale recompute: {name.removeprefix('aten::')}"
    if name in ("aten::index", "aten::zeros", "aten::new_zeros", "aten::copy_", "aten::slice", "aten::select"):
        return "history gather / copy to [B, L, r] (" + name.removeprefix("aten::") + ")"
    if name in ("aten::index_put_", "aten::_index_put_impl_"):
        return "cache write (index_put_)"
    if name in ("aten::softmax", "aten::_softmax", "aten::masked_fill", "aten::mul"):
        return "scores scale/mask/softmax (" + name.removeprefix("aten::") + ")"
    return "other (" + name.removeprefix("aten::") + ")"


def analyze_profile(profile_dir: Path, key: str, n_attn_layers: int, cfg: dict[str, Any], r: int) -> dict[str, Any]:
    events = load_trace(profile_dir)
    nest(events)
    attn_names = (
        ("trn::latent_attention",)
        if key.startswith("mla")
        else ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update")
    )
    attn = [i for i, e in enumerate(events) if e["name"] in attn_names]
    # Count each custom op once (the outermost event of that name), e.g. not its dispatcher re-entries.
    top = [i for i in attn if events[i]["_parent"] is None or events[events[i]["_parent"]]["name"] not in attn_names]
    by_name: dict[str, list[float]] = {}
    for i in top:
        by_name.setdefault(events[i]["name"], []).append(events[i]["dur"] / 1e3)
    main_op = attn_names[0]
    calls = len(by_name.get(main_op, []))
    steps = calls // n_attn_layers
    res: dict[str, Any] = {
        "ops_ms_total": {k: sum(v) for k, v in by_name.items()},
        "calls": {k: len(v) for k, v in by_name.items()},
        "steps": steps,
    }
    res["attention_ms_per_step"] = sum(res["ops_ms_total"].values()) / max(steps, 1)
    if key.startswith("mla"):
        top_set = set(top)
        parts: dict[str, float] = {}
        for e in events:
            if e.get("_parent") in top_set:
                lab = child_label(e, r, cfg["num_key_value_heads"], cfg["head_dim"])
                parts[lab] = parts.get(lab, 0.0) + e["dur"] / 1e3 / max(steps, 1)
        res["latent_op_children_ms_per_step"] = dict(sorted(parts.items(), key=lambda kv: -kv[1]))
        res["key_scale_recompute_ms_per_step"] = sum(v for k, v in parts.items() if k.startswith("key-scale"))
    # vLLM annotates each profiled step ("execute_context_<n>(<tokens>)_generation_<n>(<tokens>)").
    spans = [e["dur"] / 1e3 for e in events if e["name"].startswith("execute_context")]
    res["step_spans_ms"] = spans
    res["step_ms_median"] = statistics.median(spans) if spans else None
    return res


def run_profiles(  # noqa: ANN201
    engines: dict[str, local.EngineChild],
    args: argparse.Namespace,
    cfg: dict[str, Any],
    dirs: dict[str, Path],
    runs: list[dict[str, Any]],
):
    ctx = max(args.contexts)
    # With --reuse-prefill the measured prompt is reused: only its uncached tail is prefilled (as in the last reps).
    cached = max(r["num_cached_tokens"] or 0 for r in runs if r["context"] == ctx) if args.reuse_prefill else 0
    chunks = cdiv(ctx - cached, args.max_num_batched_tokens)
    delay = chunks + 2  # skip the prefill chunks and the first decode steps
    max_tokens = min(args.output_len, args.profile_steps + 6)
    n_full = sum(t == "full_attention" for t in cfg["layer_types"])
    out: dict[str, Any] = {"context": ctx, "delay_iterations": delay}
    for key, eng in engines.items():
        t0 = time.perf_counter()
        ans = eng.request(
            {
                "cmd": "profile",
                "len": ctx,
                "max_tokens": max_tokens,
                "prompt_seed": prompt_seed_for(args, 0, ctx) if args.reuse_prefill else args.seed + 99,
                "delay_iterations": delay,
                "max_iterations": args.profile_steps,
            }
        )
        time.sleep(2)  # the worker writes its trace when the profiler stops
        n_attn = n_full if key.startswith("mla") else len(cfg["layer_types"])
        try:
            res = analyze_profile(dirs[key], key, n_attn, cfg, args.kv_lora_rank)
        except Exception as exc:  # noqa: BLE001  (report, do not lose the timing results)
            res = {"error": f"{type(exc).__name__}: {exc}"}
        res["decode_ms_per_token_during_profile"] = 1e3 * ans["decode_s_per_token"]
        res["seconds"] = time.perf_counter() - t0
        out[key] = res
        print(f"  profiled {LABEL[key]} at {ctx} ({res['seconds']:.0f} s)", flush=True)
    return out


# --- report ----------------------------------------------------------------------------------------------


def _print_spread_and_runs(res: dict[str, Any], ctxs: list[int], names: dict[str, str]) -> None:
    """Per engine (`names`: summary key -> label): min-max ms/token and median prefill per context, then every
    request's ms/token in run order."""
    s = res["summary"]
    print("spread (min-max ms/token) and prefill (median s):")
    for key, name in names.items():
        parts = [
            f"{c}: {s[key][c]['min']:.2f}-{s[key][c]['max']:.2f}, prefill {s[key][c]['prefill_s_median']:.1f} s"
            for c in ctxs
        ]
        print(f"  {name:16} " + "; ".join(parts))
    print("per request (context:ms/token, * = prompt mostly served from the prefix cache), in run order:")
    for key, name in names.items():
        items = [
            f"{r['context']}:{1e3 * r['decode_s_per_token']:.1f}" + ("*" if (r["num_cached_tokens"] or 0) > 0 else "")
            for r in res["runs"]
            if r["model"] == key
        ]
        print(f"  {name:16} " + ", ".join(items))


def report_latent_fp8(res: dict[str, Any], args: argparse.Namespace) -> None:
    """--latent-fp8: MLA-Trinity's decode with the latent in the model dtype vs in FP8, side by side."""
    s, ctxs = res["summary"], args.contexts
    base = f"{args.dtype} latent"
    print(
        f"\n== MLA-Trinity decode time per output token, ms: {base} vs FP8 latent (latent_cache_dtype fp8); median "
        f"of {args.reps}; vLLM RequestOutput.metrics; {args.output_len} output tokens, one request at a time; "
        f"{'eager' if args.enforce_eager else 'compiled'} =="
    )
    print(f"{'latent':22}" + "".join(f"{c:>10}" for c in ctxs))
    for key, name in (("mla", base), ("mla_fp8", "FP8 (E4M3 + scale)")):
        print(f"{name:22}" + "".join(f"{s[key][c]['median']:>10.2f}" for c in ctxs))
    print(
        f"{'FP8 / ' + base:22}" + "".join(f"{s['mla_fp8'][c]['median'] / s['mla'][c]['median']:>10.2f}" for c in ctxs)
    )
    print(f"{'  (pairwise med.)':22}" + "".join(f"{statistics.median(s['pair_ratios'][c]):>10.2f}" for c in ctxs))
    _print_spread_and_runs(res, ctxs, {"mla": base, "mla_fp8": "FP8"})
    agree = s["agreeing_prefix_tokens"]
    print(
        "identical leading output tokens FP8 vs "
        + base
        + " (of the first 16; FP8 is lossy), per rep: "
        + "; ".join(f"{c}: {agree[c]}" for c in ctxs)
    )
    for key, name in (("mla", base), ("mla_fp8", "FP8")):
        info = res["engines"][key]
        print(
            f"{name}: block_size {info['block_size']}, {info['num_blocks']} blocks, compilation "
            f"{info['compilation_mode']}, startup {info['startup_s']:.0f} s"
        )
        for line in info["log_concurrency"]:
            print(f"  log: {line.strip()}")


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    if args.latent_fp8:
        return report_latent_fp8(res, args)
    s, ctxs = res["summary"], args.contexts
    lo, hi = min(ctxs), max(ctxs)
    print(
        f"\n== Decode time per output token, ms (median of {args.reps}; vLLM RequestOutput.metrics; "
        f"{args.output_len} output tokens, one request at a time) =="
    )
    head = "".join(f"{c:>10}" for c in ctxs)
    print(f"{'model':18}{head}{f'{hi}/{lo}':>12}  target")
    for key in MODELS:
        row = "".join(f"{s[key][c]['median']:>10.2f}" for c in ctxs)
        ratio = s[key][hi]["median"] / s[key][lo]["median"]
        target = "<= 1.3 (flat)" if key == "mla" else ""
        print(f"{LABEL[key]:18}{row}{ratio:>12.2f}  {target}")
    row = "".join(f"{s['mla'][c]['median'] / s['afmoe'][c]['median']:>10.2f}" for c in ctxs)
    print(f"{'MLA / built-in':18}{row}{'':>12}  < 1 at {hi} (MLA faster)")
    row = "".join(f"{statistics.median(s['pair_ratios'][c]):>10.2f}" for c in ctxs)
    print(f"{'  (pairwise med.)':18}{row}")
    print()
    _print_spread_and_runs(res, ctxs, {key: LABEL[key] for key in MODELS})
    agree = s["agreeing_prefix_tokens"]
    print(
        "same function check: identical leading output tokens MLA vs built-in (of the first 16), per rep: "
        + "; ".join(f"{c}: {agree[c]}" for c in ctxs)
    )

    e = res["engines"]
    kv, kv_one, budget = res["kv_budget"], res["kv_budget_one_request"], res["kv_cache_bytes"]
    what = " + ".join(str(n) for n in kv["lengths"])
    print(
        f"\n== KV cache: both engines at kv_cache_memory_bytes = {budget:,} B ({budget / MiB:.0f} MiB) = what the "
        f"built-in needs for one request of {what} tokens at once ({kv['blocks']} blocks x {kv['page_bytes']:,} B "
        f"by vLLM's rule, assuming max_in_flight_tokens {kv['assumed_max_in_flight_tokens']}) =="
    )
    conc = {}
    for key in MODELS:
        info = e[key]
        print(
            f"{LABEL[key]}: block_size {info['block_size']}, {info['num_blocks']} blocks, max_in_flight_tokens "
            f"{info['max_in_flight_tokens']}, compilation {info['compilation_mode']}, startup {info['startup_s']:.0f} s"
        )
        if info["max_in_flight_tokens"] != kv["assumed_max_in_flight_tokens"]:
            print("  WARNING: max_in_flight_tokens differs from the budget's assumption: the budget is not exact")
        for line in info["log_concurrency"]:
            print(f"  log: {line.strip()}")
            m = re.search(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", line)
            if m:
                conc[key] = float(m.group(1))
        for line in info["log_groups"]:
            print(f"  log: {line.strip()}")
    if len(conc) == 2:
        note = ""
        if budget != kv_one["bytes"]:
            scale = kv_one["bytes"] / budget
            note = (
                f"; scaled to the one-{res['max_model_len']}-token-request budget ({kv_one['bytes'] / MiB:.0f} MiB): "
                f"MLA {conc['mla'] * scale:.2f}x, built-in {conc['afmoe'] * scale:.2f}x"
            )
        print(f"capacity ratio MLA / built-in at the same bytes: {conc['mla'] / conc['afmoe']:.2f}x{note}")

    if "profile" in res:
        p = res["profile"]
        print(
            f"\n== Where a decode step goes at {p['context']} (vLLM torch profiler, record_shapes, "
            f"{args.profile_steps} decode steps after {p['delay_iterations'] - 1} iterations) =="
        )
        for key in MODELS:
            x = p[key]
            if "error" in x:
                print(f"{LABEL[key]}: profile failed: {x['error']}")
                continue
            tpot = s[key][p["context"]]["median"]
            att = x["attention_ms_per_step"]
            ops = ", ".join(f"{name} x{n}" for name, n in x["calls"].items())
            step = x["step_ms_median"] or float("nan")
            print(
                f"{LABEL[key]}: {x['steps']} steps, profiled step {step:.2f} ms (median; unprofiled decode "
                f"{tpot:.2f} ms/token); attention custom ops {att:.2f} ms/step = {att / step:.0%} of the profiled step "
                f"({ops}); rest of the step (compiled model outside attention, sampling) {step - att:.2f} ms"
            )
            if key == "mla":
                rec = x["key_scale_recompute_ms_per_step"]
                print(
                    f"  key-scale recompute {rec:.2f} ms/step = {rec / att:.0%} of the latent op, "
                    f"{rec / step:.0%} of the profiled step; the latent op without it: {att - rec:.2f} ms"
                )
                for lab, ms in x["latent_op_children_ms_per_step"].items():
                    if ms >= 0.05:
                        print(f"    {ms:8.2f} ms/step  {lab}")
        if all("error" not in p[k] for k in MODELS):
            lo_tpot = {k: s[k][lo]["median"] for k in MODELS}
            print(
                f"decode growth {lo} -> {p['context']}: MLA +{s['mla'][p['context']]['median'] - lo_tpot['mla']:.2f} "
                f"ms/token, built-in +{s['afmoe'][p['context']]['median'] - lo_tpot['afmoe']:.2f} ms/token"
            )


def run(args: argparse.Namespace, root: Path, log_dir: Path, running: contextlib.ExitStack) -> dict[str, Any]:
    """Parts 1-3 with the checkpoints under `root`; the engines stay open in `running`."""
    max_model_len = max(args.contexts) + args.output_len
    max_pos = cdiv(max_model_len, 1024) * 1024
    t0 = time.perf_counter()
    dirs, cfg = write_checkpoints(args, root, max_pos)
    print(
        f"checkpoint ({time.perf_counter() - t0:.0f} s): write_afmoe_demo(kv_rank={args.kv_lora_rank}) + "
        f"convert_mla(latent={args.kv_lora_rank}); hidden {cfg['hidden_size']}, "
        f"{cfg['num_hidden_layers']} layers {[t[0].upper() for t in cfg['layer_types']]}, "
        f"{cfg['num_attention_heads']} q / {cfg['num_key_value_heads']} KV heads x {cfg['head_dim']}, window "
        f"{cfg['sliding_window']}, {cfg['num_experts']} experts top-{cfg['num_experts_per_tok']}, "
        f"max_position_embeddings {cfg['max_position_embeddings']}, float32"
    )
    kv_one = builtin_kv_bytes(cfg, [max_model_len], args.max_num_batched_tokens)
    lengths = [c + args.output_len for c in args.contexts] if args.reuse_prefill else [max_model_len]
    kv = builtin_kv_bytes(cfg, lengths, args.max_num_batched_tokens)
    kv_bytes = args.kv_cache_bytes or kv["bytes"]
    engine_kw = dict(
        dtype=args.dtype,
        max_model_len=max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=kv_bytes,
        max_num_seqs=1,
        enable_prefix_caching=args.reuse_prefill,
        enforce_eager=args.enforce_eager,
        disable_log_stats=False,  # fills RequestOutput.metrics
        seed=args.seed,
    )
    print(
        f"engines: max_model_len {max_model_len}, max_num_batched_tokens {args.max_num_batched_tokens}, "
        f"kv_cache_memory_bytes {kv_bytes:,}, prefix caching "
        f"{'ON (--reuse-prefill)' if args.reuse_prefill else 'off'}, max_num_seqs 1, "
        f"{'eager' if args.enforce_eager else 'compiled'}; contexts {args.contexts}, {args.reps} reps, "
        f"output {args.output_len}"
    )
    # key: (checkpoint, extra engine kwargs); the first two keys are the measured pair
    variants = (
        {"mla": (dirs["mla"], {}), "mla_fp8": (dirs["mla"], {"additional_config": FP8_LATENT})}
        if args.latent_fp8
        else {"mla": (dirs["mla"], {}), "afmoe": (dirs["afmoe"], {})}
    )
    profile_dirs = {k: log_dir / f"profile-{k}" for k in variants}
    engines: dict[str, local.EngineChild] = {}
    result: dict[str, Any] = {
        "args": vars(args),
        "config": cfg,
        "max_model_len": max_model_len,
        "kv_budget": kv,
        "kv_budget_one_request": kv_one,
        "kv_cache_bytes": kv_bytes,
        "plugin_state": local.plugin_state(REPO),
        "variants": {k: {"model_dir": str(d), **extra} for k, (d, extra) in variants.items()},
    }
    t0 = time.perf_counter()
    info = {}
    for key, (model_dir, extra) in variants.items():  # one after the other: never two start-ups at once
        kw = {**engine_kw, **extra}
        if args.profile:
            for f in profile_dirs[key].glob("*"):
                f.unlink()
            profile_dirs[key].mkdir(parents=True, exist_ok=True)
            kw["profile_dir"] = str(profile_dirs[key])
        engines[key] = running.enter_context(start_engine(key, model_dir, kw, log_dir / f"{key}.log"))
        info[key] = engines[key].wait()
    for key, eng in engines.items():
        info[key]["log_concurrency"] = eng.grep(r"Maximum concurrency")
        info[key]["log_groups"] = eng.grep(r"(?i)kv cache group|hybrid kv cache|treating sliding")
    result["engines"] = info
    print(f"both engines up ({time.perf_counter() - t0:.0f} s); warm-up request at {min(args.contexts)} each")
    for eng in engines.values():
        eng.send({"cmd": "generate", "len": min(args.contexts), "max_tokens": args.output_len, "prompt_seed": 1})
    result["warmup"] = {key: eng.wait() for key, eng in engines.items()}

    t0 = time.perf_counter()
    result["runs"] = measure(engines, args, args.output_len)
    result["measure_s"] = time.perf_counter() - t0
    result["summary"] = summarize(
        result["runs"], args.contexts, ("mla_fp8", "mla") if args.latent_fp8 else ("mla", "afmoe")
    )
    if args.profile:
        result["profile"] = run_profiles(engines, args, cfg, profile_dirs, result["runs"])
    return result


def main(argv: list[str] | None = None) -> None:
    t_all = time.perf_counter()
    args = parse_args(argv)
    if args.child:
        return child_main(*args.child)
    args.contexts = sorted(set(args.contexts))
    log_dir = args.out.parent / "bench_trinity_decode-logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    import vllm

    what = f"{args.dtype} vs FP8 latent" if args.latent_fp8 else "MLA-Trinity vs built-in AFMoE"
    print(f"== {what}: decode time per token at long context")
    print(f"vllm {vllm.__version__}; plugin source: {local.plugin_state(REPO)}")
    with local.scratch_dir(args.model_dir, "bench-trinity-decode-") as root, contextlib.ExitStack() as running:
        result = run(args, root, log_dir, running)

    report(result, args)
    local.save_result(args.out, result, t_all, log_dir)


if __name__ == "__main__":
    main()
