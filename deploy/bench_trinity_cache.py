"""KV cache capacity of MLA-Trinity vs vLLM's built-in AFMoE at Trinity-Mini geometry, by vLLM's own arithmetic.

Run (from the repository root; no weights, no engine)::

    .venv/bin/python deploy/bench_trinity_cache.py

Add the real-engine check on a small geometry (two `vllm.LLM` start-ups)::

    .venv/bin/python deploy/bench_trinity_cache.py --engine

Options: `--help`. Results: tables on stdout and JSON (`--out`, default bench-out/bench_trinity_cache.json).

1. Theory (spec §1; bf16; per sequence at context L, sliding layers hold only their window W = 2048):
   24 sliding layers x min(L, W) x 2048 B (4 KV heads x 128 x K,V x 2 B) + 8 global layers x L x
   (512 B latent for MLA-Trinity | 2048 B K+V for AFMoE). At L = 32768: 224 MiB vs 608 MiB per sequence,
   ratio 2.71x; max concurrency = budget / that.
2. vLLM's figures at the full geometry (hidden 2048, 32 layers [S,S,S,F] x 8, 128 experts, ...): both models
   are built on the `meta` device from a config.json alone (vLLM's distributed state initialised in this
   process); every layer's spec is collected as the model runner does (`get_kv_cache_spec` of each
   `AttentionLayerBase` in `static_forward_context`, then `customize_attention_spec`), and grouped and sized
   by `vllm.v1.core.kv_cache_utils.get_kv_cache_configs` for the given budget (the engine core's
   `_initialize_kv_caches`). Max concurrency is `get_max_concurrency_for_kv_cache_config`, the number vLLM
   logs as "Maximum concurrency for N tokens per request". vLLM reserves, per sliding layer and request,
   window - 1 + max_in_flight_tokens (= max_num_batched_tokens without async scheduling) tokens, rounded up
   to blocks, + 1 block, so its ratio is lower than the window-only theory and depends on
   `--max-num-batched-tokens` (one row per value).
3. `--engine`: the demo geometry (`vllm_trn_plugin.demo.write_trinity_demo`, float32: 4 layers [S,S,S,F],
   window 128, 32 q / 4 KV heads x 128, latent 256) served by `vllm.LLM` twice, as TrinityMLAForCausalLM
   (the demo's random weights) and as the built-in AfmoeForCausalLM (same config.json without kv_lora_rank,
   `load_format="dummy"`), same kv_cache_memory_bytes and max_model_len; each engine runs in its own
   process and its log line "CPU KV cache size: N tokens, Maximum concurrency for L tokens per request: Xx"
   is parsed and compared with part 2's arithmetic on the same small configs.
4. Per rank under tensor parallelism (`--tensor-parallel-sizes`, default 1 2 4; `--tensor-parallel-sizes` alone
   skips it): part 2 at each size t. vLLM's parallel layers take their share from the tensor-parallel group they
   are built in, so for each t the script starts t children of itself (hidden `--tp-child`), one rank each of a
   vLLM TP group (gloo, file store); every rank builds both models on `meta`, rank 0 gathers all ranks' specs as
   the engine core does and sizes them as in part 2 (`--budgets-gib` is per rank). Per rank, AFMoE's K+V layers
   (both models' sliding layers, AFMoE's global ones) hold num_key_value_heads / t heads (2048, 1024, 512
   B/token/layer at t = 1, 2, 4) while MLA-Trinity's latent layers keep the whole 256-wide latent on every rank
   (512 B), so the theory ratio at L = 32768 falls from 2.71x (t = 1) to 1.73x (t = 2) and 1.0x (t = 4). The
   t = 1 group is checked against part 2. MLA-Trinity's key-scale store (16 B per token and latent layer at
   t = 1, halved with each doubling of t; docs/mla-trinity.md) is outside vLLM's specs and counted in neither.
5. FP8 latent cache (`--no-fp8` skips it), TP 1, spec level: four variants side by side, the bf16 original (built-in
   AFMoE), MLA-Trinity with a bf16 latent, with an FP8 latent (`--additional-config '{"latent_cache_dtype":
   "fp8"}'`, sliding layers bf16) and with FP8 latent + FP8 sliding layers (`--kv-cache-dtype fp8`). Spec level
   only: vLLM's CPU attention refuses an FP8 cache for the sliding layers on AVX2 hosts, its spec arithmetic does
   not. Theory per sequence at L (window-only sliding layers) without and with the latent layers' scale stores
   (per latent row: one fp32 key scale per KV head, + one fp32 dequantization scale for FP8; 8 x L x 20 B for FP8
   at t = 1), per-token averages including the stores, ratios vs the original; vLLM's max concurrency at the raw
   budget (its specs only) and at the budget the engine sizes its pool with once MLA-Trinity's build reserved the
   stores (`reserve_key_scale_budget`: budget / (1 + store bytes per latent byte); the stores cover every row of
   the pool's shared tensors, so they are charged on sliding blocks too). Target: >= 5x the original's
   concurrency for FP8 latent + FP8 sliding (printed: met or not, for theory and for vLLM).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_trn_plugin.demo import TRINITY_MINI as TRINITY_MINI_MLA

GiB = 1 << 30
MiB = 1 << 20
FALLBACK_WARNINGS = ("treating sliding-window layers as full attention", "Hybrid KV cache manager is disabled")

# Trinity-Mini's public geometry (spec §1); MLA-Trinity adds kv_lora_rank.
TRINITY_MINI = {k: v for k, v in TRINITY_MINI_MLA.items() if k != "kv_lora_rank"}
KV_LORA_RANK = TRINITY_MINI_MLA["kv_lora_rank"]
MODELS = {"mla": "TrinityMLAForCausalLM", "afmoe": "AfmoeForCausalLM"}
LABEL = {"mla": "MLA-Trinity", "afmoe": "AFMoE (built-in)"}
ENGINE_LOG = re.compile(
    r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--budgets-gib", type=float, nargs="+", default=[16, 64], help="cache budgets (default 16 64)")
    p.add_argument("--context", type=int, default=32768, help="tokens per request = max_model_len (default 32768)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        nargs="+",
        default=[2048, 8192],
        help="vLLM scheduler token budgets, one row each (default 2048 8192: CPU / H100 server defaults)",
    )
    p.add_argument(
        "--tensor-parallel-sizes",
        type=int,
        nargs="*",
        default=[1, 2, 4],
        help="part 4: per-rank figures at these TP sizes, each in its own process group (default 1 2 4; none: skip)",
    )
    p.add_argument("--no-fp8", dest="fp8", action="store_false", help="skip part 5 (FP8 latent cache)")
    p.add_argument("--engine", action="store_true", help="also start two small real engines")
    p.add_argument("--engine-budget-mib", type=int, default=256, help="engine kv_cache_memory_bytes (MiB)")
    p.add_argument("--engine-max-model-len", type=int, default=4096)
    p.add_argument("--engine-max-num-batched-tokens", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_trinity_cache.json"))
    p.add_argument(
        "--engine-child", nargs=5, metavar=("DIR", "LOAD_FORMAT", "BUDGET", "LEN", "MNBT"), help=argparse.SUPPRESS
    )
    p.add_argument("--tp-child", nargs=4, metavar=("RANK", "WORLD", "INIT_FILE", "CKPT_ROOT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- 1. theory --------------------------------------------------------------------------------------------


def theory(geo: dict[str, Any], context: int, dtype_bytes: int = 2, tp: int = 1) -> dict[str, Any]:
    """Cache bytes of one rank at tensor-parallel size `tp`: K+V layers keep the rank's share of the KV heads
    (one, replicated, when tp exceeds them: vLLM's QKVParallelLinear), the latent is whole on every rank."""
    n_slide = sum(t == "sliding_attention" for t in geo["layer_types"])
    n_glob = len(geo["layer_types"]) - n_slide
    kv_heads = max(1, geo["num_key_value_heads"] // tp)
    kv = kv_heads * geo["head_dim"] * 2 * dtype_bytes  # K and V of the rank's KV heads, per token
    latent = KV_LORA_RANK * dtype_bytes
    window = min(context, geo["sliding_window"])
    out: dict[str, Any] = {
        "tp": tp,
        "kv_heads_per_rank": kv_heads,
        "sliding_layers": n_slide,
        "global_layers": n_glob,
        "window_tokens": window,
    }
    for name, glob in (("mla", latent), ("afmoe", kv)):
        out[name] = {
            "sliding_layer_bytes_per_token": kv,
            "global_layer_bytes_per_token": glob,
            "bytes_per_token_inside_window": n_slide * kv + n_glob * glob,
            "bytes_per_token_beyond_window": n_glob * glob,
            "bytes_per_sequence": n_slide * window * kv + n_glob * context * glob,
        }
    out["ratio"] = out["afmoe"]["bytes_per_sequence"] / out["mla"]["bytes_per_sequence"]
    return out


# --- 2. vLLM's own spec collection, grouping and sizing ----------------------------------------------------


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


CAPTURE = _Capture()


def write_config(out: Path, arch: str, geo: dict[str, Any], dtype: str) -> str:
    from transformers import AfmoeConfig

    out.mkdir(parents=True, exist_ok=True)
    config = AfmoeConfig(**geo)
    config.architectures = [arch]
    cfg = config.to_dict()
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return str(out)


def engine_config(  # noqa: ANN201
    ckpt: str,
    dtype: str,
    max_model_len: int,
    mnbt: int,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
    additional_config: dict[str, Any] | None = None,
    kv_cache_memory_bytes: int | None = None,
):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=ckpt,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_batched_tokens=mnbt,
        tensor_parallel_size=tensor_parallel_size,
        enforce_eager=True,
        skip_tokenizer_init=True,
        kv_cache_dtype=kv_cache_dtype,
        additional_config=additional_config or {},
        kv_cache_memory_bytes=kv_cache_memory_bytes,
    ).create_engine_config()


_dist_world: int | None = None  # the tensor-parallel size this process's vLLM distributed state was set up for


def init_dist(vc, world: int = 1, rank: int = 0, init_method: str | None = None) -> None:  # noqa: ANN001
    """vLLM's distributed state, once per process: the parallel layers read their rank and group size from it
    when they are built. World 1 in the main process; in a part-4 child, rank `rank` of a `world`-rank gloo group
    (every rank must join: group creation is collective)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    global _dist_world
    if _dist_world is None:
        if world > 1 and init_method is None:
            raise ValueError("a tensor-parallel group needs the init_method its other ranks share")
        with set_current_vllm_config(vc):
            init_distributed_environment(world, rank, init_method or f"file://{tempfile.mktemp()}", rank, "gloo")
            ensure_model_parallel_initialized(world, 1)
        _dist_world = world
    if _dist_world != world:
        raise RuntimeError(f"vLLM's distributed state is for {_dist_world} ranks, this config wants {world}")


def collect_specs(vc) -> tuple[dict, list]:  # noqa: ANN001
    """Build the model on `meta`; each AttentionLayerBase's spec as GPUModelRunner.get_kv_cache_spec makes it."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_architecture

    from vllm_trn_plugin.compat import layer_specs

    init_dist(vc, vc.parallel_config.tensor_parallel_size)
    cls, _ = get_model_architecture(vc.model_config)
    with set_current_vllm_config(vc), torch.device("meta"):
        cls(vllm_config=vc)
    return layer_specs(vc)


def size_cache(vc, specs: dict, backends: list, budget: int, ranks: list[dict] | None = None) -> dict[str, Any]:  # noqa: ANN001
    """EngineCore._initialize_kv_caches with `budget` bytes per worker: layout, groups, blocks, concurrency.

    `ranks`: every worker's specs, as the engine core receives them (it refuses ranks whose specs differ); default
    `specs` alone, one worker."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    logging.getLogger("vllm").addHandler(CAPTURE)  # vLLM's dictConfig drops foreign handlers on every config
    first = len(CAPTURE.messages)
    register_all_kvcache_specs(vc)
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(vc, [layouts], specs.values())
    workers = ranks or [dict(specs)]
    configs = kcu.get_kv_cache_configs(vc, workers, [budget] * len(workers))
    sched = kcu.generate_scheduler_kv_cache_config(configs)
    groups = []
    for g in sched.kv_cache_groups:
        s = g.kv_cache_spec
        groups.append(
            {
                "type": type(s).__name__,
                "layers": len(g.layer_names),
                "first_layer": g.layer_names[0],
                "block_size": s.block_size,
                "page_bytes_per_layer": s.page_size_bytes,
                "sliding_window": getattr(s, "sliding_window", None),
                "blocks_per_request": kcu.cdiv(s.max_memory_usage_bytes(vc), s.page_size_bytes),
            }
        )
    blocks_per_request = sum(g["blocks_per_request"] for g in groups)
    return {
        "layout": layout.name,
        "max_in_flight_tokens": vc.max_in_flight_tokens,
        "num_blocks": sched.num_blocks,
        "block_bytes": budget // sched.num_blocks if sched.num_blocks else 0,
        "groups": groups,
        "blocks_per_request": blocks_per_request,
        "max_concurrency": kcu.get_max_concurrency_for_kv_cache_config(vc, sched),
        "kv_cache_size_tokens": kcu.get_kv_cache_capacity(vc, sched)[0],
        "warnings": CAPTURE.messages[first:],
    }


def spec_bytes(specs: dict, context: int) -> dict[str, Any]:
    """Per-token bytes from the per-layer specs; per sequence counting only the window on sliding layers."""
    per_layer = {}
    seq = inside = beyond = 0
    for name, s in specs.items():
        b = s.page_size_bytes // s.block_size
        window = getattr(s, "sliding_window", None)
        per_layer[name] = {"type": type(s).__name__, "bytes_per_token": b, "sliding_window": window}
        inside += b
        beyond += 0 if window else b
        seq += b * (min(window, context) if window else context)
    kinds = {}
    for v in per_layer.values():
        kinds.setdefault(v["type"], set()).add(v["bytes_per_token"])
    return {
        "bytes_per_token_by_spec": {k: sorted(v) for k, v in kinds.items()},
        "bytes_per_token_inside_window": inside,
        "bytes_per_token_beyond_window": beyond,
        "bytes_per_sequence": seq,
    }


def vllm_figures(
    root: Path, geo: dict[str, Any], dtype: str, context: int, budgets: list[int], mnbts: list[int]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, arch in MODELS.items():
        extra = {"kv_lora_rank": KV_LORA_RANK} if key == "mla" else {}
        ckpt = write_config(root / key, arch, {**geo, **extra}, dtype)
        specs, backends = collect_specs(engine_config(ckpt, dtype, context, mnbts[0]))
        rows = []
        for mnbt in mnbts:
            for budget in budgets:
                vc = engine_config(ckpt, dtype, context, mnbt)
                rows.append(
                    {"budget": budget, "max_num_batched_tokens": mnbt, **size_cache(vc, specs, backends, budget)}
                )
        out[key] = {"arch": arch, "spec_bytes": spec_bytes(specs, context), "rows": rows}
    return out


# --- 3. real engines on the demo geometry ------------------------------------------------------------------


def engine_child(ckpt: str, load_format: str, budget: int, max_model_len: int, mnbt: int) -> None:
    from vllm import LLM

    LLM(
        model=ckpt,
        dtype="float32",
        max_model_len=max_model_len,
        max_num_batched_tokens=mnbt,
        kv_cache_memory_bytes=budget,
        enforce_eager=True,
        load_format=load_format,
        seed=0,
    )
    print("ENGINE_READY", flush=True)


def write_demo_pair(root: Path) -> dict[str, str]:
    import torch

    from vllm_trn_plugin.demo import write_trinity_demo

    mla = write_trinity_demo(root / "mla", dtype=torch.float32)
    afmoe = write_trinity_demo(root / "afmoe", dtype=torch.float32)
    cfg = json.loads((afmoe / "config.json").read_text())
    cfg["architectures"] = ["AfmoeForCausalLM"]
    del cfg["kv_lora_rank"]
    (afmoe / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (afmoe / "model.safetensors").unlink()  # its tensor names are MLA-Trinity's; served with dummy weights
    return {"mla": str(mla), "afmoe": str(afmoe)}


def run_engines(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    budget, length, mnbt = args.engine_budget_mib * MiB, args.engine_max_model_len, args.engine_max_num_batched_tokens
    dirs = write_demo_pair(root)
    out: dict[str, Any] = {"budget": budget, "max_model_len": length, "max_num_batched_tokens": mnbt}
    for key, ckpt in dirs.items():
        specs, backends = collect_specs(engine_config(ckpt, "float32", length, mnbt))
        predicted = size_cache(engine_config(ckpt, "float32", length, mnbt), specs, backends, budget)
        load_format = "auto" if key == "mla" else "dummy"
        cmd = [sys.executable, __file__, "--engine-child", ckpt, load_format, str(budget), str(length), str(mnbt)]
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        log = proc.stdout + proc.stderr
        m = ENGINE_LOG.search(log)
        groups = re.search(r"kv cache group sizes \(([^)]*)\)", log)
        if proc.returncode != 0 or m is None or "ENGINE_READY" not in proc.stdout:
            raise RuntimeError(f"{key} engine failed (rc {proc.returncode}):\n{log[-4000:]}")
        out[key] = {
            "engine_tokens": int(m.group(1).replace(",", "")),
            "engine_max_concurrency": float(m.group(3)),
            "engine_group_block_sizes": groups.group(1) if groups else None,
            "engine_fallback_warning": any(w in log for w in FALLBACK_WARNINGS),
            "engine_seconds": time.perf_counter() - t0,
            "predicted": predicted,
        }
    out["engine_matches_computed"] = all(
        out[k]["engine_tokens"] == out[k]["predicted"]["kv_cache_size_tokens"]
        and abs(out[k]["engine_max_concurrency"] - out[k]["predicted"]["max_concurrency"]) < 0.006  # logged %.2f
        for k in dirs
    )
    out["engine_ratio"] = out["mla"]["engine_max_concurrency"] / out["afmoe"]["engine_max_concurrency"]
    out["predicted_ratio"] = out["mla"]["predicted"]["max_concurrency"] / out["afmoe"]["predicted"]["max_concurrency"]
    return out


# --- 4. per rank under tensor parallelism -----------------------------------------------------------------

TP_RESULT = "TP_RESULT "  # prefix of rank 0's one JSON line on stdout (vLLM logs to stdout too)
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def tp_child(rank: int, world: int, init_file: str, root: Path, args: argparse.Namespace) -> None:
    """One rank of a `world`-rank vLLM tensor-parallel group: build both models on `meta` (their parallel layers
    take this rank's share), gather every rank's specs on rank 0 as the engine core does, and size them there."""
    import torch

    mnbts, budgets = args.max_num_batched_tokens, [int(b * GiB) for b in args.budgets_gib]
    vcs = {key: engine_config(str(root / key), "bfloat16", args.context, mnbts[0], world) for key in MODELS}
    # The CPU worker names its shared-memory communicator after the init file (cpu_worker.init_device); vLLM's TP
    # group setup reads the name, so every rank needs it.
    os.environ["VLLM_DIST_IDENT"] = os.path.basename(init_file)
    init_dist(vcs["mla"], world, rank, f"file://{init_file}")
    out: dict[str, Any] = {}
    for key, vc in vcs.items():
        specs, backends = collect_specs(vc)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        torch.distributed.gather_object(specs, gathered, dst=0)
        if rank != 0:
            continue
        rows = []
        for mnbt in mnbts:
            for budget in budgets:
                sized = size_cache(
                    engine_config(str(root / key), "bfloat16", args.context, mnbt, world),
                    specs,
                    backends,
                    budget,
                    gathered,
                )
                rows.append({"budget": budget, "max_num_batched_tokens": mnbt, **sized})
        out[key] = {
            "arch": MODELS[key],
            "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
            "ranks_with_equal_specs": sum(g == specs for g in gathered),
            "spec_bytes": spec_bytes(specs, args.context),
            "rows": rows,
        }
    if rank == 0:
        print(TP_RESULT + json.dumps(out, default=str), flush=True)


def tp_figures(args: argparse.Namespace, root: Path, tp: int) -> dict[str, Any]:
    """Part 4 at one TP size: `tp` child processes (this script, --tp-child) forming one gloo group."""
    ident = f"bench-trinity-cache-{os.getpid()}-tp{tp}"  # unique per run: it names the ranks' shared memory
    init_file = str(root / ident)
    cpus = sorted(os.sched_getaffinity(0))
    # A binding set before the config is built is kept by the plugin's hook (engine_checks.bind_cpu_workers),
    # which would otherwise refuse more workers than cores; nothing here runs kernels, so cores may repeat.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", THREADS_BIND: "|".join(str(cpus[r % len(cpus)]) for r in range(tp))}
    passed = [
        "--context", str(args.context), "--budgets-gib", *map(str, args.budgets_gib),
        "--max-num-batched-tokens", *map(str, args.max_num_batched_tokens),
    ]  # fmt: skip
    t0 = time.perf_counter()
    procs, logs = [], []
    for rank in range(tp):
        log = (root / f"{ident}-rank{rank}.log").open("w+")
        cmd = [sys.executable, __file__, "--tp-child", str(rank), str(tp), init_file, str(root), *passed]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env))
        logs.append(log)
    try:
        deadline = time.monotonic() + 900
        while any(p.poll() is None for p in procs):
            # A rank that died leaves the others waiting in a collective: stop them rather than time out.
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    line = next((x for x in texts[0].splitlines() if x.startswith(TP_RESULT)), None)
    if any(p.returncode != 0 for p in procs) or line is None:
        tails = "\n".join(
            f"--- rank {r} (rc {p.returncode}):\n{t[-3000:]}" for r, (p, t) in enumerate(zip(procs, texts))
        )
        raise RuntimeError(f"TP={tp} children failed:\n{tails}")
    return {
        "tp": tp,
        "theory": theory(TRINITY_MINI, args.context, tp=tp),
        "vllm": json.loads(line.removeprefix(TP_RESULT)),
        "seconds": time.perf_counter() - t0,
    }


# --- 5. FP8 latent cache (TP 1, spec level) ---------------------------------------------------------------

MB = 10**6  # part 5 quotes decimal MB, as the theory figures do
# key: label, model, --kv-cache-dtype, --additional-config, latent bytes per value (None: K+V global layers),
# sliding layers' bytes per value
FP8_VARIANTS: dict[str, tuple[str, str, str, dict[str, Any], int | None, int]] = {
    "original": ("bf16 original (built-in AFMoE)", "afmoe", "auto", {}, None, 2),
    "mla_bf16": ("MLA-Trinity bf16 latent", "mla", "auto", {}, 2, 2),
    "mla_fp8": ("MLA-Trinity FP8 latent", "mla", "auto", {"latent_cache_dtype": "fp8"}, 1, 2),
    "mla_fp8_all": ("MLA-Trinity FP8 latent + FP8 sliding", "mla", "fp8", {}, 1, 1),
}
FP8_TARGET = 5.0  # x the original's concurrency, for the last variant


def theory_fp8(geo: dict[str, Any], context: int, latent_bytes: int | None, sliding_bytes: int) -> dict[str, Any]:
    """One sequence at `context`, TP 1: sliding layers hold their window only; a latent row's scale stores hold one
    fp32 key scale per KV head (+ one fp32 dequantization scale for an FP8 latent) per latent layer and token."""
    n_slide = sum(t == "sliding_attention" for t in geo["layer_types"])
    n_glob = len(geo["layer_types"]) - n_slide
    kv_row = geo["num_key_value_heads"] * geo["head_dim"] * 2  # K and V values per token and layer
    window = min(context, geo["sliding_window"])
    if latent_bytes is None:
        glob_row, scale_row = kv_row * 2, 0  # the original's global layers: bf16 K+V
    else:
        glob_row = KV_LORA_RANK * latent_bytes
        scale_row = geo["num_key_value_heads"] * 4 + (4 if latent_bytes == 1 else 0)
    cache = n_slide * window * kv_row * sliding_bytes + n_glob * context * glob_row
    scales = n_glob * context * scale_row
    return {
        "sliding_layer_bytes_per_token": kv_row * sliding_bytes,
        "global_layer_bytes_per_token": glob_row,
        "scale_bytes_per_latent_row": scale_row,
        "scale_bytes_per_latent_byte": scale_row / glob_row,
        "cache_bytes_per_sequence": cache,
        "scale_bytes_per_sequence": scales,
        "dequant_scale_bytes_per_sequence": n_glob * context * 4 if latent_bytes == 1 else 0,
        "bytes_per_sequence": cache + scales,
        "avg_bytes_per_token": (cache + scales) / context,
    }


def fp8_figures(root: Path, geo: dict[str, Any], context: int, budgets: list[int], mnbts: list[int]) -> dict[str, Any]:
    """Each variant built on `meta` under its own config (the latent's dtype comes from `latent_cache_dtype`), sized
    by vLLM at the raw budget and at the budget left once the model's build reserved the scale stores."""
    from vllm_trn_plugin.model_executors.latent_cache import reserve_key_scale_budget

    dtype, out = "bfloat16", {}
    ckpts = {key: write_config(root / key, arch, {**geo, **({"kv_lora_rank": KV_LORA_RANK} if key == "mla" else {})},
                               dtype) for key, arch in MODELS.items()}  # fmt: skip
    for key, (label, model, kvd, extra, lb, sb) in FP8_VARIANTS.items():

        def cfg(mnbt: int, budget: int | None = None, model: str = model, kvd: str = kvd, extra: dict = extra):  # noqa: ANN202
            return engine_config(ckpts[model], dtype, context, mnbt, 1, kvd, extra, budget)

        specs, backends = collect_specs(cfg(mnbts[0]))
        rows = []
        for mnbt in mnbts:
            for budget in budgets:
                vc = cfg(mnbt, budget)
                if model == "mla":
                    reserve_key_scale_budget(vc)  # what TrinityMLAForCausalLM's build does in the worker
                reserved = vc.cache_config.kv_cache_memory_bytes
                raw = size_cache(cfg(mnbt), specs, backends, budget)
                eng = size_cache(vc, specs, backends, reserved)
                per_request = sum(
                    g["blocks_per_request"] * g["page_bytes_per_layer"] * g["layers"] for g in raw["groups"]
                )
                rows.append(
                    {
                        "budget": budget,
                        "max_num_batched_tokens": mnbt,
                        "engine_budget": reserved,
                        "vllm_bytes_per_request": per_request,
                        "max_concurrency": raw["max_concurrency"],
                        "engine_max_concurrency": eng["max_concurrency"],
                        "num_blocks": raw["num_blocks"],
                        "engine_num_blocks": eng["num_blocks"],
                        "groups": [(g["type"], g["layers"], g["block_size"]) for g in raw["groups"]],
                        "fallback_warnings": [
                            w for w in raw["warnings"] + eng["warnings"] if any(f in w for f in FALLBACK_WARNINGS)
                        ],
                    }
                )
        out[key] = {
            "label": label,
            "kv_cache_dtype": kvd,
            "additional_config": extra,
            "spec_dtypes": sorted({f"{type(s).__name__}:{s.dtype}" for s in specs.values()}),
            "spec_bytes": spec_bytes(specs, context),
            "theory": theory_fp8(geo, context, lb, sb),
            "rows": rows,
        }
    return out


def report_fp8(res: dict[str, Any], ctx: int) -> None:
    f = res["fp8"]
    base = f["original"]["theory"]
    print(
        f"\n== 5. FP8 latent cache, Trinity-Mini geometry, TP 1, context {ctx}, window "
        f"{TRINITY_MINI['sliding_window']} (spec level; MB = 10^6 B) =="
    )
    print(
        "Per sequence: cache = the layers' K/V or latent (sliding layers: window only); scales = the latent layers' "
        "side stores\n(per latent layer and token: 4 KV heads x 4 B key scales, + 4 B dequantization scale for FP8); "
        "B/token = (cache + scales) / context."
    )
    print(
        f"{'variant':38}{'latent':>15}{'sliding':>15}{'cache MB':>10}{'ratio':>8}{'+scales MB':>12}{'total MB':>10}"
        f"{'B/token':>9}{'ratio':>8}{'spec MB':>9}"
    )
    for v in f.values():
        t = v["theory"]
        dt = dict(x.split(":", 1) for x in v["spec_dtypes"])
        print(
            f"{v['label']:38}{dt.get('MLAAttentionSpec', dt.get('FullAttentionSpec', '')).removeprefix('torch.'):>15}"
            f"{dt.get('SlidingWindowSpec', '').removeprefix('torch.'):>15}"
            f"{t['cache_bytes_per_sequence'] / MB:>10.1f}"
            f"{base['cache_bytes_per_sequence'] / t['cache_bytes_per_sequence']:>7.2f}x"
            f"{t['scale_bytes_per_sequence'] / MB:>12.2f}{t['bytes_per_sequence'] / MB:>10.1f}"
            f"{t['avg_bytes_per_token']:>9,.0f}{base['bytes_per_sequence'] / t['bytes_per_sequence']:>7.2f}x"
            f"{v['spec_bytes']['bytes_per_sequence'] / MB:>9.1f}"
        )
    print(
        "  (first ratio: cache only, vs the original; second: with the scale stores; spec MB: vLLM's per-layer specs, "
        "window only, no stores)\n  issue's theory: 637.5 MB original; 234.9 MB (2.71x) bf16 latent; 167.8 MB (3.80x) "
        "FP8 latent; 117.4 MB (5.43x) FP8 latent + FP8 sliding, before scales; FP8 latent scale ~1%"
    )
    for v in f.values():
        t = v["theory"]
        if t["scale_bytes_per_sequence"]:
            print(
                f"  {v['label']}: scale stores {t['scale_bytes_per_sequence'] / t['cache_bytes_per_sequence']:.1%} "
                f"of the cache (the FP8 dequantization scale alone "
                f"{t['dequant_scale_bytes_per_sequence'] / t['cache_bytes_per_sequence']:.1%}); stores = "
                f"{t['scale_bytes_per_latent_byte']:.2%} of the latent bytes"
            )

    print(
        f"\nMaximum concurrency for {ctx} tokens per request (vLLM: get_max_concurrency_for_kv_cache_config); raw: "
        f"vLLM's specs at the budget; engine: at the budget left after MLA-Trinity's build reserved the scale stores "
        f"(budget / (1 + store bytes per latent byte)); theory: budget / total MB above"
    )
    print(
        f"{'variant':38}{'budget':>7}{'batched':>8}{'vLLM MB/req':>12}{'raw':>8}{'engine':>8}{'ratio':>8}"
        f"{'theory':>8}{'ratio':>8}  groups (type x layers, block)"
    )
    for v in f.values():
        for i, r in enumerate(v["rows"]):
            o = f["original"]["rows"][i]
            th = r["budget"] / v["theory"]["bytes_per_sequence"]
            groups = ", ".join(f"{n}x{t.removesuffix('Spec')}/{b}" for t, n, b in r["groups"])
            fb = " FALLBACK" if r["fallback_warnings"] else ""
            print(
                f"{v['label']:38}{r['budget'] / GiB:>5.0f}Gi{r['max_num_batched_tokens']:>8}"
                f"{r['vllm_bytes_per_request'] / MB:>12.1f}{r['max_concurrency']:>8.2f}"
                f"{r['engine_max_concurrency']:>8.2f}"
                f"{r['engine_max_concurrency'] / o['engine_max_concurrency']:>7.2f}x{th:>8.2f}"
                f"{th / (o['budget'] / base['bytes_per_sequence']):>7.2f}x  {groups}{fb}"
            )
    last = f["mla_fp8_all"]
    t_ratio = base["bytes_per_sequence"] / last["theory"]["bytes_per_sequence"]
    t_ratio0 = base["cache_bytes_per_sequence"] / last["theory"]["cache_bytes_per_sequence"]
    v_ratios = [
        r["engine_max_concurrency"] / o["engine_max_concurrency"] for r, o in zip(last["rows"], f["original"]["rows"])
    ]
    ok = lambda x: "met" if x >= FP8_TARGET else "NOT met"  # noqa: E731
    print(
        f"target >= {FP8_TARGET:.0f}x the original for {last['label']}: theory {t_ratio0:.2f}x before scales "
        f"({ok(t_ratio0)}), {t_ratio:.2f}x with the scale stores ({ok(t_ratio)}); vLLM (engine budget, per row) "
        + ", ".join(f"{x:.2f}x" for x in v_ratios)
        + f" ({ok(min(v_ratios))} at the smallest, {ok(max(v_ratios))} at the largest)"
    )


# --- report ------------------------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    return f"{n / MiB:,.1f} MiB" if n >= MiB else f"{n:,.0f} B"


def print_bytes(entries: list[tuple[int, dict[str, Any], dict[str, Any]]], ctx: int) -> None:
    """Per (tensor-parallel size t, theory, vLLM's figures): bytes per token and layer by theory, per token and per
    sequence by vLLM's per-layer specs, and the AFMoE / MLA ratio."""
    print(
        f"{'':18}{'t':>3}{'sliding layer':>14}{'global layer':>13}{'token in window':>17}{'token beyond':>14}"
        f"{'per sequence':>14}{'theory':>12}{'avg/token':>10}"
    )
    for t, th, vf in entries:
        for key in MODELS:
            a, s = th[key], vf[key]["spec_bytes"]
            same = "" if a["bytes_per_sequence"] == s["bytes_per_sequence"] else " (differs)"
            print(
                f"{LABEL[key]:18}{t:>3}{a['sliding_layer_bytes_per_token']:>14,}{a['global_layer_bytes_per_token']:>13,}"
                f"{s['bytes_per_token_inside_window']:>17,}{s['bytes_per_token_beyond_window']:>14,}"
                f"{fmt_bytes(s['bytes_per_sequence']):>14}{fmt_bytes(a['bytes_per_sequence']):>12}"
                f"{s['bytes_per_sequence'] / ctx:>10,.0f}{same}"
            )
        ratio = vf["afmoe"]["spec_bytes"]["bytes_per_sequence"] / vf["mla"]["spec_bytes"]["bytes_per_sequence"]
        print(f"{'  AFMoE/MLA':18}{t:>3}{'':84}{ratio:>10.2f}x (theory {th['ratio']:.2f}x)")
    print("  (sliding/global layer: theory bytes/token/layer; token and sequence columns: vLLM's per-layer specs)")


def print_concurrency(entries: list[tuple[int, dict[str, Any], dict[str, Any]]]) -> None:
    """Per (tensor-parallel size t, theory, vLLM's figures) and sized configuration: vLLM's blocks and maximum
    concurrency for both models, and theory's (budget / bytes per sequence)."""
    print(
        f"{'t':>3}{'budget':>8}{'max_batched':>12}{'in-flight':>10}{'blocks':>8}{'MLA blk/req':>12}"
        f"{'AFMoE blk/req':>14}{'MLA':>9}{'AFMoE':>9}{'ratio':>8}  |{'theory MLA':>11}{'AFMoE':>8}{'ratio':>8}"
    )
    for t, th, vf in entries:
        for rm, ra in zip(vf["mla"]["rows"], vf["afmoe"]["rows"]):
            budget = rm["budget"]
            tm, ta = budget / th["mla"]["bytes_per_sequence"], budget / th["afmoe"]["bytes_per_sequence"]
            cm, ca = rm["max_concurrency"], ra["max_concurrency"]
            print(
                f"{t:>3}{budget / GiB:>6.0f}Gi{rm['max_num_batched_tokens']:>12}{rm['max_in_flight_tokens']:>10}"
                f"{rm['num_blocks']:>8}{rm['blocks_per_request']:>12}{ra['blocks_per_request']:>14}{cm:>9.2f}"
                f"{ca:>9.2f}{cm / ca:>7.2f}x  |{tm:>11.2f}{ta:>8.2f}{tm / ta:>7.2f}x"
            )


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    th, vf, ctx = res["theory"], res["vllm"], args.context
    print(f"\n== Per-token cache bytes, Trinity-Mini geometry, bf16, context {ctx} (sliding layers: window only) ==")
    for key in MODELS:  # theory == vLLM's per-layer specs
        assert th[key]["bytes_per_sequence"] == vf[key]["spec_bytes"]["bytes_per_sequence"], (th[key], vf[key])
    print_bytes([(1, th, vf)], ctx)
    print(
        f"theory per sequence: {th['sliding_layers']} x {th['window_tokens']} x 2048 B + {th['global_layers']} x "
        f"{ctx} x (512 | 2048) B; ratio {th['ratio']:.3f}x (vLLM's per-layer specs give the same bytes)"
    )
    for key in MODELS:
        print(f"  {LABEL[key]} spec bytes/token/layer: {vf[key]['spec_bytes']['bytes_per_token_by_spec']}")

    print("\n== vLLM's grouping (first row's config) ==")
    for key in MODELS:
        r = vf[key]["rows"][0]
        print(
            f"{LABEL[key]}: layout {r['layout']}, {len(r['groups'])} groups, block = {fmt_bytes(r['block_bytes'])} "
            f"in the shared pool"
        )
        for g in r["groups"]:
            sw = f", window {g['sliding_window']}" if g["sliding_window"] else ""
            print(
                f"  {g['type']:18} {g['layers']} layers (from {g['first_layer']}), block_size {g['block_size']} "
                f"tokens, page {fmt_bytes(g['page_bytes_per_layer'])}/layer{sw}, "
                f"{g['blocks_per_request']} blocks/request at {ctx}"
            )
        fallback = [w for row in vf[key]["rows"] for w in row["warnings"] if any(f in w for f in FALLBACK_WARNINGS)]
        print(f"  full-attention fallback warnings: {len(fallback)}")

    print(f"\n== Maximum concurrency for {ctx} tokens per request (vLLM: get_max_concurrency_for_kv_cache_config) ==")
    print_concurrency([(1, th, vf)])

    if res.get("tp"):
        report_tp(res, ctx)

    if "fp8" in res:
        report_fp8(res, ctx)

    if "engine" in res:
        e = res["engine"]
        print(
            f"\n== Real engines, demo geometry (float32, window 128, 4 layers), kv_cache_memory_bytes "
            f"{fmt_bytes(e['budget'])}, max_model_len {e['max_model_len']}, "
            f"max_num_batched_tokens {e['max_num_batched_tokens']} =="
        )
        for key in MODELS:
            x = e[key]
            p = x["predicted"]
            print(
                f"{LABEL[key]:18} logged: {x['engine_tokens']:>9,} tokens, {x['engine_max_concurrency']:.2f}x "
                f"(groups' block sizes {x['engine_group_block_sizes']}; fallback warning: "
                f"{x['engine_fallback_warning']}; {x['engine_seconds']:.0f} s) | computed: "
                f"{p['kv_cache_size_tokens']:,} tokens, {p['max_concurrency']:.2f}x"
            )
        match = "engine == computed" if e["engine_matches_computed"] else "MISMATCH between engine and computed"
        print(f"ratio: engine {e['engine_ratio']:.3f}x, computed {e['predicted_ratio']:.3f}x ({match})")


def report_tp(res: dict[str, Any], ctx: int) -> None:
    entries = [(e["tp"], e["theory"], e["vllm"]) for e in res["tp"]]
    print(
        f"\n== 4. Per rank at tensor-parallel size t, Trinity-Mini geometry, bf16, context {ctx} (vLLM's specs from a "
        f"t-rank gloo group; budget per rank) =="
    )
    print_bytes(entries, ctx)
    print(
        f"\nMaximum concurrency for {ctx} tokens per request, per rank's budget (vLLM | theory = budget / per sequence)"
    )
    print_concurrency(entries)
    print("vLLM's groups per rank (first row's config):")
    for entry in res["tp"]:
        for key in MODELS:
            v = entry["vllm"][key]
            groups = ", ".join(
                f"{g['layers']} x {g['type']} (block {g['block_size']} tokens, {fmt_bytes(g['page_bytes_per_layer'])}"
                f"/layer, {g['blocks_per_request']} blk/req)"
                for g in v["rows"][0]["groups"]
            )
            print(
                f"  t={entry['tp']} {LABEL[key]}: {groups}; specs equal on {v['ranks_with_equal_specs']}/{entry['tp']} "
                f"ranks ({entry['seconds']:.0f} s for the group)"
            )
    if "t1_matches_part2" in res:
        print(f"t=1 group == part 2 (one process, no group): {res['t1_matches_part2']}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.engine_child:
        ckpt, load_format, budget, length, mnbt = args.engine_child
        engine_child(ckpt, load_format, int(budget), int(length), int(mnbt))
        return
    from vllm_trn_plugin import register

    register()
    if args.tp_child:
        rank, world, init_file, root = args.tp_child
        tp_child(int(rank), int(world), init_file, Path(root), args)
        return
    t0 = time.perf_counter()
    budgets = [int(b * GiB) for b in args.budgets_gib]
    res: dict[str, Any] = {"context": args.context, "theory": theory(TRINITY_MINI, args.context)}
    with tempfile.TemporaryDirectory() as d:
        res["vllm"] = vllm_figures(
            Path(d) / "full", TRINITY_MINI, "bfloat16", args.context, budgets, args.max_num_batched_tokens
        )
        # Part 4's children read the config.json files part 2 wrote under `full`.
        res["tp"] = [tp_figures(args, Path(d) / "full", tp) for tp in args.tensor_parallel_sizes]
        one = next((e for e in res["tp"] if e["tp"] == 1), None)
        if one is not None:
            res["t1_matches_part2"] = all(
                [r["max_concurrency"] for r in one["vllm"][k]["rows"]]
                == [r["max_concurrency"] for r in res["vllm"][k]["rows"]]
                for k in MODELS
            )
        if args.fp8:
            res["fp8"] = fp8_figures(Path(d) / "fp8", TRINITY_MINI, args.context, budgets, args.max_num_batched_tokens)
        if args.engine:
            res["engine"] = run_engines(args, Path(d) / "demo")
    res["seconds"] = time.perf_counter() - t0
    report(res, args)
    print(f"\ntotal {res['seconds']:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
