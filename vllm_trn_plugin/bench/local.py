"""Local processes for benchmark scripts: a `vllm-trn serve` (or any server command) in its own process
group, waited for on /health and always stopped with its whole group; an engine in a child process driven by
JSON lines (`EngineChild`, `answer`); which plugin source a run used (`plugin_state`)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
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


PROTO = "@@BENCH "  # marks a child's answers among the log lines on its stdout


def answer(obj: dict[str, Any]) -> None:
    """In an `EngineChild`'s process: send one answer to the parent."""
    sys.stdout.write(PROTO + json.dumps(obj) + "\n")
    sys.stdout.flush()


class EngineChild:
    """A child process `cmd` (one vLLM engine) driven by JSON lines on its stdin. Its answers are the stdout lines
    `answer` writes; a thread drains the rest into `log_path` and `log_lines`. `{"cmd": "quit"}` ends it."""

    def __init__(self, label: str, cmd: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> None:
        self.label, self.log_path = label, log_path
        self.log_lines: list[str] = []
        self.answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "PYTHONUNBUFFERED": "1"},
            cwd=str(cwd),
        )
        self._log = open(log_path, "w")  # noqa: SIM115  (closed in close())
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PROTO):
                self.answers.put(json.loads(line[len(PROTO) :]))
            else:
                self._log.write(line)
                self._log.flush()
                self.log_lines.append(line.rstrip("\n"))
        self.answers.put(None)  # EOF

    def wait(self, timeout: float = 7200) -> dict[str, Any]:
        try:
            ans = self.answers.get(timeout=timeout)
        except queue.Empty:
            raise SystemExit(f"{self.label} engine: no answer in {timeout} s; log {self.log_path}") from None
        if ans is None:
            tail = "\n".join(self.log_lines[-40:])
            raise SystemExit(f"{self.label} engine died (rc {self.proc.poll()}); log {self.log_path}:\n{tail}")
        return ans

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def request(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.send(cmd)
        return self.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.proc.wait(timeout=120)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._thread.join(timeout=10)
        self._log.close()

    def grep(self, pattern: str) -> list[str]:
        rx = re.compile(pattern)
        return [line for line in self.log_lines if rx.search(line)]


def plugin_state(repo: Path) -> str:
    """Which plugin source a run used: the commit of `repo` and any uncommitted change in the plugin's packages."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", "model_executors", "vllm_trn_plugin", "loaders"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        dirty = [d.strip() for d in dirty if d.strip()]
        return f"commit {head}" + (f", UNCOMMITTED changes: {dirty}" if dirty else ", clean")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
