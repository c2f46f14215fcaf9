"""Laplace served by real vLLM (compiled mode, float32) against the independent float64 reference.

All tests share the session engine (conftest.laplace_llm): a 40-page state pool, 64 sequences
admitted at most, 256-token batches, so long prompts are prefilled in several chunks that
continue from the saved state, and prefills and decodes share batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import (
    LOGPROB_TOL,
    POOL_SLOTS,
    PROBE_TOKENS,
    PROBES,
    TOKEN_BUDGET,
    check_batched_against_alone,
    chosen_steps,
    greedy_params,
    random_prompts,
    token_prompts,
)
from tests.references.laplace import assert_same_greedy
from vllm_trn_plugin.gate.ties import first_divergence

pytestmark = pytest.mark.vllm

# Lengths around the 128-token chunk edges and past the 256-token batch budget.
MIXED_LENGTHS = [1, 7, 127, 128, 129, 300, 517, 40, 255, 256, 257, 3, 64, 200, 90, 411]


def test_greedy_equals_plain_pytorch_forward(laplace_llm, laplace_ref) -> None:
    prompts = random_prompts(8, MIXED_LENGTHS[::2], seed=1)
    outs = laplace_llm.llm.generate(token_prompts(prompts), greedy_params(24), use_tqdm=False)
    assert any(len(p) > TOKEN_BUDGET for p in prompts)  # chunked prefill from a saved state
    for prompt, out in zip(prompts, outs):
        ref = laplace_ref.greedy(prompt, 24)
        toks, lps, _ = chosen_steps(out)
        assert_same_greedy(toks, ref, f"prompt of {len(prompt)} tokens")
        d = first_divergence(toks, ref.tokens)
        n = len(toks) if d is None else d
        err = max(abs(a - b) for a, b in zip(lps[:n], ref.logprobs[:n]))
        assert err < 1e-3, f"prompt of {len(prompt)} tokens: chosen-token logprob differs by {err:.2e} from float64"


@pytest.fixture(scope="module")
def alone_outputs(laplace_llm):
    prompts = random_prompts(32, MIXED_LENGTHS, seed=2)
    alone = [
        chosen_steps(laplace_llm.llm.generate(token_prompts([p]), greedy_params(16), use_tqdm=False)[0])
        for p in prompts
    ]
    return prompts, alone


@pytest.mark.parametrize("batch", [1, 4, 8, 16, 32])
def test_batch_invariance(laplace_llm, alone_outputs, batch: int) -> None:
    prompts, alone = alone_outputs
    # Different members per batch size, in a shuffled order.
    idx = [(i * 7 + batch) % 32 for i in range(batch)]
    outs = laplace_llm.llm.generate(token_prompts([prompts[i] for i in idx]), greedy_params(16), use_tqdm=False)
    for i, out in zip(idx, outs):
        toks, lps, _ = chosen_steps(out)
        what = f"seq {i} (len {len(prompts[i])}) in batch {batch}"
        check_batched_against_alone(what, toks, lps, alone[i], LOGPROB_TOL)


def test_waves_with_aborts_more_sequences_than_pages(laplace_llm, laplace_ref) -> None:
    """100 requests for a 40-page pool, a quarter aborted mid-stream: the rest are exact."""
    engine = laplace_llm.llm.llm_engine
    distinct = random_prompts(10, [5, 33, 130, 260, 12], seed=3)
    refs = [laplace_ref.greedy(p, 10) for p in distinct]
    n_req = 100
    assert n_req > POOL_SLOTS
    ids = {f"wave-{r}": r for r in range(n_req)}  # outputs and aborts use these external ids
    for rid, r in ids.items():
        engine.add_request(rid, {"prompt_token_ids": distinct[r % 10]}, greedy_params(10, logprobs=0))
    to_abort = {rid for rid, r in ids.items() if r % 4 == 1}
    finished, steps, aborted = {}, 0, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
            elif out.request_id in to_abort and len(out.outputs[0].token_ids) >= 3:
                engine.abort_request([out.request_id])
                aborted.add(out.request_id)
        steps += 1
        assert steps < 10_000
    assert aborted, "no request was aborted mid-stream"
    for rid, r in ids.items():
        if rid in aborted:
            continue
        assert rid in finished, f"request {r} never finished"
        assert_same_greedy(finished[rid], refs[r % 10], f"request {r} (prompt {r % 10})")
    assert len(finished) >= n_req - len(aborted)


def test_state_pool_returns_to_empty(laplace_llm) -> None:
    laplace_llm.llm.generate(token_prompts(random_prompts(50, [10, 300], seed=4)), greedy_params(4), use_tqdm=False)
    usage = [m.value for m in laplace_llm.llm.get_metrics() if m.name == "vllm:kv_cache_usage_perc"]
    assert usage and usage[0] == 0.0, f"state pages still held after all requests ended: {usage}"


def test_reused_slot_equals_fresh_engine(laplace_llm) -> None:
    """Runs after the other tests have cycled every page: the probes must see no stale state."""
    for prompt, fresh in zip(PROBES, laplace_llm.fresh_probe_outputs):
        again = laplace_llm.llm.generate(token_prompts([prompt]), greedy_params(PROBE_TOKENS), use_tqdm=False)[0]
        got, want = chosen_steps(again), chosen_steps(fresh)
        assert got[0] == want[0], f"probe of {len(prompt)} tokens: {got[0]} in a reused slot, {want[0]} fresh"
        assert max(abs(a - b) for a, b in zip(got[1], want[1])) <= LOGPROB_TOL


_PROFILE_CHILD = """
import json, sys, tempfile
import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as profiler
from vllm.config import set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.engine.arg_utils import EngineArgs
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm_trn_plugin import register
from vllm_trn_plugin.model_executors.laplace import LaplaceMixer
from vllm_trn_plugin.model_executors.latent_attention import TrinityLatentAttention

class PeakBytes:
    # the peak of the bytes a block holds live beyond what it started with, from the profiler's allocation and free
    # events in time order (a true peak, tensor subclasses included)
    def __enter__(self):
        self.prof = profiler(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()
        return self
    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        live = self.bytes = 0
        for e in sorted(self.prof.events(), key=lambda e: e.time_range.start):
            live += e.self_cpu_memory_usage
            self.bytes = max(self.bytes, live)

register()
kind, ckpt, max_num_seqs, T, max_model_len = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
vc = EngineArgs(
    model=ckpt, dtype="float32", max_model_len=max_model_len, max_num_seqs=max_num_seqs, enforce_eager=True
).create_engine_config()
with set_current_vllm_config(vc):
    init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
    ensure_model_parallel_initialized(1, 1)
    loader = get_model_loader(vc.load_config)
    model = loader.create_model(vllm_config=vc, model_config=vc.model_config)
    loader.load_weights(model, vc.model_config)
    process_weights_after_loading(model, vc.model_config, torch.device("cpu"))  # vLLM's CPU linear layers' set-up
layer_type = LaplaceMixer if kind == "laplace" else TrinityLatentAttention
layer = next(m for m in model.modules() if isinstance(m, layer_type))
D = vc.model_config.hf_config.hidden_size
h = torch.randn(T, D, generator=torch.Generator().manual_seed(0))
with torch.no_grad():  # what vLLM's profile run calls: no attention metadata
    if kind == "laplace":
        profile = torch.full((T, layer.num_heads * layer.head_v_dim), float("nan"))
        with set_forward_context(None, vc), PeakBytes() as made:
            layer.mix(h, profile)
    else:
        q, latent = layer.project(h)
        profile = torch.full((T, layer.num_heads * layer.head_dim), float("nan"))
        with set_forward_context(None, vc), PeakBytes() as made:
            layer.attend(q, latent, profile)
result = {"profile_bytes": made.bytes, "finite": bool(profile.isfinite().all()), "nonzero": bool(profile.any())}
if kind == "laplace":
    pages = 1 + max_num_seqs
    shapes = zip(layer.get_state_shape(), layer.get_state_dtype())
    layer.kv_cache = [torch.full((pages, *s), float("nan"), dtype=d) for s, d in shapes]
    for n in sorted({1, min(max_num_seqs, T)}):  # T tokens as one prompt, and as many prompts as admitted
        cu = torch.linspace(0, T, n + 1).round().to(torch.int32)
        with torch.no_grad(), PeakBytes() as made:
            out = layer.prefill(h, cu, torch.arange(1, n + 1), torch.zeros(n, dtype=torch.bool))
        result[f"step_bytes_{n}"] = made.bytes
        result[f"max_diff_{n}"] = float((out - profile).abs().max())
print("RESULT" + json.dumps(result))
"""


def _profile_child(kind: str, ckpt: Path, max_num_seqs: int, T: int, max_model_len: int) -> dict:
    import json
    import subprocess
    import sys

    argv = [kind, str(ckpt), str(max_num_seqs), str(T), str(max_model_len)]
    proc = subprocess.run([sys.executable, "-c", _PROFILE_CHILD, *argv], capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert line, f"child failed:\n{proc.stderr[-3000:]}"
    return json.loads(line[0].removeprefix("RESULT"))


def test_profile_run_costs_what_a_real_step_costs(laplace_ckpt: Path, tmp_path: Path) -> None:
    """vLLM sizes the cache from its profile run, which calls the stateful layers with no attention metadata: that
    call must allocate what a real step of its tokens does at worst, not return zeros and leave the step's transient
    out of the budget. Checked in a child process on each loaded model.
    - Laplace: the peak bytes the profile call holds against the real prefill of the same tokens as one prompt and as
      max_num_seqs prompts from fresh pages (each a state read, handed on and written), whose output it must equal.
    - MLA-Trinity: at least the keys and values rebuilt for a max_model_len context (what the last chunk of a long
      prompt's chunked prefill holds), from the checkpoint's own geometry, and a real (finite, non-zero) output."""
    import json

    from vllm_trn_plugin.demo import write_trinity_demo

    max_num_seqs, T = 16, 64
    r = _profile_child("laplace", laplace_ckpt, max_num_seqs, T, 256)
    assert r["finite"] and r[f"max_diff_{max_num_seqs}"] == 0.0, r  # the profile runs the real prefill of that layout
    assert r["profile_bytes"] >= max(r["step_bytes_1"], r[f"step_bytes_{max_num_seqs}"]), r

    trinity = write_trinity_demo(tmp_path / "trinity", dtype=torch.float32)
    cfg = json.loads((trinity / "config.json").read_text())
    max_model_len = 2048
    r = _profile_child("trinity", trinity, max_num_seqs, T, max_model_len)
    kv_bytes = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * max_model_len * 4
    assert r["finite"] and r["nonzero"], r
    assert r["profile_bytes"] >= kv_bytes, (r, kv_bytes)
