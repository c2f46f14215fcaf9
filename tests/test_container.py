"""The CPU development container (deploy/cpu/Dockerfile): built, `make serve` answering /health and
/v1/completions, and `make test-cpu` passing inside it on CONTAINER_TESTS, all through deploy/cpu/build-and-run.sh.

CONTAINER_TESTS (the README names the same selection): the registration tests and one exactness test per model on
vLLM's default compiled mode, which inside the image needs its g++, Python headers and libnuma: Laplace's session
engine against the plain PyTorch forward, MLA-Trinity's against transformers. Not the whole of `make test` (the
suite takes ~40 min on 2 cores, and its vLLM 0.29 part first builds .venv-vllm029 from a package index):
`docker run --rm --shm-size 4g IMAGE make test` runs that, by hand.

Runs where a container engine works and the base image is available; otherwise it skips, naming what
is missing. Environment:
  VLLM_TRN_CONTAINER_ENGINE  podman | docker (default: podman if installed, else docker)
  VLLM_TRN_CONTAINER_BASE    base image (default python:3.11-slim-bookworm, pulled if absent); on a host
                             without a registry, the image `build-and-run.sh --debootstrap` imports:
                             localhost/vllm-trn-base:bookworm
  VLLM_TRN_CONTAINER_OPTS    further build-and-run.sh options, e.g. on a host like this project's
                             sandbox: "--wheels /opt/wheels --ca-bundle /etc/ssl/certs/ca-certificates.crt
                             --runtime runc --ulimit nofile=20000:20000 --ulimit nproc=4096:4096"
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy" / "cpu" / "build-and-run.sh"
DEFAULT_BASE = "python:3.11-slim-bookworm"
CONTAINER_TESTS = (
    "tests/test_registration.py",
    "tests/test_laplace_vllm.py::test_greedy_equals_plain_pytorch_forward",
    "tests/test_trinity_vllm.py::test_greedy_64_steps_equal_transformers_batched_and_alone",
)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _engine() -> str:
    """A container engine that answers, or a skip naming why there is none."""
    wanted = os.environ.get("VLLM_TRN_CONTAINER_ENGINE")
    if wanted:
        if shutil.which(wanted) is None:
            pytest.skip(f"VLLM_TRN_CONTAINER_ENGINE={wanted}, but {wanted} is not on PATH")
        engine = wanted
    elif shutil.which("podman"):
        engine = "podman"
    elif shutil.which("docker"):
        engine = "docker"
    else:
        pytest.skip("no container engine: neither podman nor docker is on PATH")
    try:
        info = subprocess.run([engine, "info"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.skip(f"`{engine} info` did not answer within 20 s")
    if info.returncode != 0:
        what = "its daemon is unreachable" if engine == "docker" else "it does not work here"
        pytest.skip(f"{engine} is installed but {what}: `{engine} info`: {_last_line(info.stderr)}")
    return engine


def _base(engine: str) -> str:
    """The base image, present locally (pulled if needed), or a skip naming why it is not."""
    base = os.environ.get("VLLM_TRN_CONTAINER_BASE", DEFAULT_BASE)
    if subprocess.run([engine, "image", "inspect", base], capture_output=True, timeout=30).returncode == 0:
        return base
    hint = (
        "; set VLLM_TRN_CONTAINER_BASE to a local Debian bookworm image "
        "(deploy/cpu/build-and-run.sh --debootstrap imports localhost/vllm-trn-base:bookworm)"
    )
    try:
        pull = subprocess.run([engine, "pull", base], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip(f"base image {base} is not local and `{engine} pull` did not finish within 300 s{hint}")
    if pull.returncode != 0:
        pytest.skip(f"base image {base} is not local and cannot be pulled: {_last_line(pull.stderr)}{hint}")
    return base


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cpu_container_builds_serves_and_tests() -> None:
    engine = _engine()
    base = _base(engine)
    cmd = [
        "bash", str(SCRIPT),
        "--engine", engine,
        "--base", base,
        "--port", str(_free_port()),
        "--make-test", shlex.join(["-q", "-rA", "-p", "no:cacheprovider", *CONTAINER_TESTS]),
        *shlex.split(os.environ.get("VLLM_TRN_CONTAINER_OPTS", "")),
    ]  # fmt: skip
    # A first build installs vLLM's CPU stack (~10 min on 2 cores); later builds reuse its layers
    # until a file of the repository changes.
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=5400)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"{shlex.join(cmd)} failed (exit {run.returncode}):\n{out[-6000:]}"
    assert "/health: 200" in out
    assert "/v1/completions: 8 tokens" in out
    assert "make test-cpu passed" in out  # CONTAINER_TESTS, run by `make test-cpu` inside the image
    for test in CONTAINER_TESTS[1:]:  # the engine tests ran (-rA lists each), not skipped
        assert f"PASSED {test}" in out, f"{test} did not pass inside the image:\n{out[-6000:]}"
