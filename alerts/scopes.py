"""Who sees and changes which alerts: operators everything; a tenant's admins their tenant's destinations, rules,
alerts and deliveries. Anyone else finds none of them (404)."""

from __future__ import annotations

from django.db.models import QuerySet

from tenants.access import Access

from .models import AlertRule, AlertState, Delivery, Destination


def destinations_qs(access: Access) -> QuerySet[Destination]:
    qs = Destination.objects.select_related("tenant")
    return qs if access.is_operator else qs.filter(tenant_id__in=access.admin_tenants)


def rules_qs(access: Access) -> QuerySet[AlertRule]:
    qs = AlertRule.objects.select_related("tenant", "team", "deployment").prefetch_related("destinations")
    return qs if access.is_operator else qs.filter(tenant_id__in=access.admin_tenants)


def alert_states_qs(access: Access) -> QuerySet[AlertState]:
    qs = AlertState.objects.select_related("rule__tenant")
    return qs if access.is_operator else qs.filter(rule__tenant_id__in=access.admin_tenants)


def deliveries_qs(access: Access) -> QuerySet[Delivery]:
    qs = Delivery.objects.select_related("destination", "state__rule")
    return qs if access.is_operator else qs.filter(state__rule__tenant_id__in=access.admin_tenants)


def can_manage(access: Access, tenant_id: int | None) -> bool:
    """A tenant's alerts are its admins' (and the operators'); the platform's are the operators' alone."""
    return access.can_admin_tenant(tenant_id)
