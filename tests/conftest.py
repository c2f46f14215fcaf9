"""Session-wide checkpoints, references and the one vLLM engine / server the tests share.

vLLM takes 30-60 s to start on these machines, so every test that needs an engine uses the
session's single `laplace_llm` (float32, compiled mode, small state pool, small token budget so
long prompts are prefilled in chunks) and every HTTP test the single `laplace_server`.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch

from tests.laplace_reference import LaplaceReference

POOL_SLOTS = 40  # state pages in the session engine's pool
MAX_NUM_SEQS = 64  # more than the pool holds: admission is limited by free pages
TOKEN_BUDGET = 256  # max_num_batched_tokens: prompts longer than this are prefilled in chunks


@pytest.fixture(scope="session")
def laplace_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_trn_plugin.demo import write_laplace_demo

    return write_laplace_demo(tmp_path_factory.mktemp("laplace-f32"), seed=1, dtype=torch.float32)


@pytest.fixture(scope="session")
def laplace_ref(laplace_ckpt: Path) -> LaplaceReference:
    return LaplaceReference(laplace_ckpt)


@pytest.fixture(scope="module")
def one_torch_thread():  # noqa: ANN201
    """Small ops dominate the checkpoint-tool tests; on a shared 2-core host OpenMP's second thread mostly waits."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def read_safetensors_dir(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in d."""
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def random_prompts(n: int, lengths: list[int], seed: int, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


# Probes run first on the fresh engine, and again after the other tests have reused every slot.
PROBES = random_prompts(3, [9, 200, 300], seed=99)
PROBE_TOKENS = 12


@dataclass
class Engine:
    llm: object
    fresh_probe_outputs: list


def greedy_params(max_tokens: int, logprobs: int = 2):  # noqa: ANN201
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=True)


def greedy_logits(
    llm: object, prompts: list[list[int]], steps: int, vocab: int
) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy tokens and the full logits [steps, vocab] each was chosen from (an engine built with
    `max_logprobs=vocab` and `logprobs_mode="raw_logits"`)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0.0, logprobs=vocab, ignore_eos=True)
    out = []
    for o in llm.generate(token_prompts(prompts), params, use_tqdm=False):
        c = o.outputs[0]
        logits = torch.full((len(c.token_ids), vocab), -math.inf, dtype=torch.float64)
        for i, top in enumerate(c.logprobs):
            for tok, lp in top.items():
                logits[i, tok] = lp.logprob
        out.append((list(c.token_ids), logits))
    return out


def count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Wrap module.name so its calls are counted (calls[0]): proves a path really ran."""
    calls = [0]
    original = getattr(module, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@contextlib.contextmanager
def worker_functions_allowed() -> Iterator[None]:
    """While open, `LLM.apply_model` may ship a function to vLLM's worker process (vLLM refuses to serialise
    functions otherwise); the engine must be created inside it, as its processes read the switch at start.

    The CPU thread binding is the plugin's to choose inside (engine_checks.bind_cpu_workers, for an engine of two
    workers) and is put back as it was on exit, so that later engines in the session choose their own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        mp.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        yield


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="session")
def laplace_llm(laplace_ckpt: Path) -> Engine:
    from vllm import LLM

    cfg = LaplaceReference(laplace_ckpt).cfg
    page = (
        cfg["num_hidden_layers"]
        * 4
        * (cfg["num_heads"] * cfg["head_k_dim"] * cfg["head_v_dim"] + (cfg["conv_size"] - 1) * cfg["hidden_size"])
    )
    llm = LLM(
        model=str(laplace_ckpt),
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=TOKEN_BUDGET,
        kv_cache_memory_bytes=POOL_SLOTS * page,
        disable_log_stats=False,
        seed=0,
    )
    fresh = [llm.generate(token_prompts([p]), greedy_params(PROBE_TOKENS), use_tqdm=False)[0] for p in PROBES]
    yield Engine(llm, fresh)
    del llm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    model: str
    proc: subprocess.Popen
    log: Path


class _Servers:
    """`vllm-trn serve` per demo model, started on first use and shared by the whole session."""

    def __init__(self, root: Path) -> None:
        self.root, self.running = root, {}

    def get(self, model: str, dtype: str = "bfloat16") -> Server:
        if (model, dtype) not in self.running:
            self.running[model, dtype] = _start_server(self.root / f"{model}-{dtype}", model, dtype)
        return self.running[model, dtype]

    def stop(self) -> None:
        for s in self.running.values():
            s.proc.terminate()
            try:
                s.proc.wait(30)
            except subprocess.TimeoutExpired:
                s.proc.kill()


def _start_server(root: Path, model: str, dtype: str) -> Server:
    """The demo checkpoint in `dtype` (bf16: as `make serve` serves it), eager mode (the engine tests cover compiled
    mode)."""
    root.mkdir(parents=True)
    ckpt = root / f"demo-{model}"
    vllm_trn = str(Path(sys.executable).parent / "vllm-trn")  # the installed console command
    subprocess.run([vllm_trn, "demo", model, str(ckpt), "--dtype", dtype], check=True)
    port = _free_port()
    log = root / "server.log"
    cmd = [vllm_trn, "serve", str(ckpt), "--port", str(port)]
    # --dtype explicitly: vLLM serves a float32 checkpoint in bf16 unless told otherwise.
    cmd += ["--host", "127.0.0.1", "--enforce-eager", "--max-model-len", "4096", "--dtype", dtype]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            pytest.fail(f"vllm-trn serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                if f"dtype=torch.{dtype}," not in log.read_text():  # the engine's config line
                    proc.kill()
                    pytest.fail(f"vllm-trn serve of {ckpt} does not run in {dtype}: see {log}")
                return Server(url, str(ckpt), proc, log)
        except requests.ConnectionError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"vllm-trn serve did not become healthy in 600 s:\n{log.read_text()[-4000:]}")
        time.sleep(1)


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> _Servers:
    s = _Servers(tmp_path_factory.mktemp("servers"))
    yield s
    s.stop()
