"""Session-wide checkpoints, references and the one vLLM engine / server the tests share.

vLLM takes 30-60 s to start on these machines, so every test that needs the Laplace engine uses the
session's single `laplace_llm` (float32, compiled mode, small state pool, small token budget so
long prompts are prefilled in chunks) and every HTTP test one `vllm-trn serve` per demo model and dtype
(`servers`). Shared helpers live in tests/helpers.py.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers import PROBE_TOKENS, PROBES, greedy_params, laplace_engine, token_prompts
from tests.references.laplace import LaplaceReference
from vllm_trn_plugin.bench.local import LocalServer, serve_new_demo


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
    llm = laplace_engine(laplace_ckpt)
    fresh = [llm.generate(token_prompts([p]), greedy_params(PROBE_TOKENS), use_tqdm=False)[0] for p in PROBES]
    yield Engine(llm, fresh)
    del llm


@dataclass
class Server:
    url: str
    model: str  # the served model name: what clients send
    proc: subprocess.Popen
    log: Path
    checkpoint: Path
    shutdown_timeout: int  # --shutdown-timeout: how long a SIGTERM lets requests in flight finish
    local: LocalServer  # the process group, for stopping it


class _Servers:
    """`vllm-trn serve` per demo model, started on first use and shared by the whole session."""

    def __init__(self, root: Path) -> None:
        self.root, self.running = root, {}

    def get(self, model: str, dtype: str = "bfloat16") -> Server:
        if (model, dtype) not in self.running:
            self.running[model, dtype] = _start_server(self.root, model, dtype)
        return self.running[model, dtype]

    def stop(self) -> None:
        for s in self.running.values():
            s.local.stop()


def _start_server(root: Path, model: str, dtype: str) -> Server:
    """The demo checkpoint in `dtype` (bf16: as `make serve` serves it; --dtype explicitly, checked in the engine's
    config line), eager mode (the engine tests cover compiled mode); a server that exits, is not healthy within
    600 s or does not run in `dtype` raises with its log's tail."""
    # As the trn2 recipes serve: under a name of its own, tool calls in the chat template's Hermes format, and a
    # SIGTERM drains the requests in flight (up to the timeout) before the server exits.
    name, shutdown_timeout = f"demo-{model}", 300
    extra = ["--max-model-len", "4096", "--served-model-name", name, "--enable-auto-tool-choice"]
    extra += ["--tool-call-parser", "hermes", "--shutdown-timeout", str(shutdown_timeout)]
    local = serve_new_demo(model, root, dtype, extra=extra).wait_healthy(600)
    return Server(local.url, local.model, local.proc, local.log, local.checkpoint, shutdown_timeout, local)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (by fixture parameter), which would undo this
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that stop a session server run last (in their order), so that every other test still has it."""
    items.sort(key=lambda item: item.get_closest_marker("stops_server") is not None)


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> _Servers:
    s = _Servers(tmp_path_factory.mktemp("servers"))
    yield s
    s.stop()
