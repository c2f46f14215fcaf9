"""Both models driven through the vllm-neuron "Beta" model contract, the way its runner drives a model,
against real vLLM serving the same checkpoint: the same greedy tokens, token for token.

`BetaRunner` (tests/fakes/beta_runner.py) plays vllm-neuron's `NeuronModelRunner` with its `NeuronScheduler`:
bucketed, padded prefills and decodes, block tables trimmed to the window or a context bucket, greedy sampling at
`sampling_positions`. Requests arrive while others decode and leave when done, so the batch bucket changes under them.

Reference: real vLLM (CPU build) on the same checkpoint, greedy, all prompts at once: for Laplace the session's
float32 engine, for MLA-Trinity one eager engine on a float32 MLA checkpoint converted exactly from a random
transformers AFMoE. At one padded decode step per model the kernels run in the NKI emulator
(VLLM_TRN_KERNELS=emulate) from the same cache state as the torch path: same tokens, logits close, kernel calls
counted; for MLA-Trinity on the packed form of that checkpoint (FP8 experts), so the FP8 expert kernel runs too.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fakes.beta_runner import STEPS, BetaRunner, Request, opaque_ops, runner_config
from tests.helpers import count_calls, greedy_params, random_prompts, token_prompts, trn2_recipe_argv
from vllm_trn_plugin.kernels.dispatch import KERNEL_OPS
from vllm_trn_plugin.neuron.contract import PAD_SLOT_ID

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def worker() -> None:
    """What the Beta worker sets up before load_model: a single-process (gloo) TP/PP/EP group. Under a config
    without a model, so vLLM also creates the expert-parallel group MLA-Trinity's MoE layers ask for."""
    import torch.distributed as dist
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized() and ps._EP is None:  # left by an in-process engine for a dense model
        ps.destroy_model_parallel()
    own_groups = not ps.model_parallel_is_initialized()
    own_world = not dist.is_initialized()
    if own_groups:
        with set_current_vllm_config(VllmConfig()), tempfile.NamedTemporaryFile() as f:
            ps.init_distributed_environment(1, 0, f"file://{f.name}", 0, backend="gloo")
            ps.initialize_model_parallel(1, 1)
    yield
    if own_groups:
        ps.destroy_model_parallel()
    if own_world:
        ps.destroy_distributed_environment()


@torch.inference_mode()  # the side stores the model allocates in its (inference-mode) forward
def restore(runner: BetaRunner, saved: list[torch.Tensor]) -> None:
    for t, s in zip(runner.state_tensors(), saved):
        t.copy_(s)


def _emulate_check(monkeypatch: pytest.MonkeyPatch, counters: dict[str, tuple[Any, str]], report: dict) -> Any:
    """At one padded decode step: run it with the kernels in the emulator, restore every cache, run it on
    the torch path (the run that continues); both runs must pick the same tokens."""

    def check(runner: BetaRunner, kwargs: dict[str, Any], n: int) -> None:
        saved = [t.clone() for t in runner.state_tensors()]
        calls = {k: count_calls(monkeypatch, mod, fn) for k, (mod, fn) in counters.items()}
        monkeypatch.setenv("VLLM_TRN_KERNELS", "emulate")
        t0 = time.perf_counter()
        emulated = runner.step(kwargs)
        report["emulate_seconds"] = time.perf_counter() - t0
        restore(runner, saved)
        monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
        torch_path = runner.step(kwargs)
        restore(runner, saved)  # the step proper runs next, from the same state
        monkeypatch.undo()
        monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
        if isinstance(emulated, tuple):
            assert emulated[0][:n].tolist() == torch_path[0][:n].tolist(), "on-device greedy tokens differ"
            emulated, torch_path = emulated[1], torch_path[1]
        assert emulated is not None and torch_path is not None
        assert emulated[:n].argmax(-1).tolist() == torch_path[:n].argmax(-1).tolist(), "greedy tokens differ"
        report["emulate_max_logit_diff"] = float((emulated[:n] - torch_path[:n]).abs().max())
        report["kernel_calls"] = {k: c[0] for k, c in calls.items()}
        report["emulate_rows"] = (n, kwargs["input_ids"].shape[0])

    return check


def check_compiled(runner: BetaRunner) -> None:
    """What the Beta runner's compile needs, seen on the runner's graphs: one static graph per warmed bucket and
    none since (every serving step ran under fail_on_recompile), every bucket the steps used among them, and
    nothing in the graphs the compiler cannot see into but the declared kernel ops."""
    assert len(runner.graphs) == len(runner.warmup_seconds), (len(runner.graphs), sorted(runner.warmup_seconds))
    warmed = {key[:2] for key in runner.warmup_seconds}
    assert {s for s in runner.padded_shapes if s[0] != "decode-ctx"} <= warmed, runner.padded_shapes
    assert opaque_ops(runner.graphs, KERNEL_OPS) == {}


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_laplace_through_beta_contract_equals_vllm(
    laplace_ckpt: Path, laplace_llm: Any, worker: None, monkeypatch: pytest.MonkeyPatch, compile_backend: str | None
) -> None:
    """Laplace driven as the Beta runner drives it, eagerly and compiled (one graph per bucket, warmed up, then
    no recompile): the same tokens as vLLM's engine; at one padded decode step the GLA kernel in the emulator."""
    from vllm_trn_plugin.kernels import simple_gla_nki
    from vllm_trn_plugin.neuron.laplace import LaplaceBetaModel

    monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
    prompts = random_prompts(4, [1, 37, 130, 600], seed=41)  # 600 > one 512-token segment
    served = laplace_llm.llm.generate(token_prompts(prompts), greedy_params(STEPS), use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in served]

    nc = {"num_seqs_buckets": [1, 2, 4], "num_batched_tokens_buckets": [128, 256, 512]}
    nc |= {"on_device_sampling_config": {}, "max_logprobs": 1}  # greedy on-device sampling, logits gathered
    runner = BetaRunner(
        LaplaceBetaModel,
        laplace_ckpt,
        runner_config(laplace_ckpt, 1024),
        nc,
        block_size=32,
        num_blocks=8,
        max_num_batched_tokens=512,
        compile_backend=compile_backend,
    )
    report: dict[str, Any] = {}
    runner.emulate_check = _emulate_check(monkeypatch, {"gla": (simple_gla_nki, "gla_decode_nki")}, report)
    t0 = time.perf_counter()
    got = runner.generate([Request(p, a) for p, a in zip(prompts, [0, 1, 2, 4])])
    seconds = time.perf_counter() - t0

    for p, g, e in zip(prompts, got, expected):
        assert g == e, f"prompt of {len(p)} tokens: Beta contract {g}, vLLM {e}"
    assert report["kernel_calls"]["gla"] == 4, report  # one emulated GLA step per layer
    assert report["emulate_max_logit_diff"] < 1e-4, report
    assert {("prefill", 128), ("prefill", 512), ("decode", 4), ("decode", 2), ("decode", 1)} <= runner.padded_shapes
    assert runner.stale_padded_rows > 0  # a padded row whose block-table row still names a live block
    if compile_backend is not None:
        check_compiled(runner)
    print(
        f"\nLaplace via the Beta contract ({compile_backend or 'eager'}): {len(prompts)} prompts x {STEPS} tokens "
        f"equal vLLM's; shapes {sorted(runner.padded_shapes)}; {runner.stale_padded_rows} padded rows with stale "
        f"block tables; {runner.decode_steps} decode steps in {seconds:.1f} s (load {runner.load_seconds:.1f} s, "
        f"{len(runner.graphs)} graphs warmed in {sum(runner.warmup_seconds.values()):.1f} s); emulated decode step "
        f"{report['emulate_rows']}: {report['kernel_calls']} kernel calls, logits within "
        f"{report['emulate_max_logit_diff']:.1e}, {report['emulate_seconds']:.1f} s"
    )


@pytest.fixture(scope="module")
def trinity_ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random transformers AFMoE with Trinity's head geometry, converted exactly to MLA (latent 256), and its
    packed MXFP4 form (FP8 experts, I = 256: the expert kernel's double-row tiling needs multiples of 256)."""
    from tests.references.afmoe import convert_to_mla, make_random_afmoe
    from vllm_trn_plugin.loaders.packed import pack

    root = tmp_path_factory.mktemp("trinity-beta")
    orig = make_random_afmoe(root / "orig", seed=7, full_kv_rank=256, moe_intermediate_size=256)
    mla = convert_to_mla(orig, root / "mla", kv_lora_rank=256)
    return mla, pack(mla, root / "packed").dst


TRINITY_NC = {
    "num_seqs_buckets": [1, 2, 4],
    "num_batched_tokens_buckets": [64, 128],
    "decode_context_length_buckets": [256],
}
TRINITY_MAX_TOKENS = 128  # a step's token budget: the 252-token prompt is prefilled in two segments

# 252 > the sliding window (64); its decode crosses from the 256 context bucket to max_model_len's (512)
TRINITY_PROMPTS = random_prompts(3, [7, 40, 252], seed=43)
TRINITY_ARRIVALS = [0, 0, 2]


FP8_LATENT = {"latent_cache_dtype": "fp8"}


def trinity_runner(
    ckpt: Path, compile_backend: str | None, tp: int = 1, rank: int = 0, **engine_args: Any
) -> BetaRunner:
    """The Beta runner on an MLA-Trinity checkpoint with TRINITY_NC's buckets (max_model_len 512, 32 blocks of 32)."""
    from vllm_trn_plugin.neuron.trinity_mla import TrinityMLABetaModel

    return BetaRunner(
        TrinityMLABetaModel,
        ckpt,
        runner_config(ckpt, 512, tp=tp, **engine_args),
        TRINITY_NC,
        block_size=32,
        num_blocks=32,
        max_num_batched_tokens=TRINITY_MAX_TOKENS,
        rank=rank,
        compile_backend=compile_backend,
    )


def vllm_tokens(mla: Path, additional_config: dict[str, Any] | None = None) -> list[list[int]]:
    """vLLM's greedy tokens for TRINITY_PROMPTS on the float32 MLA checkpoint (one eager engine, TP 1)."""
    from vllm import LLM

    llm = LLM(
        model=str(mla),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        seed=0,
        enforce_eager=True,
        kv_cache_memory_bytes=128 << 20,
        additional_config=additional_config or {},
    )
    try:
        served = llm.generate(token_prompts(TRINITY_PROMPTS), greedy_params(STEPS), use_tqdm=False)
    finally:
        del llm
    return [list(o.outputs[0].token_ids) for o in served]


@pytest.fixture(scope="module")
def trinity_expected(trinity_ckpts: tuple[Path, Path]) -> list[list[int]]:
    return vllm_tokens(trinity_ckpts[0])


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_trinity_through_beta_contract_equals_vllm(
    trinity_ckpts: tuple[Path, Path],
    trinity_expected: list[list[int]],
    worker: None,
    monkeypatch: pytest.MonkeyPatch,
    compile_backend: str | None,
) -> None:
    """The float32 MLA checkpoint, eagerly and compiled (one graph per bucket, warmed up, then no recompile):
    vLLM and the adapter differ only in summation order, so every token must agree. (On the packed checkpoint a
    long prompt can legitimately differ: FP8 activation rounding turns a 1e-7 difference into a ~0.1 logit jump,
    see tests/test_packed_vllm.py, and a near-tie then flips.)"""

    mla, _ = trinity_ckpts
    monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
    prompts, expected = TRINITY_PROMPTS, trinity_expected

    runner = trinity_runner(mla, compile_backend)
    t0 = time.perf_counter()
    got = runner.generate([Request(p, a) for p, a in zip(prompts, TRINITY_ARRIVALS)])
    seconds = time.perf_counter() - t0

    for p, g, e in zip(prompts, got, expected):
        assert g == e, f"prompt of {len(p)} tokens: Beta contract {g}, vLLM {e}"
    assert {
        ("prefill", 64),
        ("prefill", 128),
        ("decode", 4),
        ("decode", 2),
        ("decode-ctx", 256),
        ("decode-ctx", 512),
    } <= runner.padded_shapes
    if compile_backend is not None:
        check_compiled(runner)
    print(
        f"\nMLA-Trinity via the Beta contract ({compile_backend or 'eager'}): {len(prompts)} prompts x {STEPS} tokens "
        f"equal vLLM's; shapes {sorted(runner.padded_shapes)}; {runner.decode_steps} decode steps in {seconds:.1f} s "
        f"(load {runner.load_seconds:.1f} s, {len(runner.graphs)} graphs warmed in "
        f"{sum(runner.warmup_seconds.values()):.1f} s: "
        f"{ {k: round(v, 1) for k, v in runner.warmup_seconds.items()} })"
    )


def test_trinity_fp8_latent_through_beta_contract_equals_vllm(
    trinity_ckpts: tuple[Path, Path], worker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`latent_cache_dtype: fp8` under the Beta contract, compiled: the runner allocates the latent caches in FP8
    from the adapter's spec, the step writes codes and per-token scales by slot, prefill (segmented, over the whole
    table) and decode (the kernel op with the scales, crossing context buckets) read them, and every token equals
    vLLM's own FP8-latent engine on the same checkpoint (the same rounding of the same latents)."""
    from vllm_trn_plugin.kernels.fp8_expert import FP8_DTYPE

    mla, _ = trinity_ckpts
    monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
    expected = vllm_tokens(mla, FP8_LATENT)
    runner = trinity_runner(mla, "aot_eager", additional_config=FP8_LATENT)
    latent = runner.latent_layers()
    assert latent and all(a.kv_cache.dtype == FP8_DTYPE and a.latent_scales is not None for a in latent)
    got = runner.generate([Request(p, a) for p, a in zip(TRINITY_PROMPTS, TRINITY_ARRIVALS)])
    for p, g, e in zip(TRINITY_PROMPTS, got, expected):
        assert g == e, f"prompt of {len(p)} tokens: Beta contract (FP8 latent) {g}, vLLM (FP8 latent) {e}"
    assert {("decode-ctx", 256), ("decode-ctx", 512), ("prefill", 128)} <= runner.padded_shapes
    written = sum(int(torch.isfinite(a.latent_scales).sum()) for a in latent)
    assert written >= len(latent) * sum(len(p) + STEPS - 1 for p in TRINITY_PROMPTS)
    check_compiled(runner)


def test_beta_adapter_refuses_fp8_sliding_layers(trinity_ckpts: tuple[Path, Path], worker: None) -> None:
    """--kv-cache-dtype fp8 asks for FP8 sliding layers too, which the adapter's step does not have: refused at
    construction, naming the option and what does work, instead of serving them in the model dtype."""
    from vllm.config import set_current_vllm_config

    from vllm_trn_plugin.neuron.trinity_mla import TrinityMLABetaModel

    mla, _ = trinity_ckpts
    cfg = runner_config(mla, 512, kv_cache_dtype="fp8")
    refused = pytest.raises(NotImplementedError, match="--kv-cache-dtype fp8.*latent_cache_dtype")
    with set_current_vllm_config(cfg), refused:
        TrinityMLABetaModel.from_configs(cfg.model_config.hf_config, {})


def test_trinity_kernels_in_emulator_through_beta_contract(
    trinity_ckpts: tuple[Path, Path], worker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packed checkpoint (FP8 experts), compiled, padded with the 0.21 convention (slot -1) this time: at the
    first padded decode step the compiled graph's latent-decode and FP8-expert ops run the kernels in the emulator."""
    from vllm_trn_plugin.kernels import fp8_expert_nki, latent_decode_nki
    from vllm_trn_plugin.neuron.trinity_mla import TrinityMLABetaModel

    _, packed = trinity_ckpts
    monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
    runner = BetaRunner(
        TrinityMLABetaModel,
        packed,
        runner_config(packed, 512),
        {"num_seqs_buckets": [4], "num_batched_tokens_buckets": [128], "decode_context_length_buckets": [256]},
        block_size=32,
        num_blocks=32,
        max_num_batched_tokens=128,
        pad_slot=PAD_SLOT_ID,
        compile_backend="aot_eager",
    )
    report: dict[str, Any] = {}
    counters = {"latent": (latent_decode_nki, "latent_decode_nki"), "fp8_experts": (fp8_expert_nki, "fp8_experts_nki")}
    runner.emulate_check = _emulate_check(monkeypatch, counters, report)
    runner.generate([Request(p, 0) for p in random_prompts(3, [7, 9, 70], seed=44)], max_decode_steps=1)

    assert report["emulate_rows"] == (3, 4), report
    assert report["kernel_calls"] == {"latent": 1, "fp8_experts": 3}, report  # 1 global layer, 3 MoE layers
    # FP8 activations: the kernel's fp32 accumulation order can flip one rounding (tests/test_kernels_vllm.py)
    assert report["emulate_max_logit_diff"] < 0.5, report
    check_compiled(runner)
    print(
        f"\nMLA-Trinity (packed) via the Beta contract, emulated decode step {report['emulate_rows']}: "
        f"{report['kernel_calls']} kernel calls, greedy tokens equal, logits within "
        f"{report['emulate_max_logit_diff']:.1e}, {report['emulate_seconds']:.1f} s"
    )


# torch's functional collectives: vLLM's TP-group all-reduce and the LM head's gather, traced
COLLECTIVES = {
    "_c10d_functional::all_reduce",
    "_c10d_functional::all_gather_into_tensor",
    "_c10d_functional::wait_tensor",
}


def _trinity_tp_rank(rank: int, world: int, mla: str, init_file: str, out_dir: str) -> None:
    """One Beta worker of a tensor-parallel group (a spawned process per rank): the worker's gloo world and vLLM's
    TP group of `world` ranks, then the same runner as at TP 1; the adapter builds and loads this rank's shard."""
    import os

    import torch.distributed as dist
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    os.environ["VLLM_TRN_KERNELS"] = "torch"
    torch.set_num_threads(1)
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world, rank, f"file://{init_file}", rank, backend="gloo")
        ps.initialize_model_parallel(world, 1)
    ckpt = Path(mla)
    runner = trinity_runner(ckpt, "aot_eager", tp=world, rank=rank)
    got = runner.generate([Request(p, a) for p, a in zip(TRINITY_PROMPTS, TRINITY_ARRIVALS)])
    spec = runner.model.get_kv_spec()
    latent = runner.model._latent[0]
    torch.save(
        {
            "tokens": got,
            "sliding_kv_heads": sorted({layer.num_kv_heads for layer in spec.layers}),
            "latent_rank": sorted({layer.kv_lora_rank for layer in spec.latent_layers}),
            "kv_heads": list(latent.kv_heads),
            "key_scales": tuple(latent.key_scales.shape[1:]),
            "shapes": sorted(runner.padded_shapes),
            "graphs": len(runner.graphs),
            "warmed": len(runner.warmup_seconds),
            "opaque": opaque_ops(runner.graphs, KERNEL_OPS),
        },
        Path(out_dir) / f"rank{rank}.pt",
    )
    dist.barrier()
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def test_trinity_beta_contract_at_tp2_equals_tp1(
    trinity_ckpts: tuple[Path, Path], trinity_expected: list[list[int]], tmp_path: Path
) -> None:
    """Two Beta workers (spawned processes, gloo), each building through the adapter the shard of its rank of a
    TP-2 group the worker set up: sliding layers with 2 of the 4 KV heads, the whole 256-wide latent, the latent
    layer's KV heads and key-scale columns split between the ranks; each rank compiled as the runner compiles
    (one graph per bucket, no recompile), the only nodes besides aten and the kernel ops torch's traceable
    collectives, which vLLM's TP group traces to (what a device compiler lowers to its collective engine); both
    ranks' greedy tokens equal TP 1's (vLLM's engine on the same float32 checkpoint)."""
    import torch.multiprocessing as mp

    mla, _ = trinity_ckpts
    mp.start_processes(
        _trinity_tp_rank,
        args=(2, str(mla), str(tmp_path / "dist-init"), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["sliding_kv_heads"] == [2] and got["latent_rank"] == [256], got
        assert got["kv_heads"] == [2 * r, 2 * r + 1] and got["key_scales"] == (2,), got
        assert got["graphs"] == got["warmed"], got
        assert "_c10d_functional::all_reduce" in got["opaque"] and set(got["opaque"]) <= COLLECTIVES, got["opaque"]
        for p, g, e in zip(TRINITY_PROMPTS, got["tokens"], trinity_expected):
            assert g == e, f"rank {r}, prompt of {len(p)} tokens: Beta contract at TP 2 {g}, vLLM at TP 1 {e}"
    print(
        f"\nMLA-Trinity via the Beta contract at TP 2 (two gloo ranks, compiled, {ranks[0]['graphs']} graphs per "
        f"rank): tokens equal TP 1's; {ranks[0]['shapes']}; collectives {ranks[0]['opaque']}"
    )


def _recipe(model: str) -> tuple[dict[str, Any], int, str, dict[str, Any]]:
    """The trn2 recipe's neuron_config, max_model_len, dtype and cache options (--kv-cache-dtype, the rest of
    --additional-config) for `model` (deploy/trn2/serve-replica.sh)."""
    argv = trn2_recipe_argv(model)

    def opt(name: str) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else None

    extra = json.loads(opt("--additional-config") or "{}")
    nc = extra.pop("neuron_config")
    cache = {"additional_config": extra} | (
        {"kv_cache_dtype": opt("--kv-cache-dtype")} if opt("--kv-cache-dtype") else {}
    )
    return nc, int(opt("--max-model-len")), opt("--dtype"), cache


@pytest.mark.parametrize("model", ["laplace-3b", "mla-trinity"])
def test_recipe_buckets_are_captured_whole(model: str, worker: None, tmp_path: Path) -> None:
    """Every bucket the trn2 recipe has the runner compile (its neuron_config, max_model_len and dtype: prefill token
    buckets up to 2048, decode widths, MLA-Trinity's context buckets 2304 / 4352 / 8448 and max_model_len 16,640) is
    captured by torch.compile(fullgraph=True) as one graph holding nothing opaque but the kernel ops, under the
    recipe's cache options (MLA-Trinity: the FP8 latent; an option the adapter refuses fails here). Traced only
    (a 2048-token prefill over a 16,640-token table does not run on these machines), on the demo geometry (4
    layers), at TP 1 (the compiled TP-2 run is test_trinity_beta_contract_at_tp2_equals_tp1's)."""
    from vllm_trn_plugin.demo import write_laplace_demo, write_trinity_demo
    from vllm_trn_plugin.neuron.laplace import LaplaceBetaModel
    from vllm_trn_plugin.neuron.trinity_mla import TrinityMLABetaModel

    nc, max_len, dtype, cache = _recipe(model)
    if model == "laplace-3b":
        cls, ckpt = LaplaceBetaModel, write_laplace_demo(tmp_path / "ckpt", dtype=torch.float32)
    else:
        cls = TrinityMLABetaModel
        ckpt = write_trinity_demo(tmp_path / "ckpt", dtype=torch.float32, max_position_embeddings=max_len)
    runner = BetaRunner(
        cls,
        ckpt,
        runner_config(ckpt, max_len, dtype=dtype, **cache),
        nc,
        block_size=32,
        num_blocks=8,
        max_num_batched_tokens=max(nc["num_batched_tokens_buckets"]),
        compile_backend="capture",
    )
    contexts = len(nc.get("decode_context_length_buckets", [])) + 1  # + max_model_len
    buckets = len(nc["num_batched_tokens_buckets"]) + len(nc["num_seqs_buckets"]) * contexts
    assert len(runner.graphs) == len(runner.warmup_seconds) == buckets, sorted(runner.warmup_seconds)
    assert opaque_ops(runner.graphs, KERNEL_OPS) == {}
    print(
        f"\n{model}: the recipe's {buckets} buckets captured whole ({dtype}, max_model_len {max_len}, {cache}) in "
        f"{sum(runner.warmup_seconds.values()):.0f} s: {sorted(runner.warmup_seconds)}"
    )
