"""Local processes for benchmark scripts: a `vllm-trn serve` (or any server command) in its own process
group, waited for on /health and always stopped with its whole group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_trn_command() -> str:
    """The `vllm-trn` console script next to this interpreter."""
    return str(Path(sys.executable).parent / "vllm-trn")


class LocalServer:
    """`cmd` started in a new session; `url` is ready once GET {url}{health} answers 200.

    Use as a context manager, or call stop(): SIGTERM to the process group, SIGKILL after `grace` s.
    """

    def __init__(
        self,
        cmd: list[str],
        url: str,
        log: Path,
        env: dict[str, str] | None = None,
        health: str = "/health",
    ) -> None:
        self.cmd, self.url, self.log, self.health = cmd, url, Path(log), health
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                start_new_session=True,
            )

    def wait_healthy(self, timeout: float = 600.0) -> LocalServer:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[0]} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + self.health, timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"{self.url} not healthy after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self, grace: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_demo(
    ckpt: str | Path,
    log: Path,
    port: int | None = None,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> LocalServer:
    """`vllm-trn serve CKPT` on 127.0.0.1 (eager, max-model-len 2048 unless `extra` says otherwise)."""
    port = port or free_port()
    extra = list(extra or [])
    cmd = [vllm_trn_command(), "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port)]
    if "--max-model-len" not in extra:
        cmd += ["--max-model-len", "2048"]
    if "--no-enforce-eager" not in extra:
        cmd += ["--enforce-eager"]
    else:
        extra.remove("--no-enforce-eager")
    return LocalServer(cmd + extra, f"http://127.0.0.1:{port}", log, env)


def worker_memory(model: Any) -> dict[str, int]:
    """For `LLM.apply_model` (a function its workers can import): the bytes of the parameters the worker holds, of
    its routed experts, its anonymous resident memory (RssAnon) and its peak RSS (VmHWM, file pages included)."""
    status = {}
    for line in open("/proc/self/status"):
        if line.startswith(("Vm", "Rss")):
            status[line.split(":")[0]] = int(line.split()[1]) * 1024
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if ".experts." in n and (".w13_" in n or ".w2_" in n)
    )
    return {"param_bytes": params, "expert_bytes": experts, "rss_anon": status["RssAnon"], "peak_rss": status["VmHWM"]}
