# Two entry points: `make demo` and `make test`. Each creates .venv in the repo
# root and installs into it when needed (re-runs only when the inputs change).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.raykv-installed
PYTEST_ARGS ?=

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements/cpu.txt
	$(BIN)/python -m pip install -q -e '.[test]'
	# PyPI's torchvision/torchaudio/torchcodec break `import vllm` beside the
	# CPU torch; text models need none of them.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/raykv demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
