"""MLA-Trinity at tensor parallelism 2 through real vLLM (CPU build, two workers over gloo), exact against transformers.

The checkpoint is test_trinity_layout.py's kind: a random transformers `AfmoeForCausalLM` with Trinity-Mini's head
geometry (head_dim 128, 32 query / 4 KV heads, layers [S, S, S, F], window 128) whose full-attention
`[k_proj; v_proj]` is rank 256 by construction, converted exactly to MLA at `kv_lora_rank` 256. Each rank serves 16
query heads and 2 KV heads: its rows of `kv_b_proj`, its columns of the key-scale store, the whole latent (so on a
rank the latent blocks are 2x the sliding ones, whose pages hold half the KV heads); the sliding layers and the MoE
are vLLM's, sharded by vLLM. Prompts pass the window and one latent block. Greedy tokens and every step's full
logits against transformers' run of the original, alone and batched; then `vllm-trn serve` at TP=2.

The thread binding is the plugin's own (engine_checks.bind_cpu_workers): without it vLLM's CPU build refuses two
workers on one NUMA node.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch

from tests.helpers import random_prompts, raw_logits_llm, token_prompts, trn2_recipe_argv, worker_functions_allowed
from tests.references.afmoe import check_against_hf_greedy, hf_greedy, trinity_geometry_pair
from vllm_trn_plugin.gate.ties import TIE_MARGIN, first_divergence

pytestmark = pytest.mark.vllm

VOCAB = 259
RANK = 256
STEPS = 8
LOGIT_TOL = 1e-3  # as test_trinity_layout.py: a wrong head, shard or scale moves logits by O(0.1-1)
PROMPTS = dict(zip(["past a latent block", "past the window", "short"], random_prompts(3, [560, 170, 30], seed=5)))


def _params():  # noqa: ANN202
    from vllm import SamplingParams

    return SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=VOCAB, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return trinity_geometry_pair(tmp_path_factory.mktemp("afmoe-tp"), seed=9, rank=RANK)


@pytest.fixture(scope="module")
def refs(checkpoints: tuple[Any, Any], one_torch_thread: None) -> dict[str, dict]:
    orig, _ = checkpoints
    return {name: hf_greedy(orig, p, STEPS) for name, p in PROMPTS.items()}


@pytest.fixture(scope="module")
def llm(checkpoints: tuple[Any, Any], refs: dict[str, dict]):  # noqa: ANN201
    _, mla = checkpoints
    with worker_functions_allowed():
        engine = raw_logits_llm(
            mla,
            VOCAB,
            tensor_parallel_size=2,
            max_num_seqs=4,
            max_num_batched_tokens=None,
            kv_cache_memory_bytes=128 << 20,
        )
        yield engine
        del engine
        gc.collect()


def latent_shards(model: torch.nn.Module) -> dict[str, Any]:
    """Run in each worker (LLM.apply_model): what the rank's latent layer holds."""
    attn = model.model.layers[3].self_attn
    return {
        "heads": attn.num_heads,
        "kv_heads": list(attn.kv_heads),
        "kv_b_proj": tuple(attn.kv_b_proj.weight.shape),
        "kv_a_proj": attn.kv_a_proj.output_size,  # vLLM's CPU linear methods repack their weights: sizes, not shapes
        "key_scales": tuple(attn.key_scales.shape[1:]),
        "q_proj": attn.q_proj.output_size_per_partition,
        "o_proj": attn.o_proj.input_size_per_partition,
        "latent_cache": tuple(attn.kv_cache.shape[1:]),
    }


def test_each_rank_holds_its_heads_and_the_whole_latent(llm: Any) -> None:
    ranks = llm.apply_model(latent_shards)
    assert os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").count("|") == 1  # two workers, a core list each
    assert [r["kv_heads"] for r in ranks] == [[0, 1], [2, 3]]
    for r in ranks:
        assert r["heads"] == 16 and r["q_proj"] == r["o_proj"] == 16 * 128
        assert r["kv_b_proj"] == (2 * 2 * 128, RANK) and r["key_scales"] == (2,)
        assert r["kv_a_proj"] == RANK and r["latent_cache"] == (1, 2 * 128, RANK)


def test_tp2_greedy_and_logits_equal_transformers(llm: Any, refs: dict[str, dict]) -> None:
    worst = [0.0]
    for name, p in PROMPTS.items():
        check_against_hf_greedy(
            llm.generate(token_prompts([p]), _params(), use_tqdm=False)[0],
            refs[name],
            f"{name} alone",
            LOGIT_TOL,
            worst,
        )
    outs = llm.generate(token_prompts(list(PROMPTS.values())), _params(), use_tqdm=False)
    for (name, ref), out in zip(refs.items(), outs):
        check_against_hf_greedy(out, ref, f"{name} batched", LOGIT_TOL, worst)
    print(f"\nTP=2: max |logit - transformers| {worst[0]:.2e} over {len(PROMPTS)} prompts x {STEPS} steps, twice")


def test_vllm_trn_serve_tp2_answers_the_openai_api(
    checkpoints: tuple[Any, Any], refs: dict[str, dict], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`vllm-trn serve --tensor-parallel-size 2`, no binding given: the completions API gives transformers' tokens."""
    import requests

    from vllm_trn_plugin.bench.local import serve_demo

    _, mla = checkpoints
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # the engine above has set one for itself
    extra = ["--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "1024"]
    with serve_demo(mla, tmp_path / "server.log", extra=extra) as server:
        server.wait_healthy()
        for name, p in PROMPTS.items():
            body = {"model": str(mla), "prompt": p, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
            r = requests.post(server.url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=300)
            assert r.status_code == 200, r.text
            toks = r.json()["choices"][0]["token_ids"]
            d = first_divergence(toks, refs[name]["tokens"])
            assert d is None or refs[name]["margins"][d] < TIE_MARGIN, (name, toks, refs[name]["tokens"])


def test_trn2_recipe_layout_serves_on_cpu(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/trn2/serve-replica.sh's MLA-Trinity command, as printed, served by `vllm-trn serve` on CPU from a packed
    demo checkpoint (demo geometry, its position limit raised to Trinity-Mini's for the recipe's 16,640 tokens): TP=2,
    bf16, the packed FP8 method, torch.compile as the recipe leaves it, its buckets in --additional-config. Left out:
    --kv-cache-dtype fp8 (vLLM's CPU attention refuses an FP8 cache on AVX2-only hosts) and the recipe's host/port.
    The server must run that configuration and answer: a prompt past the window and a latent block, greedily, twice
    alike, and a chat turn."""

    import requests

    from vllm_trn_plugin.bench.local import LocalServer, free_port, vllm_trn_command
    from vllm_trn_plugin.demo import write_trinity_demo
    from vllm_trn_plugin.loaders.packed import pack

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # the plugin's binding, as a user would get it
    ckpt = pack(write_trinity_demo(tmp_path / "demo", max_position_embeddings=131072), tmp_path / "packed").dst
    argv = trn2_recipe_argv("mla-trinity", ckpt)
    assert argv[:3] == ["vllm", "serve", str(ckpt)] and argv[argv.index("--tensor-parallel-size") + 1] == "2"
    port = free_port()
    args, skip = [], {"--kv-cache-dtype": None, "--host": "127.0.0.1", "--port": str(port)}
    it = iter(argv[3:])
    for a in it:
        if a in skip:
            next(it)
            if skip[a] is not None:
                args += [a, skip[a]]
        else:
            args.append(a)
    url = f"http://127.0.0.1:{port}"
    with LocalServer([vllm_trn_command(), "serve", str(ckpt), *args], url, tmp_path / "server.log") as server:
        server.wait_healthy()
        log = (tmp_path / "server.log").read_text()
        for want in (
            "tensor_parallel_size=2,",
            "quantization=trn-mxfp4-fp8,",
            "dtype=torch.bfloat16,",
            "max_seq_len=16640,",
        ):
            assert want in log, f"the recipe's server does not run with {want}"
        body = {"model": "mla-trinity", "prompt": "ab" * 300, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        runs = []
        for _ in range(2):
            r = requests.post(url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=300)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert r.json()["usage"]["prompt_tokens"] == 600 and len(choice["token_ids"]) == 16, r.json()
            runs.append(choice["token_ids"])
        assert runs[0] == runs[1], runs
        chat = {"model": "mla-trinity", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        r = requests.post(url + "/v1/chat/completions", json=chat, timeout=300)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text
