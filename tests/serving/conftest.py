"""Engines for the serving tests: started once per test session, stopped at its end."""

from __future__ import annotations

import pytest

from .engines import RunningEngine


@pytest.fixture(params=["sim", "vllm"])
def engine(request) -> RunningEngine:
    """Each conformance test runs once against the simulator and once against real vLLM."""
    return request.getfixturevalue(f"{request.param}_engine")
