"""Local processes for the tests, the soak and the benchmark scripts: a `vllm-trn serve` (or any server command)
in its own process group, waited for on /health and always stopped with its whole group; an engine in a child
process driven by JSON lines (`EngineChild`, `answer`); a benchmark's scratch directory and result file; which
plugin source a run used (`plugin_state`)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
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
    """`cmd` started in a new session, its output in `log`; `url` is ready once GET {url}{health} answers 200.
    `model`: the model name it serves (from `checkpoint`, a vLLM server's); `dtype`: the dtype a vLLM server must
    report in its log (checked once healthy).

    Use as a context manager, or call stop(): SIGTERM to the process group, SIGKILL after `grace` s.
    """

    def __init__(
        self,
        cmd: list[str],
        url: str,
        log: Path,
        env: dict[str, str] | None = None,
        health: str = "/health",
        model: str | None = None,
        dtype: str | None = None,
        checkpoint: Path | None = None,
    ) -> None:
        self.cmd, self.url, self.log, self.health = cmd, url, Path(log), health
        self.model, self.dtype, self.checkpoint = model, dtype, checkpoint
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
        """Wait for the health check; raise with the log's tail when the process exits first, when it is not
        healthy within `timeout` s, or when it does not serve `dtype` (the process is stopped then)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{' '.join(self.cmd)} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + self.health, timeout=2) as r:
                    if r.status == 200:
                        self._check_dtype()
                        return self
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"{self.url} not healthy after {timeout:.0f} s:\n{self.tail()}")

    def _check_dtype(self) -> None:
        if self.dtype is not None and f"dtype=torch.{self.dtype}," not in self.log.read_text(errors="replace"):
            self.stop()  # vLLM's engine config line names the dtype it runs in
            raise RuntimeError(f"{' '.join(self.cmd)} does not serve in {self.dtype}: see {self.log}")

    def tail(self, n: int = 4000) -> str:
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
    dtype: str | None = None,
) -> LocalServer:
    """`vllm-trn serve CKPT` on 127.0.0.1 (eager, max-model-len 2048 unless `extra` says otherwise); with
    `dtype`, `--dtype DTYPE` (vLLM serves a float32 checkpoint in bf16 unless told) and the check that it
    runs in it. Its model name: `--served-model-name` in `extra`, else the checkpoint path."""
    port = port or free_port()
    extra = list(extra or [])
    cmd = [vllm_trn_command(), "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port)]
    if "--max-model-len" not in extra:
        cmd += ["--max-model-len", "2048"]
    if "--no-enforce-eager" not in extra:
        cmd += ["--enforce-eager"]
    else:
        extra.remove("--no-enforce-eager")
    if dtype is not None:
        cmd += ["--dtype", dtype]
    name = extra[extra.index("--served-model-name") + 1] if "--served-model-name" in extra else str(ckpt)
    url = f"http://127.0.0.1:{port}"
    return LocalServer(cmd + extra, url, log, env, model=name, dtype=dtype, checkpoint=Path(ckpt))


def serve_new_demo(
    model: str,
    root: Path,
    dtype: str,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> LocalServer:
    """`vllm-trn demo MODEL` in `dtype` (under `root`, written once) served by `serve_demo` in that dtype,
    its log beside it."""
    ckpt = Path(root) / f"demo-{model}-{dtype}"
    if not (ckpt / "config.json").exists():
        subprocess.run([vllm_trn_command(), "demo", model, str(ckpt), "--dtype", dtype], check=True)
    return serve_demo(ckpt, Path(root) / f"{model}-{dtype}.log", extra=extra, env=env, dtype=dtype)


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
