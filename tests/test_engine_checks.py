"""What vLLM's engine config becomes for the plugin's models, built as `vllm serve` builds it (no engine started):
features a model cannot serve exactly are refused naming the option and the reason, the stateful custom ops are
splitting ops (so a piecewise CUDA graph never captures them), and the GLA metadata lives on the model's device.
"""

from __future__ import annotations

import importlib.util
import json
import typing
from pathlib import Path

import pytest
import torch
from vllm.config.speculative import MTPModelTypes, SpeculativeMethod

from vllm_trn_plugin.engine_checks import STATEFUL_OPS
from vllm_trn_plugin.models import MODELS


@pytest.fixture(scope="module")
def trinity_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_trn_plugin.demo import write_trinity_demo

    return write_trinity_demo(tmp_path_factory.mktemp("trinity-demo"), seed=0, dtype=torch.float32)


def _config(model: Path, **kw: object):  # noqa: ANN202
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=2048, kv_cache_memory_bytes=1 << 28, **kw).create_engine_config()


CONNECTOR = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}


@pytest.mark.parametrize("model", ["laplace", "trinity"])
def test_stateful_ops_are_splitting_ops(model: str, laplace_ckpt: Path, trinity_ckpt: Path) -> None:
    """Every op that reads or writes per-sequence state outside its inputs is a graph split point, so a piecewise
    graph never replays it with stale metadata. The names are written out here, not read from the plugin's list,
    and each must be an op torch knows (a renamed op would otherwise leave a stale name in both places)."""
    import vllm_trn_plugin.model_executors.laplace  # noqa: F401  (registers the trn:: ops)
    import vllm_trn_plugin.model_executors.trinity_mla  # noqa: F401

    stateful = ("trn::laplace_mixer", "trn::latent_attention", "trn::fp8_experts")
    for op in stateful:
        ns, name = op.split("::")
        assert hasattr(getattr(torch.ops, ns), name), op
    assert set(STATEFUL_OPS) == set(stateful)
    cfg = _config(laplace_ckpt if model == "laplace" else trinity_ckpt)
    ops = cfg.compilation_config.splitting_ops
    assert all(op in ops for op in stateful), ops
    assert "vllm::unified_attention_with_output" in ops  # vLLM's own stay


def test_the_models_table_names_every_trn_op() -> None:
    """models.MODELS is where the plugin's ops are named (splitting ops for the engine config, kernel ops the
    Neuron graphs must not hold): an op registered but not named there, or a name that is no registered op (renamed
    or removed), fails here rather than leaving a graph unsplit or a Neuron graph unchecked."""
    import vllm_trn_plugin.model_executors.laplace  # noqa: F401  (registers the trn:: ops)
    import vllm_trn_plugin.model_executors.trinity_mla  # noqa: F401

    registered = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("trn::")}
    named = {op for m in MODELS.values() for op in (*m.splitting_ops, *m.kernel_ops)}
    assert registered == named, (sorted(registered - named), sorted(named - registered))


@pytest.mark.parametrize(
    ("model", "kw", "option", "why"),
    [
        ("laplace", {"kv_transfer_config": CONNECTOR}, "--kv-transfer-config", "recurrent-state pages"),
        ("trinity", {"kv_transfer_config": CONNECTOR}, "--kv-transfer-config", "key scales in a store"),
        ("trinity", {"kv_offloading_size": 1.0}, "--kv-offloading-size", "key scales in a store"),
        ("laplace", {"enable_lora": True}, "--enable-lora", "does not implement vLLM's LoRA interface"),
        ("trinity", {"enable_lora": True}, "--enable-lora", "kv_b_proj as a plain matrix"),
    ],
    ids=["laplace-kv-connector", "trinity-kv-connector", "trinity-kv-offloading", "laplace-lora", "trinity-lora"],
)
def test_features_a_model_cannot_honour_refused_at_start(
    model: str, kw: dict, option: str, why: str, laplace_ckpt: Path, trinity_ckpt: Path
) -> None:
    with pytest.raises(ValueError, match=f"cannot be served with {option} .*: .*{why}"):
        _config(laplace_ckpt if model == "laplace" else trinity_ckpt, **kw)


def _literal_values(t: object) -> list[str]:
    return [v for a in typing.get_args(t) for v in (_literal_values(a) if typing.get_args(a) else [a])]


# Every method --speculative-config accepts in this vLLM; vLLM turns each of its multi-token-prediction model types
# into "mtp" before anything else, so "mtp" stands for them all.
SPECULATIVE_METHODS = sorted(set(_literal_values(SpeculativeMethod)) - set(_literal_values(MTPModelTypes)) | {"mtp"})
_LLAMA_DRAFT = dict(
    model_type="llama",
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=259,
    max_position_embeddings=8192,
)
# Draft checkpoints' config.json for the methods that need one (a config is all that building the engine config reads).
_DRAFTS = {
    "eagle": {**_LLAMA_DRAFT, "architectures": ["LlamaForCausalLM"]},
    "eagle3": {**_LLAMA_DRAFT, "architectures": ["LlamaForCausalLMEagle3"]},
    "dflash": {**_LLAMA_DRAFT, "model_type": "qwen3", "architectures": ["DFlashDraftModel"]},
    "medusa": {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": 512, "vocab_size": 259},
    "mlp_speculator": {
        "model_type": "mlp_speculator",
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "emb_dim": 512,
        "inner_dim": 512,
        "vocab_size": 259,
        "n_predict": 2,
        "top_k_tokens_per_head": [2, 2],
    },
}


def _speculative_config(method: str, target: Path, tmp: Path) -> dict:
    spec = {"method": method, "num_speculative_tokens": 2}
    if method in _DRAFTS:
        (tmp / "config.json").write_text(json.dumps(_DRAFTS[method]))
        spec["model"] = str(tmp)
    elif method == "draft_model":
        spec["model"] = str(target)
    elif method == "custom_class":
        spec["model"] = "proposers.Proposer"  # imported by the engine, not when the config is built
    elif method == "ngram":
        spec["prompt_lookup_max"] = 3
    return spec


# Refused by vLLM itself before the plugin's check, with vLLM's reason.
_VLLM_REFUSES = {
    "mtp": (NotImplementedError, "Unsupported speculative method: 'mtp'"),  # neither model has such layers
    "mlp_speculator": (ValueError, r"\['MLPSpeculatorPreTrainedModel'\] are not supported"),  # not in this vLLM
}
if importlib.util.find_spec("arctic_inference") is None:
    _VLLM_REFUSES["suffix"] = (ImportError, "Arctic Inference is required for suffix decoding")


@pytest.mark.parametrize("method", SPECULATIVE_METHODS)
@pytest.mark.parametrize("model", ["laplace", "trinity"])
def test_every_speculative_method_refused_at_start(
    model: str, method: str, laplace_ckpt: Path, trinity_ckpt: Path, tmp_path: Path
) -> None:
    """EAGLE, EAGLE3 and every other method: refused when the config is built, naming the option, the method and why
    (or, for those in _VLLM_REFUSES, by vLLM before the plugin's check); MLA-Trinity serves n-gram and EAGLE3
    (test_trinity_speculative.py checks their output), Laplace n-gram (test_laplace_speculative.py)."""
    target = laplace_ckpt if model == "laplace" else trinity_ckpt
    spec = _speculative_config(method, target, tmp_path)
    if (model, method) in (("trinity", "ngram"), ("trinity", "eagle3"), ("laplace", "ngram")):
        assert _config(target, speculative_config=spec).speculative_config.method == method
        return
    if method in _VLLM_REFUSES:
        error, message = _VLLM_REFUSES[method]
        with pytest.raises(error, match=message):
            _config(target, speculative_config=spec)
        return
    why = "of vLLM's methods only n-gram"
    option = rf"--speculative-config \(speculative decoding, method '{method}'\)"
    with pytest.raises(ValueError, match=f"cannot be served with {option}: {why}"):
        _config(target, speculative_config=spec)


def test_ngram_refused_where_unverified(
    trinity_ckpt: Path, laplace_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n-gram, served on vLLM's own runner at one rank, is refused under vLLM Neuron's runner (the contract adapter's
    decode step has no verification path), for MLA-Trinity at tensor parallelism (not verified there) and for
    Laplace beside prefix caching (whose state checkpoints would be copied with pending tokens in the page)."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    with pytest.raises(ValueError, match="method 'ngram'.*verified at --tensor-parallel-size 1 only"):
        _config(trinity_ckpt, speculative_config=spec, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="LaplaceForCausalLM.*method 'ngram'.*with --enable-prefix-caching"):
        _config(laplace_ckpt, speculative_config=spec, enable_prefix_caching=True)
    monkeypatch.setenv("VLLM_TRN_NEURON_ENTRY", "neuron")
    for ckpt in (trinity_ckpt, laplace_ckpt):
        with pytest.raises(ValueError, match="method 'ngram'.*under vLLM Neuron's runner"):
            _config(ckpt, speculative_config=spec)


def test_gla_metadata_on_the_model_device(laplace_ckpt: Path) -> None:
    """Built from metadata whose device tensors are on `meta` (a stand-in for CUDA or Neuron that fails on any
    mix with a CPU tensor and on any host read of a device value): every tensor the mixer combines with the
    state pools is on that device; only the token offsets, which split the packed batch on the host, are not."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_trn_plugin.model_executors.gla_state import GLAStateMetadataBuilder
    from vllm_trn_plugin.model_executors.laplace import LaplaceForCausalLM

    cfg = _config(laplace_ckpt)
    spec_shapes = LaplaceForCausalLM.get_mamba_state_shape_from_config(cfg)
    meta = torch.device("meta")
    # Two decodes (one brand-new one-token prompt), then a fresh prefill and a continued one.
    q_lens, ctx = [1, 1, 5, 3], [7, 0, 0, 4]
    qsl = torch.tensor([0, 1, 2, 7, 10])
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(meta),
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([q + c for q, c in zip(q_lens, ctx)]).to(meta),
        num_reqs=4,
        num_actual_tokens=10,
        max_query_len=5,
        max_seq_len=8,
        block_table_tensor=torch.arange(4).view(4, 1).to(meta),
        slot_mapping=torch.zeros(10, dtype=torch.long).to(meta),
    )
    spec = MambaSpec(block_size=2048, shapes=spec_shapes, dtypes=(torch.float32, torch.float32))
    with set_current_vllm_config(cfg):
        builder = GLAStateMetadataBuilder(spec, ["model.layers.0.mixer"], cfg, meta)
        m = builder.build(0, common)
    assert (m.num_decodes, m.num_prefills, m.num_decode_tokens, m.num_actual_tokens) == (2, 2, 2, 10)
    for name in ("decode_slots", "decode_fresh", "prefill_slots", "prefill_has_state"):
        assert getattr(m, name).device == meta, name
    assert m.prefill_cu_seqlens.device.type == "cpu" and m.prefill_cu_seqlens.tolist() == [0, 5, 8]


def test_cpu_workers_get_a_binding_unless_the_user_gave_one(
    trinity_ckpt: Path, laplace_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers on a host whose NUMA nodes cannot give each its own: the plugin splits the allowed cores between
    them (vLLM's automatic binding refuses); a later one-worker config drops that binding; the user's own is kept."""
    import os

    from vllm.utils import cpu_resource_utils

    from vllm_trn_plugin.engine_checks import THREADS_BIND

    if len(cpu_resource_utils.get_visible_memory_node()) >= 2:
        pytest.skip("two NUMA nodes: vLLM's own binding places two workers")
    cpus = sorted(c.id for c in cpu_resource_utils.get_allowed_cpu_list())
    monkeypatch.setenv(THREADS_BIND, "unset below; restored unset after the test")
    monkeypatch.delenv(THREADS_BIND)

    _config(trinity_ckpt, tensor_parallel_size=2)
    groups = [[int(c) for c in g.split(",")] for g in os.environ[THREADS_BIND].split("|")]
    assert len(groups) == 2 and all(groups) and sorted(groups[0] + groups[1]) == cpus[: len(cpus) // 2 * 2]
    _config(laplace_ckpt)  # one worker: vLLM's default again
    assert THREADS_BIND not in os.environ

    monkeypatch.setenv(THREADS_BIND, f"{cpus[0]}|{cpus[-1]}")
    _config(trinity_ckpt, tensor_parallel_size=2)
    assert os.environ[THREADS_BIND] == f"{cpus[0]}|{cpus[-1]}"
    monkeypatch.delenv(THREADS_BIND)

    # More workers than the process may use, on any host: this process held to one core for the check.
    try:
        os.sched_setaffinity(0, cpus[:1])
        with pytest.raises(ValueError, match="2 CPU workers .* need a core each, and this process may use 1"):
            _config(trinity_ckpt, tensor_parallel_size=2)
    finally:
        os.sched_setaffinity(0, cpus)
    assert THREADS_BIND not in os.environ  # the refused config bound nothing


def test_parallel_layouts_a_model_lacks_refused_at_start(
    laplace_ckpt: Path, trinity_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Laplace at --tensor-parallel-size 2 and an unquantized MLA-Trinity at --enable-expert-parallel on vLLM's CPU
    build are refused when the config is built, each naming the option and why; a packed MLA-Trinity (the plugin's
    FP8 experts honour the expert map) builds."""
    from vllm_trn_plugin.loaders.packed import pack

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # the binding is not what is tested here
    with pytest.raises(ValueError, match=r"LaplaceForCausalLM has no tensor-parallel layout.*one replica per core"):
        _config(laplace_ckpt, tensor_parallel_size=2)
    ep = dict(tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"--enable-expert-parallel on vLLM's CPU build needs a packed"):
        _config(trinity_ckpt, **ep)
    packed = pack(trinity_ckpt, tmp_path / "packed").dst
    cfg = _config(packed, **ep)
    assert cfg.parallel_config.enable_expert_parallel and cfg.model_config.quantization == "trn-mxfp4-fp8"


def test_mla_query_heads_not_a_multiple_of_kv_heads_refused_at_start(trinity_ckpt: Path, tmp_path: Path) -> None:
    """An MLA-Trinity config.json whose query heads do not split evenly over its KV heads is refused when the engine
    config is built, naming both fields, not at the first request."""
    import json
    import shutil

    bad = tmp_path / "bad-heads"
    shutil.copytree(trinity_ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_attention_heads"] = cfg["num_key_value_heads"] * 2 + 1
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"num_attention_heads=\d+ must be a positive multiple of num_key_value_heads"):
        _config(bad)
