# Two entry points for a fresh clone: `make demo` (main job) and `make test` (test suite).
# Each creates its own virtual environment in .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-all install bench-iffn clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/vitblocks compare

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "not slow"

test-all: $(BIN)/.installed
	$(BIN)/python -m pytest -q

bench-iffn: $(BIN)/.installed
	$(BIN)/python benchmarks/iffn_latency.py --compile

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
