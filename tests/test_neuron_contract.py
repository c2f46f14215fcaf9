"""Both models driven through vLLM Neuron's model contract, the way its runner drives a model, against real vLLM
serving the same checkpoint: the same greedy tokens, token for token.

`NeuronRunner` (tests/fakes/neuron_runner.py) plays vllm-neuron's `NeuronModelRunner` with its `NeuronScheduler`:
bucketed, padded prefills (segmented when max_num_batched_tokens < max_model_len) and decodes, block tables trimmed
to the window or a context bucket, sampling at `sampling_positions` (on device, or on the host). Requests arrive while
others decode and leave when done, so the batch bucket changes under them.

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

from tests.fakes.neuron_runner import (
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    STEPS,
    NeuronRunner,
    Request,
    kernel_nodes,
    opaque_ops,
    parameter_conversions,
    runner_config,
)
from tests.helpers import count_calls, greedy_params, random_prompts, token_prompts, trn2_recipe_argv
from vllm_trn_plugin.kernels.fp8 import FP8_DTYPE
from vllm_trn_plugin.models import MODELS

pytestmark = [pytest.mark.vllm, pytest.mark.neuron]  # run on vLLM 0.29 (Makefile: test-vllm029)

KERNEL_OPS = tuple({op for m in MODELS.values() for op in m.kernel_ops})


@pytest.fixture(scope="module")
def worker() -> None:
    """What the Neuron worker sets up before load_model: a single-process (gloo) TP/PP/EP group. Under a config
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
def restore(runner: NeuronRunner, saved: list[torch.Tensor]) -> None:
    for t, s in zip(runner.state_tensors(), saved):
        t.copy_(s)


def _emulate_check(monkeypatch: pytest.MonkeyPatch, counters: dict[str, tuple[Any, str]], report: dict) -> Any:
    """At one padded decode step: run it with the kernels in the emulator, restore every cache, run it on
    the torch path (the run that continues); both runs must pick the same tokens."""

    def check(runner: NeuronRunner, kwargs: dict[str, Any], n: int) -> None:
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


def check_compiled(runner: NeuronRunner) -> None:
    """What the Neuron runner's compile needs, seen on the runner's graphs: one static graph per warmed bucket and
    none since (every serving step ran under fail_on_recompile), every bucket the steps used among them, and
    nothing in the graphs the compiler cannot see into but the declared kernel ops."""
    assert len(runner.graphs) == len(runner.warmup_seconds), (len(runner.graphs), sorted(runner.warmup_seconds))
    warmed = {key[:2] for key in runner.warmup_seconds}
    assert {s for s in runner.padded_shapes if s[0] != "decode-ctx"} <= warmed, runner.padded_shapes
    assert opaque_ops(runner.graphs, KERNEL_OPS) == {}


@pytest.mark.parametrize(
    "compile_backend,pad_slot,prompt_embeds",
    [(None, NULL_BLOCK_ID, True), ("aot_eager", PAD_SLOT_ID, False)],
    ids=["eager-0.24-padding-prompt-embeds", "compiled"],
)
def test_laplace_through_neuron_contract_equals_vllm(
    laplace_ckpt: Path,
    laplace_llm: Any,
    worker: None,
    monkeypatch: pytest.MonkeyPatch,
    compile_backend: str | None,
    pad_slot: int,
    prompt_embeds: bool,
) -> None:
    """Laplace driven as vLLM Neuron's runner drives it, eagerly (padding at the 0.24 runner's slot 0, the prompts
    given as embeddings) and compiled (padding at slot -1; one graph per bucket, warmed up, then no recompile): the
    same tokens as vLLM's engine; at one padded decode step the GLA kernel in the emulator. A prompt longer than the
    512-token budget is prefilled in 512-token segments (max_model_len 1024: segmented prefill)."""
    from vllm_trn_plugin.kernels import simple_gla_nki
    from vllm_trn_plugin.neuron.laplace import LaplaceNeuronModel

    monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
    prompts = random_prompts(4, [1, 37, 130, 600], seed=41)  # 600 > one 512-token segment
    served = laplace_llm.llm.generate(token_prompts(prompts), greedy_params(STEPS), use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in served]

    nc = {"num_seqs_buckets": [1, 2, 4], "on_device_sampling_config": {}, "max_logprobs": 1}  # sampled on device
    runner = NeuronRunner(
        LaplaceNeuronModel,
        laplace_ckpt,
        runner_config(laplace_ckpt, 1024, max_num_batched_tokens=512),
        nc,
        block_size=32,
        num_blocks=8,
        pad_slot=pad_slot,
        compile_backend=compile_backend,
        prompt_embeds=prompt_embeds,
    )
    report: dict[str, Any] = {}
    runner.emulate_check = _emulate_check(monkeypatch, {"gla": (simple_gla_nki, "gla_decode_nki")}, report)
    t0 = time.perf_counter()
    got = runner.generate([Request(p, a) for p, a in zip(prompts, [0, 1, 2, 4])])
    seconds = time.perf_counter() - t0

    for p, g, e in zip(prompts, got, expected):
        assert g == e, f"prompt of {len(p)} tokens: Neuron contract {g}, vLLM {e}"
    assert report["kernel_calls"]["gla"] == 4, report  # one emulated GLA step per layer
    assert report["emulate_max_logit_diff"] < 1e-4, report
    assert {("prefill", 512), ("decode", 4), ("decode", 2), ("decode", 1)} <= runner.padded_shapes
    assert runner.stale_padded_rows > 0  # a padded row whose block-table row still names a live block
    if compile_backend is not None:
        check_compiled(runner)
    print(
        f"\nLaplace via the Neuron contract ({compile_backend or 'eager'}): {len(prompts)} prompts x {STEPS} tokens "
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


# Sampled on the host (on-device sampling set to null: Laplace's test samples on device); segmented prefill
# (max_num_batched_tokens 512 < max_model_len 1024), so the token buckets are the segment, [512].
TRINITY_NC = {
    "num_seqs_buckets": [1, 2, 4],
    "decode_context_length_buckets": [256, 512],
    "on_device_sampling_config": None,
}
TRINITY_MAX_LEN = 1024
TRINITY_MAX_TOKENS = 512  # a step's token budget: the 600-token prompt is prefilled in two segments

# 252 and 600 > the sliding window (64); the 252-token prompt's decode crosses from the 256 context bucket to the
# 512 one (at its 5th decode step), then the 600-token prompt arrives and the batch decodes in max_model_len's (1024)
TRINITY_PROMPTS = random_prompts(3, [7, 252, 600], seed=43)
TRINITY_ARRIVALS = [0, 0, 6]


def trinity_runner(
    ckpt: Path, compile_backend: str | None, tp: int = 1, rank: int = 0, **engine_args: Any
) -> NeuronRunner:
    """The Neuron runner on an MLA-Trinity checkpoint with TRINITY_NC's buckets (max_model_len 1024, 48 blocks of
    32)."""
    from vllm_trn_plugin.neuron.trinity_mla import TrinityMLANeuronModel

    return NeuronRunner(
        TrinityMLANeuronModel,
        ckpt,
        runner_config(ckpt, TRINITY_MAX_LEN, tp=tp, max_num_batched_tokens=TRINITY_MAX_TOKENS, **engine_args),
        TRINITY_NC,
        block_size=32,
        num_blocks=48,
        rank=rank,
        compile_backend=compile_backend,
    )


def vllm_tokens(mla: Path, additional_config: dict[str, Any] | None = None) -> list[list[int]]:
    """vLLM's greedy tokens for TRINITY_PROMPTS on the float32 MLA checkpoint (one eager engine, TP 1)."""
    from vllm import LLM

    llm = LLM(
        model=str(mla),
        dtype="float32",
        max_model_len=TRINITY_MAX_LEN,
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
def test_trinity_through_neuron_contract_equals_vllm(
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
        assert g == e, f"prompt of {len(p)} tokens: Neuron contract {g}, vLLM {e}"
    assert {
        ("prefill", 512),
        ("decode", 4),
        ("decode", 2),
        ("decode-ctx", 256),
        ("decode-ctx", 512),
        ("decode-ctx", 1024),
    } <= runner.padded_shapes
    if compile_backend is not None:
        check_compiled(runner)
    print(
        f"\nMLA-Trinity via the Neuron contract ({compile_backend or 'eager'}): {len(prompts)} prompts x {STEPS} "
        f"tokens "
        f"equal vLLM's; shapes {sorted(runner.padded_shapes)}; {runner.decode_steps} decode steps in {seconds:.1f} s "
        f"(load {runner.load_seconds:.1f} s, {len(runner.graphs)} graphs warmed in "
        f"{sum(runner.warmup_seconds.values()):.1f} s: "
        f"{ {k: round(v, 1) for k, v in runner.warmup_seconds.items()} })"
    )


@pytest.mark.parametrize(
    "engine_args,refusal",
    [
        ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8.*sliding layers"),
        ({"additional_config": {"latent_cache_dtype": "fp8"}}, "latent_cache_dtype.*--kv-cache-dtype"),
    ],
    ids=["kv-cache-dtype-fp8", "fp8-latent"],
)
def test_neuron_adapter_refuses_fp8_caches(
    trinity_ckpts: tuple[Path, Path], worker: None, engine_args: dict[str, Any], refusal: str
) -> None:
    """The runner allocates every layer's cache in the --kv-cache-dtype and the static step keeps the sliding layers
    in the model dtype: an FP8 cache of either kind is refused when the model is built, naming the option, never
    served in another dtype than asked (and not only at binding, after the weights have loaded)."""
    from vllm.config import set_current_vllm_config

    from vllm_trn_plugin.neuron.trinity_mla import TrinityMLANeuronModel

    mla, _ = trinity_ckpts
    cfg = runner_config(mla, TRINITY_MAX_LEN, max_num_batched_tokens=TRINITY_MAX_TOKENS, **engine_args)
    with set_current_vllm_config(cfg), pytest.raises(NotImplementedError, match=refusal):
        TrinityMLANeuronModel.from_configs(cfg.model_config.hf_config, {})


def test_trinity_kernels_in_emulator_through_neuron_contract(
    trinity_ckpts: tuple[Path, Path], worker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packed checkpoint (FP8 experts), compiled, prefilled in one shot (max_model_len 512): at the first padded
    decode step the compiled graph's latent-decode and FP8-expert ops run the kernels in the emulator."""
    from vllm_trn_plugin.kernels import fp8_expert_nki, latent_decode_nki
    from vllm_trn_plugin.neuron.trinity_mla import TrinityMLANeuronModel

    _, packed = trinity_ckpts
    monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
    runner = NeuronRunner(
        TrinityMLANeuronModel,
        packed,
        runner_config(packed, 512, max_num_batched_tokens=512),
        {
            "num_seqs_buckets": [4],
            "num_batched_tokens_buckets": [128],
            "decode_context_length_buckets": [256],
            "on_device_sampling_config": None,
        },
        block_size=32,
        num_blocks=32,
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
        f"\nMLA-Trinity (packed) via the Neuron contract, emulated decode step {report['emulate_rows']}: "
        f"{report['kernel_calls']} kernel calls, greedy tokens equal, logits within "
        f"{report['emulate_max_logit_diff']:.1e}, {report['emulate_seconds']:.1f} s"
    )


def _kernel_lnc() -> int:
    """The largest LNC degree all three kernels run at (a deployment must compile for one of theirs)."""
    from vllm_trn_plugin.kernels import fp8_expert_nki, latent_decode_nki, simple_gla_nki

    return max(set(fp8_expert_nki.LNC_DEGREES) & set(latent_decode_nki.LNC_DEGREES) & set(simple_gla_nki.LNC_DEGREES))


@pytest.fixture
def neuron_torch_stack(monkeypatch: pytest.MonkeyPatch) -> Any:
    """torch-neuronx's NKI interface, stood in (tests/fakes/torch_neuronx.py), the kernel ops registered through it as
    the plugin does at import on a Neuron host (nki_ops.register_installed), launched at an LNC every kernel runs at,
    and selected for the model (VLLM_TRN_KERNELS=nki)."""
    import sys

    from tests.fakes import torch_neuronx
    from vllm_trn_plugin.kernels import nki_ops

    monkeypatch.setitem(sys.modules, "torch_neuronx", torch_neuronx)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(_kernel_lnc()))
    nki_ops.register_installed()
    monkeypatch.setenv("VLLM_TRN_KERNELS", "nki")
    torch_neuronx.launches.clear()
    return torch_neuronx


def _graph_kernel_nodes(runner: NeuronRunner) -> tuple[list[dict], list[dict]]:
    """The kernel nodes (op, mutated arguments) -> count of each prefill graph and each decode graph (warm-up order:
    every token bucket, then every decode bucket)."""
    nodes = [kernel_nodes([gm]) for gm in runner.graphs]
    return nodes[: len(runner.token_buckets)], nodes[len(runner.token_buckets) :]


def test_laplace_kernel_enters_the_graph_as_nki_op(
    laplace_ckpt: Path, laplace_llm: Any, worker: None, neuron_torch_stack: Any
) -> None:
    """On Neuron the GLA kernel reaches the graph as the stack's kernel op: every compiled decode graph holds exactly
    one trn::nki_gla_decode_step node per layer, declaring the state pool it writes as mutated, and nothing else
    opaque; each launch runs the kernel at the deployment's LNC (here in the emulator); the tokens are vLLM's."""
    from vllm_trn_plugin.neuron.laplace import LaplaceNeuronModel

    prompts = random_prompts(3, [1, 37, 130], seed=45)
    served = laplace_llm.llm.generate(token_prompts(prompts), greedy_params(STEPS), use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in served]
    runner = NeuronRunner(
        LaplaceNeuronModel,
        laplace_ckpt,
        runner_config(laplace_ckpt, 256, max_num_batched_tokens=256),
        {"num_seqs_buckets": [1, 2, 4], "num_batched_tokens_buckets": [128, 256]},
        block_size=32,
        num_blocks=8,
        compile_backend="aot_eager",
    )
    got = runner.generate([Request(p, a) for p, a in zip(prompts, [0, 0, 1])])
    assert got == expected
    layers = runner.model.config.num_hidden_layers
    prefills, decodes = _graph_kernel_nodes(runner)
    assert prefills == [{}] * len(prefills), prefills
    assert decodes == [{("trn::nki_gla_decode_step", ("state_pool",)): layers}] * len(decodes), decodes
    lnc = _kernel_lnc()
    launched = neuron_torch_stack.launches
    assert set(launched) == {("gla_decode_kernel", lnc)} and len(launched) % layers == 0, launched
    print(f"\nLaplace: {len(decodes)} decode graphs, {layers} nki_op nodes each; {len(launched)} launches at LNC {lnc}")


def test_trinity_kernels_enter_the_graph_as_nki_ops(
    trinity_ckpts: tuple[Path, Path], worker: None, neuron_torch_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packed MLA-Trinity on Neuron: every compiled graph holds one trn::nki_fp8_experts node per MoE layer
    (prefill and decode), every decode graph also one trn::nki_latent_decode per global layer, and nothing else
    opaque; the launches run the kernels at the deployment's LNC (in the emulator); the tokens equal the torch path's
    on the same checkpoint (an eager runner)."""
    from vllm_trn_plugin.neuron.trinity_mla import TrinityMLANeuronModel

    _, packed = trinity_ckpts
    nc = {
        "num_seqs_buckets": [4],
        "num_batched_tokens_buckets": [128],
        "decode_context_length_buckets": [256],
        "on_device_sampling_config": None,
    }
    prompts = random_prompts(3, [7, 9, 70], seed=44)

    def run(compile_backend: str | None) -> tuple[NeuronRunner, list[list[int]]]:
        cfg = runner_config(packed, 512, max_num_batched_tokens=512)
        runner = NeuronRunner(
            TrinityMLANeuronModel, packed, cfg, nc, block_size=32, num_blocks=32, compile_backend=compile_backend
        )
        return runner, runner.generate([Request(p, 0) for p in prompts], max_decode_steps=2)

    runner, got = run("aot_eager")
    monkeypatch.setenv("VLLM_TRN_KERNELS", "torch")
    _, want = run(None)
    assert got == want
    moe = sum(layer.moe_enabled for layer in runner.model.model.model.layers)
    latent = len(runner.latent_layers())
    prefills, decodes = _graph_kernel_nodes(runner)
    assert prefills == [{("trn::nki_fp8_experts", ()): moe}] * len(prefills), prefills
    per_decode = {("trn::nki_fp8_experts", ()): moe, ("trn::nki_latent_decode", ()): latent}
    assert decodes == [per_decode] * len(decodes), decodes
    launched = {name for name, lnc in neuron_torch_stack.launches if lnc == _kernel_lnc()}
    assert launched == {"fp8_experts_kernel", "latent_decode_kernel"}, neuron_torch_stack.launches
    print(f"\nMLA-Trinity (packed): prefill graphs {prefills}, decode graphs {decodes}; tokens equal the torch path's")


@pytest.mark.parametrize("model", ["laplace", "mla-trinity"])
def test_packed_step_graphs_convert_no_weight(
    model: str,
    laplace_ckpt: Path,
    trinity_ckpts: tuple[Path, Path],
    worker: None,
    neuron_torch_stack: Any,
    tmp_path: Path,
) -> None:
    """The packed models' step graphs on Neuron, in bf16 (the trn2 recipes' dtype): no graph converts a parameter or
    buffer to another dtype (directly or through a view), so no step re-reads a weight through a cast: the FP8 dense
    layers and LM head reach the device as FP8 GEMMs of the FP8 weight, MLA-Trinity's W_k / W_v are made from
    kv_b_proj once at load, norms multiply in the model's dtype or a copy made at load. Traced only (every prefill
    and decode bucket)."""
    from vllm_trn_plugin.loaders.packed import pack
    from vllm_trn_plugin.neuron.laplace import LaplaceNeuronModel
    from vllm_trn_plugin.neuron.trinity_mla import TrinityMLANeuronModel

    if model == "laplace":
        cls, ckpt = LaplaceNeuronModel, pack(laplace_ckpt, tmp_path / "packed").dst
    else:
        cls, ckpt = TrinityMLANeuronModel, trinity_ckpts[1]
    nc = {
        "num_seqs_buckets": [4],
        "num_batched_tokens_buckets": [128],
        "decode_context_length_buckets": [256],
        "on_device_sampling_config": None,
    }
    cfg = runner_config(ckpt, 512, dtype="bfloat16", max_num_batched_tokens=512)
    runner = NeuronRunner(cls, ckpt, cfg, nc, block_size=32, num_blocks=32, compile_backend="capture")
    assert runner.graphs and parameter_conversions(runner.graphs, runner.graph_inputs) == {}
    fp8 = [m for m in runner.model.modules() if getattr(getattr(m, "weight", None), "dtype", None) == FP8_DTYPE]
    assert fp8, "the packed checkpoint loaded no FP8 layer"
    print(f"\n{model} (packed, bf16): {len(runner.graphs)} step graphs, {len(fp8)} FP8 layers, no weight converted")


# torch's functional collectives: vLLM's TP-group all-reduce and the LM head's gather, traced
COLLECTIVES = {
    "_c10d_functional::all_reduce",
    "_c10d_functional::all_gather_into_tensor",
    "_c10d_functional::wait_tensor",
}


def _trinity_tp_rank(rank: int, world: int, mla: str, init_file: str, out_dir: str) -> None:
    """One Neuron worker of a tensor-parallel group (a spawned process per rank): the worker's gloo world and vLLM's
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
            "sliding_kv_heads": sorted({s.num_kv_heads for s in spec.layers if s.cache_kind.value != "mla"}),
            "latent_rank": sorted({s.head_size for s in spec.layers if s.cache_kind.value == "mla"}),
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


def test_trinity_neuron_contract_at_tp2_equals_tp1(
    trinity_ckpts: tuple[Path, Path], trinity_expected: list[list[int]], tmp_path: Path
) -> None:
    """Two Neuron workers (spawned processes, gloo), each building through the adapter the shard of its rank of a
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
            assert g == e, f"rank {r}, prompt of {len(p)} tokens: Neuron contract at TP 2 {g}, vLLM at TP 1 {e}"
    print(
        f"\nMLA-Trinity via the Neuron contract at TP 2 (two gloo ranks, compiled, {ranks[0]['graphs']} graphs per "
        f"rank): tokens equal TP 1's; {ranks[0]['shapes']}; collectives {ranks[0]['opaque']}"
    )


def _recipe(model: str) -> tuple[dict[str, Any], int, str, dict[str, Any]]:
    """The trn2 recipe's neuron_config, max_model_len, dtype and engine options (--max-num-batched-tokens,
    --kv-cache-dtype, the rest of --additional-config) for `model` (deploy/trn2/serve-replica.sh)."""
    argv = trn2_recipe_argv(model)

    def opt(name: str) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else None

    extra = json.loads(opt("--additional-config") or "{}")
    nc = extra.pop("neuron_config")
    cache = {"additional_config": extra, "max_num_batched_tokens": int(opt("--max-num-batched-tokens"))} | (
        {"kv_cache_dtype": opt("--kv-cache-dtype")} if opt("--kv-cache-dtype") else {}
    )
    return nc, int(opt("--max-model-len")), opt("--dtype"), cache


@pytest.mark.parametrize("model", ["laplace-3b", "mla-trinity"])
def test_recipe_buckets_are_captured_whole(model: str, worker: None, tmp_path: Path) -> None:
    """Every bucket the trn2 recipe has the runner compile (its neuron_config, max_model_len, token budget and dtype:
    2048-token prefill segments, decode widths, MLA-Trinity's context buckets 2304 / 4352 / 8448 and max_model_len
    16,640) is captured by torch.compile(fullgraph=True) as one graph holding nothing opaque but the kernel ops,
    under the recipe's engine options (a bucket layout the runner refuses, or an option the adapter refuses, fails
    here). Traced only
    (a 2048-token prefill over a 16,640-token table does not run on these machines), on the demo geometry (4
    layers), at TP 1 (the compiled TP-2 run is test_trinity_neuron_contract_at_tp2_equals_tp1's)."""
    from vllm_trn_plugin.demo import write_laplace_demo, write_trinity_demo
    from vllm_trn_plugin.neuron.laplace import LaplaceNeuronModel
    from vllm_trn_plugin.neuron.trinity_mla import TrinityMLANeuronModel

    nc, max_len, dtype, cache = _recipe(model)
    if model == "laplace-3b":
        cls, ckpt = LaplaceNeuronModel, write_laplace_demo(tmp_path / "ckpt", dtype=torch.float32)
    else:
        cls = TrinityMLANeuronModel
        ckpt = write_trinity_demo(tmp_path / "ckpt", dtype=torch.float32, max_position_embeddings=max_len)
    runner = NeuronRunner(
        cls,
        ckpt,
        runner_config(ckpt, max_len, dtype=dtype, **cache),
        nc,
        block_size=32,
        num_blocks=8,
        compile_backend="capture",
    )
    contexts = len(nc.get("decode_context_length_buckets", [])) + 1  # + max_model_len
    buckets = len(runner.token_buckets) + len(nc["num_seqs_buckets"]) * contexts
    assert len(runner.graphs) == len(runner.warmup_seconds) == buckets, sorted(runner.warmup_seconds)
    assert opaque_ops(runner.graphs, KERNEL_OPS) == {}
    print(
        f"\n{model}: the recipe's {buckets} buckets captured whole ({dtype}, max_model_len {max_len}, {cache}) in "
        f"{sum(runner.warmup_seconds.values()):.0f} s: {sorted(runner.warmup_seconds)}"
    )


def test_runner_configs_and_inputs_the_adapter_refuses(laplace_ckpt: Path, worker: None) -> None:
    """Refused when the model is built: a token-bucket layout the runner's segmented prefill refuses (buckets other
    than the segment, a segment size the runner has no kernel for, one-shot prefill past 16k tokens), and LoRA.
    Refused in the step: an argument the adapter does not know (a TypeError naming it, not a silently ignored
    input), and adapter_ids naming a LoRA slot (slot 0, the base model, is served)."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config

    from vllm_trn_plugin.neuron.contract import NeuronConfig, check_buckets, check_runner_config
    from vllm_trn_plugin.neuron.laplace import LaplaceNeuronModel

    segmented = runner_config(laplace_ckpt, 1024, max_num_batched_tokens=512)
    with set_current_vllm_config(segmented), pytest.raises(ValueError, match=r"\[128, 512\] must equal .*\[512\]"):
        LaplaceNeuronModel.from_configs(segmented.model_config.hf_config, {"num_batched_tokens_buckets": [128, 512]})
    with pytest.raises(ValueError, match="segment must be one of"):
        check_buckets(NeuronConfig.from_dict({}), 300, 1024)
    with pytest.raises(ValueError, match="needs segmented prefill"):
        check_buckets(NeuronConfig.from_dict({}), 20000, 20000)
    with pytest.raises(ValueError, match="kv_segment_size_buckets"):
        check_buckets(NeuronConfig.from_dict({"kv_segment_size_buckets": [1024]}), 512, 1024)
    check_buckets(NeuronConfig.from_dict({"num_batched_tokens_buckets": [512]}), 512, 1024)
    check_buckets(NeuronConfig.from_dict({"num_batched_tokens_buckets": [128, 256]}), 256, 256)
    lora = SimpleNamespace(lora_config=object(), scheduler_config=None, model_config=None)
    with pytest.raises(NotImplementedError, match="--enable-lora"):
        check_runner_config(lora, NeuronConfig.from_dict({}))

    runner = NeuronRunner(
        LaplaceNeuronModel,
        laplace_ckpt,
        runner_config(laplace_ckpt, 256, max_num_batched_tokens=256),
        {"num_seqs_buckets": [1], "num_batched_tokens_buckets": [128]},
        block_size=32,
        num_blocks=4,
    )
    req = Request([5, 6, 7], 0)
    runner._ensure_blocks(req, 3)
    kwargs = runner._prefill_kwargs(req.prompt, 0, req)
    with pytest.raises(TypeError, match="rotary_position_ids"):
        runner.step(kwargs | {"rotary_position_ids": torch.zeros(3, 128, dtype=torch.long)})
    runner.step(kwargs | {"adapter_ids": torch.zeros(1, dtype=torch.int32)})
    with pytest.raises(RuntimeError, match="adapter_ids"):
        runner.step(kwargs | {"adapter_ids": torch.ones(1, dtype=torch.int32)})
