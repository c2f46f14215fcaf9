"""Local servers for the tests, the soak and the benchmark scripts: a `vllm-trn serve` (or any server command) in
its own process group, waited for on /health and always stopped with its whole group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


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
