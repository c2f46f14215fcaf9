"""The benchmark scripts' harness (deploy/ only: run them from the repository root as `.venv/bin/python
deploy/NAME.py`, which puts this folder on the import path): an engine in a child process driven by JSON lines
(`EngineChild`, `answer`), a run's scratch directory and result file, and which plugin source a run used
(`plugin_state`)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PROTO = "@@BENCH "  # marks a child's answers among the log lines on its stdout


def answer(obj: dict[str, Any]) -> None:
    """In an `EngineChild`'s process: send one answer to the parent."""
    sys.stdout.write(PROTO + json.dumps(obj) + "\n")
    sys.stdout.flush()


def start_child_engine(model_dir: str, engine_kw: dict[str, Any]) -> Any:
    """In an `EngineChild`'s process: `vllm.LLM(model_dir, **engine_kw)`, and the first answer, what the engine
    chose (start-up seconds, cache blocks, token budgets, parallelism, compilation). Returns the LLM."""
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, **engine_kw)
    vc = llm.llm_engine.vllm_config
    answer(
        {
            "ready": True,
            "startup_s": time.perf_counter() - t0,
            "block_size": vc.cache_config.block_size,
            "num_blocks": vc.cache_config.num_gpu_blocks,
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "max_in_flight_tokens": vc.max_in_flight_tokens,
            "async_scheduling": bool(getattr(vc.scheduler_config, "async_scheduling", False)),
            "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
            "quantization": vc.model_config.quantization,
            "compilation_mode": getattr(vc.compilation_config.mode, "name", str(vc.compilation_config.mode)),
            # As this process holds it after the engine's config: the plugin sets it for more workers than NUMA
            # nodes (engine_checks.bind_cpu_workers); None means vLLM's "auto".
            "threads_bind_env": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        }
    )
    return llm


def child_commands() -> Iterator[dict[str, Any]]:
    """In an `EngineChild`'s process: the parent's commands, one JSON line each, until {"cmd": "quit"}."""
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            return
        yield cmd


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

    def __enter__(self) -> EngineChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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


@contextlib.contextmanager
def scratch_dir(path: Path | None, prefix: str) -> Iterator[Path]:
    """`path` (created if missing, kept), or a new temporary directory removed afterwards."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        yield Path(d)


def save_result(path: Path, result: dict[str, Any], t_start: float, logs: Path | None = None) -> None:
    """A benchmark's results with its run time since `t_start` (perf_counter) as indented JSON (anything JSON lacks,
    such as paths, as its str), and a line saying where they are."""
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    measured = f" (measurements {result['measure_s'] / 60:.1f} min)" if "measure_s" in result else ""
    print(f"\ntotal {result['total_s'] / 60:.1f} min{measured}; JSON: {path}" + (f"; logs: {logs}" if logs else ""))


def plugin_folders(repo: Path) -> list[str]:
    """The source folders the plugin installs from (pyproject.toml's [tool.setuptools.package-dir] values)."""
    text = (repo / "pyproject.toml").read_text()
    table = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    return sorted(set(re.findall(r'=\s*"([^"]+)"', table)))


def plugin_state(repo: Path) -> str:
    """Which plugin source a run used: the commit of `repo` and any uncommitted change in the plugin's packages."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", *plugin_folders(repo)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        dirty = [d.strip() for d in dirty if d.strip()]
        return f"commit {head}" + (f", UNCOMMITTED changes: {dirty}" if dirty else ", clean")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"


def decode_seconds(outputs: list[Any], tokens: int) -> list[float]:
    """Per request of a vLLM `generate` run with log stats on (RequestOutput.metrics): (last - first token time) /
    (tokens - 1), its seconds per decode step; exits naming the request if it has no metrics or not `tokens`."""
    per = []
    for out in outputs:
        m = out.metrics
        if m is None or len(out.outputs[0].token_ids) != tokens:
            raise SystemExit(f"request {out.request_id}: no metrics or {len(out.outputs[0].token_ids)} tokens")
        per.append((m.last_token_ts - m.first_token_ts) / (tokens - 1))
    return per
