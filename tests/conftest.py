"""Session-wide checkpoints, references and the one vLLM engine / server the tests share.

vLLM takes 30-60 s to start on these machines, so every test that needs an engine uses the
session's single `laplace_llm` (float32, compiled mode, small state pool, small token budget so
long prompts are prefilled in chunks) and every HTTP test the single `laplace_server`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch

from tests.helpers import MAX_NUM_SEQS, POOL_SLOTS, PROBE_TOKENS, PROBES, TOKEN_BUDGET, greedy_params, token_prompts
from tests.references.laplace import LaplaceReference


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


@dataclass
class Engine:
    llm: object
    fresh_probe_outputs: list


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
