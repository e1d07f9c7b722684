"""Health alerts for the operators: each condition told once when it starts to hold and once when it clears."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import redis
from django.conf import settings as django_settings
from django.utils import timezone

from alerts.delivery import delivery_attempt
from alerts.evaluate import rule_evaluate
from alerts.models import AlertKind, AlertState
from routing.contracts import PREFIX_HEALTH_KEY as PREFIX_KEY
from serving.models import Endpoint, Health, ObservedStatus
from tenants.usage_stream import stream_key

from .conftest import rule_with


def _send(deliveries) -> list[dict]:
    for delivery in deliveries:
        assert delivery_attempt(delivery_id=delivery.pk).status == "sent"
    return [delivery.payload["alert"] for delivery in deliveries]


@pytest.fixture
def redis_client():
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    yield client
    client.delete(stream_key())


def _set_status(deployment, status: str, message: str = "") -> None:
    deployment.observed_status, deployment.status_message = status, message
    deployment.save()


def test_it_tells_a_failing_deployment_once_and_when_it_recovers(world, receiver, webhook_to):
    rule = rule_with(webhook_to(), kind=AlertKind.DEPLOYMENT_HEALTH)
    _set_status(world.deployment, ObservedStatus.READY)
    assert rule_evaluate(rule_id=rule.pk) == []

    _set_status(world.deployment, ObservedStatus.FAILED, "engine exited: out of memory")
    (alert,) = _send(rule_evaluate(rule_id=rule.pk))
    assert alert["event"] == "firing"
    assert alert["summary"] == "Deployment tiny is failed: engine exited: out of memory"
    assert rule_evaluate(rule_id=rule.pk) == []

    # Failed to degraded: the failure clears (told), the degradation starts (told).
    _set_status(world.deployment, ObservedStatus.DEGRADED)
    alerts = _send(rule_evaluate(rule_id=rule.pk))
    assert sorted((a["event"], a["key"].rsplit(":", 1)[1]) for a in alerts) == [
        ("firing", "degraded"),
        ("resolved", "failed"),
    ]

    _set_status(world.deployment, ObservedStatus.READY)
    (alert,) = _send(rule_evaluate(rule_id=rule.pk))
    assert alert["event"] == "resolved"
    assert [r.json["alert"]["event"] for r in receiver.requests] == [
        "firing",
        "firing",
        "resolved",
        "resolved",
    ]
    assert receiver.requests[-1].json["text"].startswith(":white_check_mark: *[RESOLVED] Deployment degraded")


def test_it_waits_for_minutes_before_telling(world, webhook_to):
    rule = rule_with(webhook_to(), kind=AlertKind.DEPLOYMENT_HEALTH, for_minutes=5)
    _set_status(world.deployment, ObservedStatus.DEGRADED)
    now = timezone.now()
    assert rule_evaluate(rule_id=rule.pk, now=now) == []
    assert rule_evaluate(rule_id=rule.pk, now=now + timedelta(minutes=4)) == []
    assert len(rule_evaluate(rule_id=rule.pk, now=now + timedelta(minutes=5))) == 1
    # A blip that clears before the time is never told.
    _set_status(world.deployment, ObservedStatus.READY)
    rule_evaluate(rule_id=rule.pk, now=now + timedelta(minutes=6))
    _set_status(world.deployment, ObservedStatus.FAILED)
    assert rule_evaluate(rule_id=rule.pk, now=now + timedelta(minutes=7)) == []
    _set_status(world.deployment, ObservedStatus.READY)
    assert rule_evaluate(rule_id=rule.pk, now=now + timedelta(minutes=8)) == []


def test_it_tells_an_engine_crash_looping(world, webhook_to):
    rule = rule_with(webhook_to(), kind=AlertKind.ENGINE_CRASH_LOOP, threshold=3, window_minutes=15)
    endpoint = Endpoint.objects.create(
        pool=world.deployment.pools.get(), name="tiny-main-0", url="http://127.0.0.1:1", role="both"
    )
    now = timezone.now()
    assert rule_evaluate(rule_id=rule.pk, now=now) == []
    Endpoint.objects.filter(pk=endpoint.pk).update(restart_count=2, health=Health.UNHEALTHY)
    assert rule_evaluate(rule_id=rule.pk, now=now + timedelta(minutes=2)) == []
    Endpoint.objects.filter(pk=endpoint.pk).update(restart_count=3)
    (alert,) = _send(rule_evaluate(rule_id=rule.pk, now=now + timedelta(minutes=4)))
    assert alert["summary"].startswith("Engine tiny/tiny-main-0 restarted 3 times in the last 15 minutes")
    assert rule_evaluate(rule_id=rule.pk, now=now + timedelta(minutes=6)) == []
    # No restart for longer than the window: it has stopped crash-looping.
    (alert,) = _send(rule_evaluate(rule_id=rule.pk, now=now + timedelta(minutes=25)))
    assert alert["event"] == "resolved"


def test_it_tells_usage_ingestion_lagging(world, webhook_to, redis_client):
    rule = rule_with(webhook_to(), kind=AlertKind.INGESTION_LAG, threshold=60)
    redis_client.delete(stream_key())
    assert rule_evaluate(rule_id=rule.pk) == []
    old_ms = int((time.time() - 300) * 1000)
    redis_client.xadd(stream_key(), {"e": "{}"}, id=f"{old_ms}-0")
    redis_client.xadd(stream_key(), {"e": "{}"})
    (alert,) = _send(rule_evaluate(rule_id=rule.pk))
    assert alert["details"]["entries"] == 2
    assert 290 < alert["details"]["oldest_age_s"] < 400
    redis_client.delete(stream_key())
    (alert,) = _send(rule_evaluate(rule_id=rule.pk))
    assert alert["event"] == "resolved" and alert["summary"] == "Usage ingestion has caught up."


def test_it_tells_prefix_prediction_below_its_threshold(world, webhook_to, redis_client):
    rule = rule_with(webhook_to(), kind=AlertKind.PREFIX_PREDICTION, threshold=0.8)
    key = PREFIX_KEY.format(world.deployment.pk, int(time.time() // 60))
    try:
        redis_client.hset(key, mapping={"predicted": 100, "reported": 1000})
        assert rule_evaluate(rule_id=rule.pk) == []  # too little traffic to judge
        redis_client.hset(key, mapping={"predicted": 3000, "reported": 10000})
        (alert,) = _send(rule_evaluate(rule_id=rule.pk))
        assert alert["details"]["ratio"] == 0.3
        assert "predicted 30% of the cached tokens" in alert["summary"]
        redis_client.hset(key, mapping={"predicted": 9500, "reported": 10000})
        (alert,) = _send(rule_evaluate(rule_id=rule.pk))
        assert alert["event"] == "resolved"
    finally:
        redis_client.delete(key)


def test_it_tells_the_usage_journal_in_use(world, webhook_to, receiver, settings, tmp_path):
    settings.ROUTER_USAGE_JOURNAL_DIR = str(tmp_path)
    settings.ALERT_ROUTER_METRICS_URLS = [f"{receiver.base}/metrics"]
    receiver.metrics_text = "# TYPE router_usage_journal_bytes gauge\nrouter_usage_journal_bytes 0.0\n"
    rule = rule_with(webhook_to(), kind=AlertKind.USAGE_JOURNAL)
    assert rule_evaluate(rule_id=rule.pk) == []

    segment = tmp_path / "router-1.0.jsonl"
    segment.write_text('{"e":{},"s":null}\n')
    receiver.metrics_text = receiver.metrics_text.replace(" 0.0", " 4096.0")
    alerts = _send(rule_evaluate(rule_id=rule.pk))
    assert sorted(a["details"]["bytes"] for a in alerts) == [18, 4096]

    segment.unlink()
    receiver.metrics_text = receiver.metrics_text.replace(" 4096.0", " 0.0")
    assert {a["event"] for a in _send(rule_evaluate(rule_id=rule.pk))} == {"resolved"}
    assert not AlertState.objects.filter(rule=rule, firing=True).exists()


def test_a_router_that_does_not_answer_changes_nothing(world, webhook_to, settings, tmp_path):
    settings.ROUTER_USAGE_JOURNAL_DIR = str(tmp_path)
    settings.ALERT_ROUTER_METRICS_URLS = ["http://127.0.0.1:1/metrics"]
    rule = rule_with(webhook_to(), kind=AlertKind.USAGE_JOURNAL)
    assert rule_evaluate(rule_id=rule.pk) == []
    state = AlertState.objects.get(rule=rule, key="journal:http://127.0.0.1:1/metrics")
    assert not state.holding and not state.firing
