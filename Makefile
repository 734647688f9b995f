# The two quick-start commands are `make demo` and `make test`; both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-slow lint bench model clean

setup: $(VENV)/.installed

# torch is pinned to the CPU build that lies on this machine's disk; the package itself accepts torch>=2.6.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	@# the evaluation sandbox isolates model-written code with bubblewrap where it can be installed
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get install -y -q bubblewrap >/dev/null 2>&1; } || \
	  echo "note: bubblewrap is not installed; the sandbox falls back to process limits (apt-get install bubblewrap)"
	touch $@

# The demo: the shipped model (clover/weights/clover-tiny) checks its own invariants, answers a chat
# turn that offers tools (examples/tools.json) with the denoising steps shown, and continues code with
# block diffusion and with lossless verify decoding (the same text as ar). Fixed prompts, greedy.
demo: setup
	$(BIN)/clover check clover/weights/clover-tiny --dtype float32
	$(BIN)/clover generate --chat 'What is the weather in Oslo?' --tools examples/tools.json --no-think \
	  --max-new-tokens 64 --show-steps
	$(BIN)/clover generate 'def fibonacci(n):' --max-new-tokens 64 --show-steps
	$(BIN)/clover generate 'def fibonacci(n):' --max-new-tokens 64 --algorithm verify --show-steps

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python benchmarks/forward.py
	$(BIN)/python benchmarks/decode.py

# Rebuild the shipped model from scratch (measured on 2 cores: 3.2 hours on a Xeon with AMX, 2.7 on an AVX-512 EPYC,
# ~10 estimated on 2 AVX2 cores in fp32);
# rerun to resume after an interruption.
model: setup
	scripts/make_model.sh

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
