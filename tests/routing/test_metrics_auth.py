"""The router's /metrics name models, engines and per-tenant queues: only the operator's scraper, with
ROUTER_METRICS_TOKEN, reads them."""

from __future__ import annotations

import asyncio

import httpx
from django.test import override_settings

from routing.server.app import Router

from .router_metrics import router_metrics


def test_the_metrics_need_the_operators_token(fleet):
    url = f"{fleet.router.url}/metrics"
    for headers in (
        {},
        {"authorization": "Bearer not-the-token"},
        {"authorization": f"Bearer {fleet.key.secret}"},
    ):
        refused = httpx.get(url, headers=headers, timeout=10)
        assert refused.status_code == 401, headers
        assert refused.headers["www-authenticate"].startswith("Bearer")
        assert "router_" not in refused.text and "ROUTER_METRICS_TOKEN" in refused.json()["error"]["message"]
    assert "router_" in router_metrics(fleet.router.url)


def test_with_no_token_set_no_one_reads_the_metrics():
    with override_settings(ROUTER_METRICS_TOKEN=""):
        router = Router()
    sent = []

    async def send(message):
        sent.append(message)

    for headers in ([], [(b"authorization", b"Bearer ")]):
        sent.clear()
        asyncio.run(router.serve_metrics({"headers": headers}, send))
        assert sent[0]["status"] == 401 and b"router_" not in sent[1]["body"]
