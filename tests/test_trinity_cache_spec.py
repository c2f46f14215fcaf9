"""MLA-Trinity's KV cache at the full Trinity-Mini geometry, as vLLM itself sees and groups it.

No weights: a child process (so pytest's process never initialises vLLM's distributed state) builds
each model on the `meta` device from a config.json alone, collects every layer's spec the way vLLM's
model runner does (`GPUModelRunner.get_kv_cache_spec`: each `AttentionLayerBase` found in
`static_forward_context`, passed through `customize_attention_spec` with its backend), resolves the
cache layout and runs vLLM's own grouping and sizing (`get_kv_cache_configs`, as the engine core's
`_initialize_kv_caches` does), capturing vLLM's log records meanwhile.

Checked for MLA-Trinity (and, as the baseline, vLLM's built-in AfmoeForCausalLM at the same geometry):
- each latent layer caches 256 values per token (bf16: 512 B), `MLAAttentionSpec(num_kv_heads=1,
  head_size=256)`; each sliding layer keeps vLLM's own sliding-window spec (4 KV heads x 128, K and V,
  window 2048), identical to the built-in model's;
- vLLM's grouping keeps the sliding layers as sliding-window groups: no fallback to full-attention
  allocation (warning "treating sliding-window layers as full attention", or "Hybrid KV cache manager
  is disabled"). A control run with a latent width that breaks the integer page ratio must produce the
  warning, so the check cannot pass just because the log capture missed it.

And for the FP8 latent cache (`latent_cache_dtype`, model_executors/latent_cache.py): `--additional-config
'{"latent_cache_dtype": "fp8"}'` alone puts only the latent in FP8 (1 B per value: half the bf16 page) and leaves
the sliding layers in bf16; `--kv-cache-dtype fp8` ("auto") puts both in FP8. Either way vLLM keeps its sliding-window
groups, and its max concurrency at 32k rises by what the bytes per request (derived here from the geometry, with
the scale stores the engine reserves out of the budget) say.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_trn_plugin.demo import TRINITY_MINI as TRINITY_MINI_MLA

NUM_LAYERS = TRINITY_MINI_MLA["num_hidden_layers"]
LATENT_LAYERS = [i for i in range(NUM_LAYERS) if i % 4 == 3]  # 3, 7, ..., 31
SLIDING_LAYERS = [i for i in range(NUM_LAYERS) if i % 4 != 3]
MAX_MODEL_LEN = 32768
FALLBACK_WARNINGS = ("treating sliding-window layers as full attention", "Hybrid KV cache manager is disabled")
BUDGET = 16 << 30  # the child's cache budget (one worker)
FP8 = "torch.float8_e4m3fn"
FP8_LATENT = {"latent_cache_dtype": "fp8"}

# Trinity-Mini's public geometry (spec §1); kv_lora_rank only in the MLA-Trinity config.
TRINITY_MINI = {k: v for k, v in TRINITY_MINI_MLA.items() if k != "kv_lora_rank"}

CHILD = textwrap.dedent(
    """
    import json, logging, sys, tempfile
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    from vllm_trn_plugin import register
    from vllm_trn_plugin.compat import layer_specs

    MAX_MODEL_LEN, BUDGET, RUNS = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))

    CAPTURE = Capture()

    def config(run):
        # kv_cache_memory_bytes: MLA-Trinity's build reserves its scale stores out of it (reserve_key_scale_budget).
        return EngineArgs(
            model=run["ckpt"], dtype="bfloat16", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=2048,
            enforce_eager=True, skip_tokenizer_init=True, kv_cache_dtype=run["kv_cache_dtype"],
            additional_config=run["additional_config"], kv_cache_memory_bytes=BUDGET,
        ).create_engine_config()

    def describe(spec):
        return {
            "type": type(spec).__name__,
            "block_size": spec.block_size,
            "num_kv_heads": getattr(spec, "num_kv_heads", None),
            "head_size": getattr(spec, "head_size", None),
            "head_size_v": getattr(spec, "head_size_v", None),
            "dtype": str(getattr(spec, "dtype", None)),
            "sliding_window": getattr(spec, "sliding_window", None),
            "page_size_bytes": spec.page_size_bytes,
        }

    def group(vc, specs, backends, budget=BUDGET):
        # vllm/v1/engine/core.py EngineCore._initialize_kv_caches, one worker, BUDGET bytes.
        # vLLM re-applies its logging dictConfig (dropping foreign handlers) whenever it builds a config.
        logging.getLogger("vllm").addHandler(CAPTURE)
        first = len(records)
        register_all_kvcache_specs(vc)
        layouts = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
        layout = resolve_kv_cache_layout(vc, [layouts], specs.values())
        configs = kcu.get_kv_cache_configs(vc, [dict(specs)], [budget])
        sched = kcu.generate_scheduler_kv_cache_config(configs)
        return {
            "layout": layout.name,
            "groups": [
                {**describe(g.kv_cache_spec), "layers": g.layer_names,
                 "blocks_per_request": kcu.cdiv(g.kv_cache_spec.max_memory_usage_bytes(vc),
                                                g.kv_cache_spec.page_size_bytes)}
                for g in sched.kv_cache_groups
            ],
            "num_blocks": sched.num_blocks,
            "max_concurrency": kcu.get_max_concurrency_for_kv_cache_config(vc, sched),
            "warnings": [m for level, m in records[first:] if level in ("WARNING", "ERROR")],
        }

    register()
    with set_current_vllm_config(config(RUNS[0])):
        init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
    results = {}
    for run in RUNS:
        vc = config(run)
        cls, _ = get_model_architecture(vc.model_config)
        with set_current_vllm_config(vc), torch.device("meta"):
            cls(vllm_config=vc)
        specs, backends = layer_specs(vc)
        # What the engine sizes the pool with: the budget after the model's build (MLA-Trinity's scale stores).
        reserved = vc.cache_config.kv_cache_memory_bytes
        at_reserved = group(vc, specs, backends, reserved)
        results[run["key"]] = {
            "arch": cls.__name__,
            "layers": {name: describe(s) for name, s in specs.items()},
            **group(vc, specs, backends),
            "reserved_budget": reserved,
            "reserved": {k: at_reserved[k] for k in ("num_blocks", "max_concurrency", "warnings")},
        }
        if run.get("control"):
            # Control: a latent page that does not divide the sliding page (288 values) must make vLLM fall back.
            bad = {n: (MLAAttentionSpec(block_size=s.block_size, num_kv_heads=1, head_size=288, dtype=s.dtype)
                       if isinstance(s, MLAAttentionSpec) else s) for n, s in specs.items()}
            vc = config(run)
            results["control"] = group(vc, bad, backends)
    print("RESULTS" + json.dumps(results))
    """
)


def write_config(out: Path, arch: str, **extra: object) -> str:
    from transformers import AfmoeConfig

    out.mkdir(parents=True)
    config = AfmoeConfig(**TRINITY_MINI, **extra)
    config.architectures = [arch]
    cfg = config.to_dict()
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return str(out)


def run_child(runs: list[dict]) -> dict:
    """Each run {key, ckpt, kv_cache_dtype, additional_config[, control]} in one child process: results by key."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(MAX_MODEL_LEN), str(BUDGET), json.dumps(runs)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS")]
    assert line, f"child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(line[0].removeprefix("RESULTS"))


def run(key: str, ckpt: str, kv_cache_dtype: str = "auto", additional_config: dict | None = None, **kw: object) -> dict:
    return {
        "key": key,
        "ckpt": ckpt,
        "kv_cache_dtype": kv_cache_dtype,
        "additional_config": additional_config or {},
        **kw,
    }


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("trinity-mini-configs")
    mla = write_config(root / "mla-trinity", "TrinityMLAForCausalLM", kv_lora_rank=TRINITY_MINI_MLA["kv_lora_rank"])
    return mla, write_config(root / "afmoe", "AfmoeForCausalLM")


@pytest.fixture(scope="module")
def results(configs: tuple[str, str]) -> dict:
    """All runs in one child (one vLLM import): the bf16 pair, the control, and MLA-Trinity's two FP8 cases."""
    mla, afmoe = configs
    return run_child(
        [
            run("mla", mla, control=True),
            run("afmoe", afmoe),
            run("mla_fp8_latent", mla, additional_config=FP8_LATENT),
            run("mla_fp8_kv", mla, "fp8"),
        ]
    )


def sliding_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"  # vLLM's Attention inside AfmoeAttention


def bytes_per_token(spec: dict) -> int:
    return spec["page_size_bytes"] // spec["block_size"]


def check_sliding_layers(layers: dict) -> None:
    for i in SLIDING_LAYERS:
        s = layers[sliding_name(i)]
        assert s["type"] == "SlidingWindowSpec", (i, s)
        assert (s["num_kv_heads"], s["head_size"], s["head_size_v"]) == (4, 128, 128), (i, s)
        assert s["sliding_window"] == 2048 and s["dtype"] == "torch.bfloat16", (i, s)
        assert bytes_per_token(s) == 4 * (128 + 128) * 2, (i, s)


def check_grouping(res: dict, global_type: str, global_names: list[str]) -> dict:
    """Three sliding-window groups of 8 layers each and one group of the 8 global layers, one page size."""
    assert res["layout"] == "LBHNC"
    for w in res["warnings"]:
        assert not any(f in w for f in FALLBACK_WARNINGS), w
        assert "padding layers" not in w, w
    groups = res["groups"]
    assert len(groups) == 4, groups
    sliding = [g for g in groups if g["type"] == "SlidingWindowSpec"]
    glob = [g for g in groups if g["type"] == global_type]
    assert len(sliding) == 3 and len(glob) == 1, [(g["type"], g["layers"]) for g in groups]
    assert sorted(n for g in sliding for n in g["layers"]) == sorted(sliding_name(i) for i in SLIDING_LAYERS)
    assert all(len(g["layers"]) == 8 and g["sliding_window"] == 2048 for g in sliding)
    assert sorted(glob[0]["layers"]) == sorted(global_names)
    assert len({g["page_size_bytes"] for g in groups}) == 1, "groups share one physical page size"
    return glob[0]


def test_latent_layers_cache_256_values_per_token(results: dict) -> None:
    layers = results["mla"]["layers"]
    assert results["mla"]["arch"] == "TrinityMLAForCausalLM"
    assert len(layers) == NUM_LAYERS
    for i in LATENT_LAYERS:
        s = layers[f"model.layers.{i}.self_attn"]
        assert s["type"] == "MLAAttentionSpec", (i, s)
        assert (s["num_kv_heads"], s["head_size"], s["head_size_v"]) == (1, 256, 0), (i, s)
        assert s["dtype"] == "torch.bfloat16", (i, s)
        assert bytes_per_token(s) == 512, (i, s)  # 256 values x 2 B, stored once


def test_sliding_layers_keep_vllms_sliding_window_spec(results: dict) -> None:
    check_sliding_layers(results["mla"]["layers"])
    check_sliding_layers(results["afmoe"]["layers"])
    for i in SLIDING_LAYERS:  # exactly what vLLM's own AFMoE declares
        assert results["mla"]["layers"][sliding_name(i)] == results["afmoe"]["layers"][sliding_name(i)], i


def test_vllm_groups_mla_trinity_without_full_attention_fallback(results: dict) -> None:
    res = results["mla"]
    latent = check_grouping(res, "MLAAttentionSpec", [f"model.layers.{i}.self_attn" for i in LATENT_LAYERS])
    sliding_block = {g["block_size"] for g in res["groups"] if g["type"] == "SlidingWindowSpec"}
    assert len(sliding_block) == 1
    # Page sizes unified by block size: a latent token is 4x smaller, so its block holds 4x the tokens.
    assert latent["block_size"] == 4 * sliding_block.pop()
    assert latent["blocks_per_request"] == MAX_MODEL_LEN // latent["block_size"]


def test_builtin_afmoe_baseline(results: dict) -> None:
    res = results["afmoe"]
    assert res["arch"] == "AfmoeForCausalLM"
    layers = res["layers"]
    assert len(layers) == NUM_LAYERS
    check_sliding_layers(layers)
    for i in LATENT_LAYERS:
        s = layers[sliding_name(i)]
        assert s["type"] == "FullAttentionSpec", (i, s)
        assert (s["num_kv_heads"], s["head_size"], s["head_size_v"]) == (4, 128, 128), (i, s)
        assert bytes_per_token(s) == 2048, (i, s)
    full = check_grouping(res, "FullAttentionSpec", [sliding_name(i) for i in LATENT_LAYERS])
    assert full["blocks_per_request"] == MAX_MODEL_LEN // full["block_size"]


def test_mla_trinity_fits_more_32k_sequences(results: dict) -> None:
    mla, afmoe = results["mla"], results["afmoe"]
    assert mla["num_blocks"] == afmoe["num_blocks"], "same budget, same block bytes"
    # vLLM reserves window - 1 + max_num_batched_tokens (+1 block) per sliding layer, so its ratio is below the
    # window-only theory (~2.71x); see deploy/bench_trinity_cache.py.
    assert mla["max_concurrency"] / afmoe["max_concurrency"] > 2.0


def test_fallback_warning_is_captured_when_it_happens(results: dict) -> None:
    """Control: the absence checks above would pass vacuously if vLLM's log records were not captured."""
    ctl = results["control"]
    assert any(FALLBACK_WARNINGS[0] in w for w in ctl["warnings"]), ctl["warnings"]
    assert not any(g["type"] == "SlidingWindowSpec" for g in ctl["groups"]), ctl["groups"]


# --- FP8 latent cache ------------------------------------------------------------------------------------

NUM_KV_HEADS, HEAD_DIM = TRINITY_MINI["num_key_value_heads"], TRINITY_MINI["head_dim"]
KV_LORA_RANK = TRINITY_MINI_MLA["kv_lora_rank"]
WINDOW, MAX_NUM_BATCHED_TOKENS = TRINITY_MINI["sliding_window"], 2048  # the child's engine args


def latent_name(i: int) -> str:
    return f"model.layers.{i}.self_attn"


def geometry(latent_bytes: int, sliding_bytes: int, tp: int = 1) -> dict:
    """What one 32k request costs by the geometry alone (bytes per value: `latent_bytes`, `sliding_bytes`), and the
    scale stores beside each latent row: one fp32 key scale per KV head of the rank, + one fp32 dequantization
    scale when the latent is FP8."""
    kv_heads = max(1, NUM_KV_HEADS // tp)
    latent_row = KV_LORA_RANK * latent_bytes
    scales_row = 4 * kv_heads + (4 if latent_bytes == 1 else 0)
    return {
        "latent_row": latent_row,
        "sliding_row": NUM_KV_HEADS * 2 * HEAD_DIM * sliding_bytes,
        "scales_row": scales_row,
        "scale_ratio": scales_row / latent_row,
        # per token, the 8 latent layers with their scale stores (the ideal: stores only for the latent rows)
        "latent_layers_per_token": len(LATENT_LAYERS) * (latent_row + scales_row),
    }


def expected_request_bytes(geo: dict, sliding_block: int) -> int:
    """vLLM's reservation for one MAX_MODEL_LEN request: every latent token, and per sliding layer window - 1 +
    in-flight tokens rounded up to blocks, + 1 block (vLLM's SlidingWindowSpec rule, derived here)."""
    sliding_tokens = (-(-(WINDOW - 1 + MAX_NUM_BATCHED_TOKENS) // sliding_block) + 1) * sliding_block
    return (
        len(LATENT_LAYERS) * MAX_MODEL_LEN * geo["latent_row"]
        + len(SLIDING_LAYERS) * sliding_tokens * geo["sliding_row"]
    )


def check_fp8_grouping(res: dict, geo: dict) -> tuple[dict, int]:
    """vLLM's sliding-window groups kept (reusing the bf16 checks), page sizes unified by block size."""
    latent = check_grouping(res, "MLAAttentionSpec", [latent_name(i) for i in LATENT_LAYERS])
    assert not any(any(f in w for f in FALLBACK_WARNINGS) for w in res["reserved"]["warnings"])
    sliding_block = {g["block_size"] for g in res["groups"] if g["type"] == "SlidingWindowSpec"}
    assert len(sliding_block) == 1
    sb = sliding_block.pop()
    assert latent["block_size"] * geo["latent_row"] == sb * geo["sliding_row"] == latent["page_size_bytes"]
    assert latent["blocks_per_request"] == MAX_MODEL_LEN // latent["block_size"]
    return latent, sb


def test_fp8_latent_alone_halves_the_latent_page(results: dict) -> None:
    """`latent_cache_dtype: fp8` alone: the latent layers' spec is E4M3, block_size x 256 x 1 B (half the bf16
    page at the same block size); the sliding layers keep vLLM's bf16 sliding-window spec."""
    res, bf16 = results["mla_fp8_latent"], results["mla"]
    assert res["arch"] == "TrinityMLAForCausalLM" and len(res["layers"]) == NUM_LAYERS
    for i in LATENT_LAYERS:
        s, b = res["layers"][latent_name(i)], bf16["layers"][latent_name(i)]
        assert (s["type"], s["num_kv_heads"], s["head_size"], s["head_size_v"]) == ("MLAAttentionSpec", 1, 256, 0)
        assert s["dtype"] == FP8, (i, s)
        assert s["block_size"] == b["block_size"]
        assert s["page_size_bytes"] == s["block_size"] * 256 * 1 == b["page_size_bytes"] // 2, (i, s, b)
    check_sliding_layers(res["layers"])  # bf16, 4 x (128 + 128) x 2 B, window 2048
    for i in SLIDING_LAYERS:
        assert res["layers"][sliding_name(i)] == bf16["layers"][sliding_name(i)], i


def test_fp8_kv_cache_puts_latent_and_sliding_layers_in_fp8(results: dict) -> None:
    """`--kv-cache-dtype fp8` ("auto" latent): sliding layers' K/V in FP8 (1 B) and the latent in FP8 too."""
    res, bf16 = results["mla_fp8_kv"], results["mla"]
    for i in SLIDING_LAYERS:
        s = res["layers"][sliding_name(i)]
        assert s["type"] == "SlidingWindowSpec" and s["sliding_window"] == 2048, (i, s)
        assert s["dtype"] in (FP8, "torch.uint8"), (i, s)
        assert bytes_per_token(s) == 4 * (128 + 128), (i, s)
    for i in LATENT_LAYERS:
        s = res["layers"][latent_name(i)]
        assert (s["type"], s["head_size"], s["dtype"]) == ("MLAAttentionSpec", 256, FP8), (i, s)
        assert s["page_size_bytes"] == s["block_size"] * 256 == bf16["layers"][latent_name(i)]["page_size_bytes"] // 2


@pytest.mark.parametrize("key, latent_bytes, sliding_bytes", [("mla_fp8_latent", 1, 2), ("mla_fp8_kv", 1, 1)])
def test_vllm_groups_fp8_latent_without_full_attention_fallback(
    results: dict, key: str, latent_bytes: int, sliding_bytes: int
) -> None:
    geo = geometry(latent_bytes, sliding_bytes)
    latent, sb = check_fp8_grouping(results[key], geo)
    # 2048 / 256 = 8 (bf16 sliding) or 1024 / 256 = 4 (FP8 sliding) latent tokens per sliding token: integer ratios.
    assert latent["block_size"] == sb * geo["sliding_row"] // geo["latent_row"]
    assert latent["block_size"] == {2: 8, 1: 4}[sliding_bytes] * sb


@pytest.mark.parametrize("key, latent_bytes, sliding_bytes", [("mla_fp8_latent", 1, 2), ("mla_fp8_kv", 1, 1)])
def test_fp8_latent_raises_max_concurrency_at_32k(
    results: dict, key: str, latent_bytes: int, sliding_bytes: int
) -> None:
    """vLLM's max concurrency for 32k-token requests, FP8 vs the bf16 latent, by bytes derived from the geometry
    (not from the plugin's code): at the raw budget (vLLM's specs only) and at the budget the engine sizes its
    pool with once MLA-Trinity reserved its scale stores (budget / (1 + scale bytes per latent byte): the stores
    cover every row of the pool's shared tensors, so they are charged on the whole request, sliding blocks too)."""
    fp8, bf16 = results[key], results["mla"]
    g8, g16 = geometry(latent_bytes, sliding_bytes), geometry(2, 2)
    _, sb8 = check_fp8_grouping(fp8, g8)
    sb16 = next(g["block_size"] for g in bf16["groups"] if g["type"] == "SlidingWindowSpec")
    req8, req16 = expected_request_bytes(g8, sb8), expected_request_bytes(g16, sb16)
    tol = 1e-4  # vLLM's whole blocks: one 8-layer block row of the 16 GiB budget is < 1e-4 of it
    # Raw budget: vLLM's own figures against budget / bytes per request.
    assert fp8["max_concurrency"] == pytest.approx(BUDGET / req8, rel=tol)
    assert bf16["max_concurrency"] == pytest.approx(BUDGET / req16, rel=tol)
    # The engine's budget: reduced by exactly the geometry's scale ratio.
    for res, geo, req in ((fp8, g8, req8), (bf16, g16, req16)):
        assert res["reserved_budget"] == pytest.approx(BUDGET / (1 + geo["scale_ratio"]), abs=1)
        assert res["reserved"]["max_concurrency"] == pytest.approx(res["reserved_budget"] / req, rel=tol)
    want = (req16 * (1 + g16["scale_ratio"])) / (req8 * (1 + g8["scale_ratio"]))
    got = fp8["reserved"]["max_concurrency"] / bf16["reserved"]["max_concurrency"]
    assert got == pytest.approx(want, rel=2 * tol)
    # A rise well beyond rounding. Modest with bf16 sliding layers: vLLM's sliding reservation (3 groups x 33 blocks
    # per request at max_num_batched_tokens 2048) outweighs the latent (~1.19x); ~1.9x with both in FP8.
    assert got > (1.15 if sliding_bytes == 2 else 1.85), got
    # The latent layers' per-token bytes with their scales: 8 x (256 + 4 + 4 x 4) B vs 8 x (512 + 4 x 4) B.
    assert (g8["latent_layers_per_token"], g16["latent_layers_per_token"]) == (8 * 276, 8 * 528)


def test_scale_bytes_per_latent_byte() -> None:
    """The side stores per byte of latent: FP8 (4 x 4 + 4) / 256 at TP 1, (2 x 4 + 4) / 256 at TP 2 (two KV heads
    per rank); bf16 4 x 4 / 512 (no dequantization scale)."""
    from transformers import AfmoeConfig

    from vllm_trn_plugin.model_executors.latent_cache import key_scale_bytes_per_latent_byte

    cfg = AfmoeConfig(**TRINITY_MINI, kv_lora_rank=KV_LORA_RANK)
    fp8 = torch.float8_e4m3fn
    assert key_scale_bytes_per_latent_byte(cfg, fp8, 1) == pytest.approx((4 * 4 + 4) / (256 * 1))
    assert key_scale_bytes_per_latent_byte(cfg, fp8, 2) == pytest.approx((2 * 4 + 4) / 256)
    assert key_scale_bytes_per_latent_byte(cfg, torch.bfloat16, 1) == pytest.approx(4 * 4 / (256 * 2))
    for tp in (1, 2, 4):
        assert key_scale_bytes_per_latent_byte(cfg, fp8, tp) == pytest.approx(geometry(1, 1, tp)["scale_ratio"])


def stub_config(latent: object, kv_cache_dtype: str = "auto") -> SimpleNamespace:
    extra = {} if latent is None else {"latent_cache_dtype": latent}
    return SimpleNamespace(
        additional_config=extra,
        cache_config=SimpleNamespace(cache_dtype=kv_cache_dtype),
        model_config=SimpleNamespace(dtype=torch.bfloat16),
    )


def test_latent_cache_dtype_choices() -> None:
    from vllm_trn_plugin.model_executors.latent_cache import latent_cache_dtype

    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    cases = {
        (None, "auto"): bf16,
        ("auto", "auto"): bf16,
        (None, "fp8"): fp8,
        ("auto", "fp8_e4m3"): fp8,
        ("fp8", "auto"): fp8,
        ("model", "fp8"): bf16,
    }
    for (latent, kv), want in cases.items():
        assert latent_cache_dtype(stub_config(latent, kv)) == want, (latent, kv)
    for bad in ("fp16", "FP8", "bfloat16", 8):
        with pytest.raises(ValueError, match="latent_cache_dtype"):
            latent_cache_dtype(stub_config(bad))
