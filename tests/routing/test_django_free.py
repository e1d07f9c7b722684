"""The request path's types, the scheduler and the shared Redis contracts load without Django: the planner, a
benchmark or another process reads them with no settings and no database."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]

DJANGO_FREE = (
    "routing.info",  # keys, deployments, endpoints, policies, quotas, prices
    "routing.scheduling.pipeline",  # the scheduler: the request's context, the registry, every built-in plugin
    "routing.contracts",  # the Redis layouts the processes share
    "routing.scheduling.flow",
    "routing.scheduling.disagg",
    "routing.scheduling.load",
    "routing.rendering.dialects",
    "routing.rendering.conversion",
)


@pytest.mark.parametrize("module", DJANGO_FREE)
def test_it_imports_no_django(module):
    probe = (
        f"import sys, {module}\n"
        "loaded = sorted(n for n in sys.modules if n.split('.')[0] in ('django', 'rest_framework', 'channels'))\n"
        "print(loaded[:5])\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    env = {"PATH": "/usr/bin:/bin"}  # no DJANGO_SETTINGS_MODULE, no database
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, (module, done.stdout, done.stderr[-2000:])


def test_a_policy_and_a_deployment_are_built_without_a_database():
    probe = (
        "from routing.info import DeploymentInfo, EndpointInfo, PolicyInfo, NO_POLICY\n"
        "e = EndpointInfo(id=1, name='e', url='http://e', role='both', pool_id=1)\n"
        "d = DeploymentInfo(1, 'd', 'd', 4096, 16, PolicyInfo(mode='least_loaded'), (e,), 0)\n"
        "assert d.policy.prefix_weight == 3.0 and NO_POLICY.mode == 'round_robin' and not d.has_prefill_pool\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env={}, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
