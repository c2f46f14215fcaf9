# Two commands do all the set-up: `make serve` and `make test` (see README).
VENV ?= .venv
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

test: $(VENV)/.setup-done
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.setup-done
	$(VENV)/bin/ruff check .

.PHONY: setup serve test lint
