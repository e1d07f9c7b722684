"""What an alert says: one payload per event, stored on each delivery and sent as it is.

The webhook body is Slack's incoming-webhook format (`text`, plus `blocks` for layout), which Slack, Mattermost,
Rocket.Chat and Microsoft Teams' Slack-compatible connectors accept; `alert` carries the same facts for programs.
An e-mail sends `subject` and `text`.
"""

from __future__ import annotations

from django.conf import settings

from .models import AlertRule, AlertState, DeliveryEvent

EMOJI = {DeliveryEvent.FIRING: ":rotating_light:", DeliveryEvent.RESOLVED: ":white_check_mark:"}


def alert_payload(*, rule: AlertRule, state: AlertState, event: str) -> dict:
    title = f"[{event.upper()}] {rule.get_kind_display()}"
    owner = rule.tenant.slug if rule.tenant_id else "platform"
    link = f"{settings.ALERT_PORTAL_URL.rstrip('/')}/portal/alerts/" if settings.ALERT_PORTAL_URL else ""
    text = f"{EMOJI.get(event, '')} *{title}*\n{state.summary}"
    if link:
        text += f"\n<{link}|Alerts in the portal>"
    return {
        "text": text,
        "blocks": [
            {"type": "header", "text": {"type": "plain_text", "text": title[:150]}},
            {"type": "section", "text": {"type": "mrkdwn", "text": state.summary[:3000] or title}},
            {
                "type": "context",
                "elements": [
                    {"type": "mrkdwn", "text": f"Rule {rule.pk} ({owner}) · condition `{state.key}`"}
                ],
            },
        ],
        "alert": {
            "event": event,
            "kind": rule.kind,
            "rule_id": rule.pk,
            "tenant": rule.tenant.slug if rule.tenant_id else None,
            "key": state.key,
            "summary": state.summary,
            "details": state.details,
            "fired_at": state.fired_at.isoformat() if state.fired_at else None,
            "resolved_at": state.resolved_at.isoformat() if state.resolved_at else None,
        },
        "subject": f"{title}: {state.summary}"[:200],
    }


def email_text(payload: dict) -> str:
    alert = payload["alert"]
    lines = [alert["summary"], "", f"Condition: {alert['key']}", f"Rule: {alert['rule_id']}"]
    if settings.ALERT_PORTAL_URL:
        lines.append(f"Alerts: {settings.ALERT_PORTAL_URL.rstrip('/')}/portal/alerts/")
    return "\n".join(lines) + "\n"
