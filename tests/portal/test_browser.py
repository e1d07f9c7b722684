"""The portal in headless Chromium (Debian's package, driven by Playwright), against a real server.

The server is uvicorn in a thread of this process, serving the web side's application (the Django pages and
the live-traffic WebSocket, inference_platform/web_asgi.py) over the test database. Screenshots go to test-output/.
"""

from __future__ import annotations

import csv
import io
import json
import socket
import threading
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.db import connections
from django.utils import timezone

from portal.live import QUEUE_KEY
from serving.models import Endpoint, Health, ModelDeployment, ObservedStatus, Pool
from tenants.usage_stream import stream_key, usage_redis
from tests import costs

from ..conftest import make_usage
from .test_live import emit

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
OUTPUT = Path(__file__).resolve().parents[2] / "test-output"


@pytest.fixture
def server(transactional_db, monkeypatch, settings):
    """The portal's pages and WebSocket at http://127.0.0.1:<port>."""
    import uvicorn
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
    from django.core.asgi import get_asgi_application

    from inference_platform.web_asgi import web_application

    # Playwright's sync API runs an event loop in this thread; the ORM calls here are still sequential.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    # The server's threads close their connections after each request, so the test database can be dropped.
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    settings.USAGE_STREAM = "usage:test-browser"
    usage_redis().delete(stream_key())
    # The web side's application, as gunicorn's uvicorn workers serve it; static files from the app folders here.
    app = web_application(ASGIStaticFilesHandler(get_asgi_application()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)
    with connections["default"].cursor() as cursor:  # a connection the server's threads left behind
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    usage_redis().delete(stream_key())


@pytest.fixture
def page(server):
    if not CHROMIUM.exists():
        pytest.fail("no /usr/bin/chromium: `make test` installs Debian's chromium package")
    from playwright.sync_api import sync_playwright

    OUTPUT.mkdir(exist_ok=True)
    with sync_playwright() as p:
        with costs.timed("Chromium"):
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
        page = context.new_page()
        page.set_default_timeout(15_000)
        yield page
        context.close()
        browser.close()


def sign_in(page, server, username: str) -> None:
    page.goto(f"{server}/portal/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", f"pw-{username}-long-enough")
    page.click("button[type=submit]")
    page.wait_for_url(f"{server}/portal/fleet/")


def running_fleet(world) -> None:
    """A deployment whose engines are up, as the local orchestrator would report them."""
    ModelDeployment.objects.filter(pk=world.deployment.pk).update(
        observed_status=ObservedStatus.READY, status_message="2 of 2 engines healthy"
    )
    pool = Pool.objects.get(deployment=world.deployment)
    for n in range(2):
        Endpoint.objects.create(
            pool=pool,
            name=f"tiny-main-{n}",
            url=f"http://127.0.0.1:{18000 + n}",
            role="both",
            health=Health.HEALTHY,
        )
    now = timezone.now()
    for day in range(10):
        for key, scale in ((world.key_a1, 3), (world.key_a2, 1), (world.key_b1, 2)):
            make_usage(
                key,
                f"hist-{day}-{key.api_key.pk}",
                created_at=now - timedelta(days=day, hours=1),
                prompt_tokens=100_000 * scale,
                cached_prompt_tokens=80_000 * scale,
                output_tokens=400 * scale,
                cost=Decimal("0.01") * scale * (day % 4 + 1),
                deployment=world.deployment,
            )


def test_operator_signs_in_creates_a_key_runs_a_report_and_watches_live_traffic(world, server, page):
    running_fleet(world)
    sign_in(page, server, "olive")
    assert page.locator("text=tiny-main-0: healthy").is_visible()
    page.screenshot(path=OUTPUT / "portal-fleet.png", full_page=True)

    # A key for team acme/agents: its secret is on the page once, then never again.
    page.goto(f"{server}/portal/teams/{world.team_a1.pk}/")
    page.fill("#key-form input[name=name]", "browser agent")
    page.click("#key-form button[type=submit]")
    secret = page.locator("#new-key-secret").inner_text()
    assert secret.startswith("ipk_") and page.content().count(secret) == 1
    page.screenshot(path=OUTPUT / "portal-key-created.png", full_page=True)
    page.goto(f"{server}/portal/teams/{world.team_a1.pk}/")
    assert "browser agent" in page.content() and secret not in page.content()
    assert page.locator("#new-key-secret").count() == 0

    # A report by team for this month, then the same as CSV.
    page.goto(f"{server}/portal/reports/")
    page.select_option("select[name=period]", "month")
    page.select_option("select[name=group_by]", "team")
    page.click("form.filters button[type=submit]")
    page.wait_for_url("**/portal/reports/?*")
    assert page.locator("#report tr.total").count() == 1
    page.screenshot(path=OUTPUT / "portal-report.png", full_page=True)
    with page.expect_download() as download:
        page.click("#export-csv")
    rows = list(csv.reader(io.StringIO(Path(download.value.path()).read_text())))
    assert rows[0][2] == "team" and rows[-1][2] == "TOTAL"
    assert {r[3] for r in rows[1:-1]} == {"acme/agents", "acme/research", "bolt/bots"}
    assert int(rows[-1][5]) == sum(int(r[5]) for r in rows[1:-1])

    # The live dashboard counts requests as they flow through the usage stream.
    page.goto(f"{server}/portal/live/")
    page.wait_for_function("document.getElementById('live-state').textContent === 'live'")
    page.wait_for_selector("#live-requests")
    before = int(page.locator("#live-requests").inner_text())
    # Flow control: a router's queue for the deployment, and requests that waited in it.
    queue_key = QUEUE_KEY.format(world.deployment.pk)
    # Dated a minute ahead, so that it stays fresh (under 3 s old) while the page polls.
    state = {"at": time.time() + 60, "saturated": True, "queued": [["interactive", world.tenant_a.pk, 3]]}
    usage_redis().hset(queue_key, "router-1", json.dumps(state))
    for n in range(5):
        emit(
            world,
            f"flow-{n}",
            status="failed" if n == 4 else "completed",
            priority_class="interactive",
            queued_ms=100 * n,
        )
    page.wait_for_function(f"Number(document.getElementById('live-requests').textContent) >= {before + 5}")
    assert page.locator("#live-errors").inner_text() == "1"
    assert page.locator("#live-deployments td[data-col=name]", has_text="tiny").count() == 1
    assert page.locator("#live-deployments td[data-col=queued]", has_text="3").count() == 1
    flow = page.locator("#live-flow tbody tr", has_text="interactive")
    assert flow.locator("td[data-col=tenant]").inner_text() == "acme"
    assert flow.locator("td[data-col=queued]").inner_text() == "3"
    assert flow.locator("td[data-col=dispatches]").inner_text() == "5"
    assert flow.locator("td[data-col=wait_ms_max]").inner_text() == "400 ms"
    usage_redis().delete(queue_key)
    page.screenshot(path=OUTPUT / "portal-live.png", full_page=True)
