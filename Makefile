# The README's two commands: `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/gateway: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,litellm,otlp,tokenize]'
	touch $(BIN)/gateway

# The OpenAI Node SDK, for the test that a bad key is an AuthenticationError in every client (skipped, saying why,
# where node is not installed). An existing install is kept, so setup stays idempotent.
NODE_SDK := .node/node_modules/openai/package.json

$(NODE_SDK):
	@if command -v npm >/dev/null 2>&1; then npm install --prefix .node --no-audit --no-fund --silent openai@6; \
	else echo "npm not found: the OpenAI Node SDK test will be skipped"; fi

setup: $(BIN)/gateway $(NODE_SDK)

demo: setup
	$(BIN)/gateway demo

# lint (ruff), types (mypy --strict on gateway/, configured in pyproject.toml), then the whole suite on two workers
# (pytest-xdist; --dist loadfile keeps each file, and its module-scoped servers, on one worker)
test: setup
	$(BIN)/ruff check gateway gateway_lab tests loadtests
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -x -n 2 --dist loadfile tests

.PHONY: setup demo test

# The agent CLIs (Claude Code, Codex) as shipped, pinned in tests/e2e/agents/pins.json: installed from npm into
# ~/.cache/inference-gateway/agent-clis (the tier in tests/e2e/agents installs them on first use too).
agent-clis: setup
	$(BIN)/python -m tests.e2e.agents.clis

# The compatibility table of the pinned CLIs (written to docs/results/), and the same for each CLI's newest release:
# a report of drift that never fails the build.
agent-compat: setup
	$(BIN)/python -m tests.e2e.agents.compat --out docs/results/$$(date +%F)-agent-clis.md

agent-drift: setup
	$(BIN)/python -m tests.e2e.agents.compat --newest

.PHONY: agent-clis agent-compat agent-drift

# The engine tier (tests/engines, docs/engines.md): real SGLang 0.5.23 and 0.5.13.post1 (and vLLM 0.32) on the CPU
# behind the gateway, and the simulator compared with SGLang; every SGLang test runs once per release. Installs the
# engine environments into ~/.cache/inference-gateway/engines on first use (minutes; cached by version), then runs
# the tier; a missing environment is a failure here, never a skip. `make engine-test ENGINE=sglang==0.5.13.post1`
# runs it against one release (each starts with the page size its CPU path serves, read back from the servers:
# docs/engines.md).
comma := ,
ENGINE ?= sglang==0.5.23,sglang==0.5.13.post1
VLLM ?= vllm==0.32.0
engine-test: setup
	$(BIN)/python -m gateway_lab.engines install $(subst $(comma), ,$(ENGINE)) $(VLLM)
	GATEWAY_ENGINE_TESTS=1 GATEWAY_ENGINE_SGLANG=$(ENGINE) GATEWAY_ENGINE_VLLM=$(VLLM) \
		$(BIN)/python -m pytest -q tests/engines
