# The two commands a new user needs: `make run` and `make test`. Each does all of its own set-up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test install engine-env browser lint clean

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

## Run the whole test suite against real PostgreSQL, Redis and engines (simulator and vLLM).
test: $(STAMP) engine-env browser
	PLATFORM_STATE_DIR=$${PLATFORM_STATE_DIR:-.local/test} PLATFORM_REDIS_PERSIST=0 $(PY) -m inference_platform.devstack exec -- $(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

## Lock the dependency set after changing pyproject.toml.
lock: $(STAMP)
	$(PY) -m pip install --quiet uv
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --python-version 3.11 -o requirements.lock

clean:
	rm -rf $(VENV) .local staticfiles
