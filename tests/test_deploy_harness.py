"""deploy/harness.py: a benchmark's provenance line names an uncommitted change in any folder the plugin installs from
(kernels/ included: it once listed the folders by hand and left that one out)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def harness():  # noqa: ANN201  (the module)
    spec = importlib.util.spec_from_file_location("harness", ROOT / "deploy" / "harness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_plugin_state_sees_a_change_in_every_installed_folder(tmp_path: Path) -> None:
    h = harness()
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    folders = h.plugin_folders(tmp_path)
    assert {"vllm_trn_plugin", "model_executors", "kernels", "loaders"} <= set(folders)

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    for d in folders + ["docs"]:
        (tmp_path / d).mkdir()
        (tmp_path / d / "x.py").write_text("a = 1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    assert h.plugin_state(tmp_path).endswith(", clean")
    (tmp_path / "docs" / "x.py").write_text("a = 2\n")  # not the plugin's source
    assert h.plugin_state(tmp_path).endswith(", clean")
    for d in folders:
        (tmp_path / d / "x.py").write_text("a = 2\n")
        assert f"{d}/x.py" in h.plugin_state(tmp_path), d
        git("checkout", "-q", "--", d)


_PROBE = """
import json, torch
from vllm_trn_plugin.kernels import fp8_cpu
print(json.dumps({
    "amx": torch.cpu._is_amx_tile_supported(),
    "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
    "aten": torch.backends.cpu.get_cpu_capability(),
    "isas": list(fp8_cpu.isas()),
}))
"""


@pytest.mark.parametrize("cap", ["avx512", "avx2"])
def test_isa_cap_reaches_a_fresh_process(cap: str) -> None:
    """bench_packed_decode --cap-isa: every process the benchmark starts (engine core, workers) computes as the
    capped CPU, vLLM's AMX probe included (left at the truth, vLLM picks AMX GEMMs that capped oneDNN aborts)."""
    import json
    import sys

    spec = importlib.util.spec_from_file_location("isa_cap", ROOT / "deploy" / "isa_cap" / "__init__.py")
    isa_cap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(isa_cap)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=isa_cap.cap_env(cap), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["amx"] is False
    assert "amx-bf16" not in seen["isas"]
    if cap == "avx512":
        assert set(seen["isas"]) <= {"avx512-bf16"}
    else:
        assert seen == {"amx": False, "avx512_bf16": False, "aten": seen["aten"], "isas": []}
        assert seen["aten"] in ("AVX2", "DEFAULT"), seen
    with pytest.raises(ValueError, match="ISA cap 'avx1'"):
        isa_cap.cap_env("avx1")
