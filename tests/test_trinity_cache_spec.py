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
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_trn_plugin.demo import TRINITY_MINI as TRINITY_MINI_MLA

NUM_LAYERS = TRINITY_MINI_MLA["num_hidden_layers"]
LATENT_LAYERS = [i for i in range(NUM_LAYERS) if i % 4 == 3]  # 3, 7, ..., 31
SLIDING_LAYERS = [i for i in range(NUM_LAYERS) if i % 4 != 3]
MAX_MODEL_LEN = 32768
FALLBACK_WARNINGS = ("treating sliding-window layers as full attention", "Hybrid KV cache manager is disabled")

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
    from vllm_trn_plugin.bench.kv_specs import layer_specs

    MAX_MODEL_LEN, KV_DTYPE, BUDGET = int(sys.argv[1]), sys.argv[2], 16 << 30
    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))

    CAPTURE = Capture()

    def config(ckpt):
        return EngineArgs(
            model=ckpt, dtype="bfloat16", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=2048,
            enforce_eager=True, skip_tokenizer_init=True, kv_cache_dtype=KV_DTYPE,
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

    def group(vc, specs, backends):
        # vllm/v1/engine/core.py EngineCore._initialize_kv_caches, one worker, BUDGET bytes.
        # vLLM re-applies its logging dictConfig (dropping foreign handlers) whenever it builds a config.
        logging.getLogger("vllm").addHandler(CAPTURE)
        first = len(records)
        register_all_kvcache_specs(vc)
        layouts = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
        layout = resolve_kv_cache_layout(vc, [layouts], specs.values())
        configs = kcu.get_kv_cache_configs(vc, [dict(specs)], [BUDGET])
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
    with set_current_vllm_config(config(sys.argv[3])):
        init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
    results = {}
    for ckpt in sys.argv[3:]:
        vc = config(ckpt)
        cls, _ = get_model_architecture(vc.model_config)
        with set_current_vllm_config(vc), torch.device("meta"):
            cls(vllm_config=vc)
        specs, backends = layer_specs(vc)
        results[ckpt] = {
            "arch": cls.__name__,
            "layers": {name: describe(s) for name, s in specs.items()},
            **group(vc, specs, backends),
        }
        if any(isinstance(s, MLAAttentionSpec) for s in specs.values()):
            # Control: a latent page that does not divide the sliding page (288 values) must make vLLM fall back.
            bad = {n: (MLAAttentionSpec(block_size=s.block_size, num_kv_heads=1, head_size=288, dtype=s.dtype)
                       if isinstance(s, MLAAttentionSpec) else s) for n, s in specs.items()}
            vc = config(ckpt)
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


def run_child(kv_cache_dtype: str, *ckpts: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(MAX_MODEL_LEN), kv_cache_dtype, *ckpts],
        capture_output=True,
        text=True,
        timeout=900,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS")]
    assert line, f"child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(line[0].removeprefix("RESULTS"))


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("trinity-mini-configs")
    mla = write_config(root / "mla-trinity", "TrinityMLAForCausalLM", kv_lora_rank=TRINITY_MINI_MLA["kv_lora_rank"])
    return mla, write_config(root / "afmoe", "AfmoeForCausalLM")


@pytest.fixture(scope="module")
def results(configs: tuple[str, str]) -> dict:
    mla, afmoe = configs
    out = run_child("auto", mla, afmoe)
    return {"mla": out[mla], "afmoe": out[afmoe], "control": out["control"]}


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


def test_fp8_kv_cache_applies_to_sliding_layers_only(configs: tuple[str, str]) -> None:
    """`--kv-cache-dtype fp8`: sliding layers' K/V in FP8 (1 B), the latent stays in the model dtype, and
    vLLM still groups the sliding layers as sliding windows (the page ratio is now 2, still an integer)."""
    res = run_child("fp8", configs[0])[configs[0]]
    for i in SLIDING_LAYERS:
        s = res["layers"][sliding_name(i)]
        assert s["type"] == "SlidingWindowSpec" and s["sliding_window"] == 2048, (i, s)
        assert s["dtype"] in ("torch.float8_e4m3fn", "torch.uint8"), (i, s)
        assert bytes_per_token(s) == 4 * (128 + 128), (i, s)
    for i in LATENT_LAYERS:
        s = res["layers"][f"model.layers.{i}.self_attn"]
        assert (s["type"], s["head_size"], s["dtype"]) == ("MLAAttentionSpec", 256, "torch.bfloat16"), (i, s)
    latent = check_grouping(res, "MLAAttentionSpec", [f"model.layers.{i}.self_attn" for i in LATENT_LAYERS])
    sliding_block = {g["block_size"] for g in res["groups"] if g["type"] == "SlidingWindowSpec"}
    assert latent["block_size"] == 2 * sliding_block.pop()
