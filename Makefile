# The README's two commands: `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/gateway: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,litellm,otlp]'
	touch $(BIN)/gateway

setup: $(BIN)/gateway

demo: setup
	$(BIN)/gateway demo

test: setup
	$(BIN)/python -m pytest -q -x tests

.PHONY: setup demo test
