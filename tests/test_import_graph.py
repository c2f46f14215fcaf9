"""The house's import graph, as installed: arrows run down the layers and never close a cycle; deploy/ never
imports tests/.

`pyproject.toml` installs `model_executors/`, `kernels/` and `loaders/` as subpackages of `vllm_trn_plugin`
(setuptools `package-dir`), so tools that read the source tree see three unrelated top-level folders and no arrows
between them. This test reads the same mapping, names every module as it is imported once installed, and parses every
import statement, at module level or inside a function (a lazy import is still an arrow). It fails on:
- a module in no layer below (a new subpackage or top-level module must be placed);
- an import into a higher layer, or across to another group of the same layer;
- a cycle among modules, however long.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml takes Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top. A module imports only from its own group (the same subpackage, or itself) and from lower layers.
# "" is the package's own __init__ (`register()`, vLLM's entry point).
LAYERS: list[tuple[str, ...]] = [
    ("envs", "native", "compat", "models"),  # switches, the C build, the installed vLLM build, the models table
    ("kernels", "configs"),  # ops (torch paths, NKI kernels, the emulator); the models' config classes
    ("loaders",),  # checkpoint formats
    ("model_executors",),  # vLLM model classes and cache managers
    ("engine_checks", "neuron", "demo", "tools"),  # vLLM config hooks, the Neuron entry, checkpoint tools
    ("gate",),  # the fidelity gate, and its tie rule (which the load generator's soak judges streams by)
    ("bench",),  # the load generator
    ("cli", ""),  # the command line; registration
]
PACKAGE = "vllm_trn_plugin"


def installed_modules() -> dict[str, Path]:
    """Every module of the installed package by its dotted name, with its source file."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs: dict[str, str] = tool["package-dir"]
    modules = {}
    for pkg in tool["packages"]:
        top = max((p for p in dirs if pkg == p or pkg.startswith(p + ".")), key=len)
        folder = ROOT / dirs[top] / pkg[len(top) :].lstrip(".").replace(".", "/")
        for f in sorted(folder.glob("*.py")):
            modules[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return modules


def imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, anywhere in its source."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if path.stem == "__init__" else name.split(".")[:-1]
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in modules and m != name}


def group(name: str) -> str:
    """The first name below the package: its subpackage or top-level module ("" for the package itself)."""
    return name.removeprefix(PACKAGE).lstrip(".").split(".")[0]


def layer(g: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if g in names)


def graph() -> dict[str, set[str]]:
    modules = installed_modules()
    return {m: imports(m, p, modules) for m, p in modules.items()}


def test_every_module_has_a_layer() -> None:
    placed = {g for names in LAYERS for g in names}
    unplaced = sorted({group(m) for m in graph()} - placed)
    assert not unplaced, f"place these in LAYERS (tests/test_import_graph.py): {unplaced}"


def test_imports_run_down_the_layers() -> None:
    wrong = [
        f"{m} -> {t}"
        for m, targets in graph().items()
        for t in sorted(targets)
        if group(m) != group(t) and layer(group(t)) >= layer(group(m))
    ]
    assert not wrong, "imports into a higher layer or across one:\n" + "\n".join(wrong)


def test_no_import_cycle() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t) :] + [t]))
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_graph_sees_the_mapped_folders() -> None:
    """The walk itself: the mapped folders' modules are there under their installed names, and their arrows seen."""
    edges = graph()
    assert f"{PACKAGE}.kernels.fp8" in edges and f"{PACKAGE}.loaders.packed" in edges
    assert f"{PACKAGE}.kernels.fp8" in edges[f"{PACKAGE}.model_executors.mxfp4_fp8"]
    assert f"{PACKAGE}.model_executors.mxfp4_fp8" in edges[f"{PACKAGE}.model_executors.mxfp4_fp8_config"]  # lazy


def test_deploy_imports_no_tests() -> None:
    """deploy/'s scripts ship beside the package and run without the test tree."""
    wrong = [
        f"{f.relative_to(ROOT)}: {name}"
        for f in sorted((ROOT / "deploy").rglob("*.py"))
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in ([node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])
        if name == "tests" or name.startswith("tests.")
    ]
    assert not wrong, "deploy/ imports the tests:\n" + "\n".join(wrong)
