"""Engines for the serving tests: started once per test session, stopped at its end."""

from __future__ import annotations

import pytest

from .engines import ENGINE_PYTHON, RunningEngine, start_engine


@pytest.fixture(scope="session")
def sim_engine() -> RunningEngine:
    engine = start_engine("sim")
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def vllm_engine() -> RunningEngine:
    if not ENGINE_PYTHON.exists():
        pytest.fail(f"no engine environment at {ENGINE_PYTHON}: run scripts/engine-env.sh (make test does)")
    engine = start_engine("vllm")
    yield engine
    engine.stop()


@pytest.fixture(params=["sim", "vllm"])
def engine(request) -> RunningEngine:
    """Each conformance test runs once against the simulator and once against real vLLM."""
    return request.getfixturevalue(f"{request.param}_engine")
