"""What a webhook may be sent to: a URL that parses (refused with a 400 otherwise), a tenant's only to public
addresses (also behind an IPv6 form that carries an IPv4 address), and errors that name no internal address.
One delivery that cannot be sent does not hold up the sweep behind it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from alerts import delivery as delivery_module
from alerts import tasks
from alerts.delivery import delivery_attempt
from alerts.evaluate import rule_evaluate
from alerts.models import AlertKind, Delivery, DeliveryStatus, Destination, DestinationKind
from serving.models import ObservedStatus

from .conftest import rule_with

HOOK = {"name": "slack", "kind": "webhook", "tenant": None}


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("https://hooks.example.com:99999/x", "Port out of range"),
        ("https://hooks.example.com:0/x", "between 1 and 65535"),
    ],
)
def test_it_refuses_a_url_that_cannot_be_sent_to(world, client_for, url, says):
    client = client_for(world.admin_a)
    body = {**HOOK, "tenant": world.tenant_a.pk, "url": url}
    response = client.post("/api/alert-destinations/", body)
    assert response.status_code == 400, response.json()
    assert says in response.json()["url"][0]
    own = Destination.objects.create(
        tenant=world.tenant_a, name="ok", kind="webhook", url="https://a.example/h"
    )
    response = client.patch(f"/api/alert-destinations/{own.pk}/", {"url": url})
    assert response.status_code == 400 and says in response.json()["url"][0]
    assert not Destination.objects.filter(url=url).exists()


@pytest.fixture
def failing(world):
    world.deployment.observed_status = ObservedStatus.FAILED
    world.deployment.save()
    return world


def _deliveries_to(*urls: str) -> list[Delivery]:
    destinations = [
        Destination.objects.create(name=f"d{n}", kind=DestinationKind.WEBHOOK, url=url)
        for n, url in enumerate(urls)
    ]
    rule = rule_with(destinations[0], kind=AlertKind.DEPLOYMENT_HEALTH)
    rule.destinations.set(destinations)
    deliveries = sorted(rule_evaluate(rule_id=rule.pk), key=lambda d: urls.index(d.destination.url))
    # Due in this order: the sweep meets the first one first.
    for n, delivery in enumerate(deliveries):
        Delivery.objects.filter(pk=delivery.pk).update(
            next_attempt_at=timezone.now() - timedelta(minutes=9 - n)
        )
    return deliveries


def test_a_stored_url_that_cannot_be_used_fails_without_stopping_the_sweep(failing, receiver, settings):
    settings.ALERT_WEBHOOK_ALLOW_PRIVATE = False
    # A tenant's, stored before URLs were validated: the row holds a port no socket has.
    bad, good = _deliveries_to("http://hooks.example.com:99999/x", receiver.url)
    Destination.objects.filter(pk=bad.destination_id).update(tenant=failing.tenant_a)
    assert tasks.deliver_due() == 2
    bad.refresh_from_db()
    good.refresh_from_db()
    assert (bad.status, bad.attempts) == (DeliveryStatus.FAILED, 1)
    assert "Port out of range" in bad.last_error
    assert (good.status, len(receiver.requests)) == (DeliveryStatus.SENT, 1)


def test_any_error_of_one_delivery_counts_against_its_attempts(failing, receiver, monkeypatch, settings):
    settings.ALERT_DELIVERY_ATTEMPTS = 2
    broken, good = _deliveries_to("http://127.0.0.1:9/broken", receiver.url)
    send = delivery_module._send

    def send_or_break(delivery):
        if delivery.pk == broken.pk:
            raise RuntimeError("something nobody foresaw")
        return send(delivery)

    monkeypatch.setattr(delivery_module, "_send", send_or_break)
    assert tasks.deliver_due() == 2
    broken.refresh_from_db()
    assert (broken.status, broken.attempts) == (DeliveryStatus.PENDING, 1)
    assert broken.last_error == "RuntimeError: something nobody foresaw"
    assert Delivery.objects.get(pk=good.pk).status == DeliveryStatus.SENT
    Delivery.objects.filter(pk=broken.pk).update(next_attempt_at=timezone.now())
    assert delivery_attempt(delivery_id=broken.pk).status == DeliveryStatus.FAILED  # its last attempt


def _tenant_delivery(world, url: str) -> Delivery:
    world.quota_a1.spend_budget = 0
    world.quota_a1.save()
    destination = Destination.objects.create(
        tenant=world.tenant_a, name="hook", kind=DestinationKind.WEBHOOK, url=url
    )
    rule = rule_with(destination, kind=AlertKind.BUDGET, tenant=world.tenant_a, percentages=[100])
    (delivery,) = rule_evaluate(rule_id=rule.pk)
    return delivery_attempt(delivery_id=delivery.pk)


def test_the_error_says_an_internal_name_is_not_public_without_its_address(world, receiver, settings):
    settings.ALERT_WEBHOOK_ALLOW_PRIVATE = False
    url = receiver.url.replace("127.0.0.1", "localhost")
    delivery = _tenant_delivery(world, url)
    assert delivery.status == DeliveryStatus.FAILED
    assert delivery.last_error.startswith("localhost does not resolve to a public address")
    assert "127.0.0.1" not in delivery.last_error and "::1" not in delivery.last_error
    assert receiver.requests == []


@pytest.mark.parametrize(
    "address",
    [
        "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
        "64:ff9b:1::a00:1",  # local-use NAT64
        "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254, the cloud metadata address
        "::a00:1",  # IPv4-compatible 10.0.0.1
    ],
)
def test_an_ipv6_address_carrying_a_private_ipv4_one_is_refused(world, settings, address):
    settings.ALERT_WEBHOOK_ALLOW_PRIVATE = False
    delivery = _tenant_delivery(world, f"http://[{address}]:8080/hook")
    assert delivery.status == DeliveryStatus.FAILED, delivery.last_error
    assert "does not resolve to a public address" in delivery.last_error
