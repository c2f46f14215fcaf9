# Two commands do all the set-up: `make serve` and `make test` (see README).
VENV ?= .venv
VENV_VLLM029 ?= .venv-vllm029
DEMO_MODEL ?= laplace
DEMO ?= demo-$(DEMO_MODEL)
MODEL ?= $(DEMO)
PORT ?= 8000
PYTEST_ARGS ?=

$(VENV)/.setup-done: pyproject.toml deploy/setup.sh
	VENV=$(VENV) bash deploy/setup.sh

setup: $(VENV)/.setup-done

$(DEMO)/config.json: | $(VENV)/.setup-done
	$(VENV)/bin/vllm-trn demo $(DEMO_MODEL) $(DEMO)

serve: $(VENV)/.setup-done $(if $(filter $(DEMO),$(MODEL)),$(DEMO)/config.json)
	$(VENV)/bin/vllm-trn serve $(MODEL) --port $(PORT) $(SERVE_ARGS)

# What the tests need beyond the set-up: AWS's nki-library test harness, which tests/test_nki_library.py runs with the
# project's NKI emulator as its CPU simulator (its own dependencies: the nki-library extra).
$(VENV)/.test-extras-done: $(VENV)/.setup-done
	$(VENV)/bin/python -m pip --disable-pip-version-check -q install -e ".[nki-library]"
	touch $@

# The suite in two parts, each on the vLLM it is about: the CPU serving path on vLLM 0.32 (.venv), and the device
# contract (tests marked `neuron`) on vLLM 0.29, the vLLM that vLLM Neuron GA runs (.venv-vllm029), with one exactness
# test per model and the kernel-op checks beside it. Both parts run; either failing fails `make test`.
test: $(VENV)/.test-extras-done $(VENV_VLLM029)/.setup-done
	@$(MAKE) --no-print-directory test-cpu; cpu=$$?; $(MAKE) --no-print-directory test-vllm029; v029=$$?; \
	[ $$cpu -eq 0 ] && [ $$v029 -eq 0 ]

test-cpu: $(VENV)/.test-extras-done
	$(VENV)/bin/python -m pytest -m "not neuron" $(PYTEST_ARGS)

lint: $(VENV)/.setup-done
	$(VENV)/bin/ruff check .

# vLLM 0.29, what vLLM Neuron GA runs, beside 0.32: its environment (deploy/setup_vllm029.sh) and what runs there,
# the device contract and one exactness test per model against its independent reference.
VLLM029_TESTS ?= tests/test_neuron_contract.py tests/test_neuron_sampling.py tests/test_kernel_ops.py \
	tests/test_laplace_vllm.py::test_greedy_equals_plain_pytorch_forward \
	tests/test_trinity_vllm.py::test_greedy_64_steps_equal_transformers_batched_and_alone

$(VENV_VLLM029)/.setup-done: pyproject.toml deploy/setup.sh deploy/setup_vllm029.sh
	VENV=$(VENV_VLLM029) bash deploy/setup_vllm029.sh

setup-vllm029: $(VENV_VLLM029)/.setup-done

test-vllm029: $(VENV_VLLM029)/.setup-done
	$(VENV_VLLM029)/bin/python -m pytest $(VLLM029_TESTS) $(PYTEST_ARGS)

.PHONY: setup serve test test-cpu lint setup-vllm029 test-vllm029
