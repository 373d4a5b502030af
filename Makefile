# One-command setup: `make demo` and `make test` create .venv on first use and install everything into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvq-installed
PIP := $(BIN)/pip install --prefer-binary --disable-pip-version-check

.PHONY: venv demo test test-fast lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt requirements-data.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(PIP) -c constraints.txt -e '.[serve,kernels,dev]'
	$(PIP) --no-deps -r requirements-data.txt
	touch $@

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/demo.sh

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu and not vllm"

lint: $(STAMP)
	$(BIN)/ruff check kvq tests
	$(BIN)/ruff format --check kvq tests
	$(BIN)/mypy kvq

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
