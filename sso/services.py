"""Signing in through the identity provider: find or create the person, then give and take back the memberships
that the group rules say their groups carry."""

from __future__ import annotations

import hashlib
import re

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.utils import timezone

from tenants.access import Access
from tenants.audit import audit_record
from tenants.models import Membership, Role

from .models import Grant, GroupRule, Identity

ACTOR = "single sign-on"
# Why a sign-in was refused: the code travels in the refused page's address; the words are the page's.
REFUSALS = {
    "no_group": "None of your groups at the identity provider gives access to this platform. Ask the platform "
    "operator to map one of your groups, or your identity provider's administrator to add you to a mapped one.",
    "deactivated": "Your organisation's account on this platform is deactivated; ask the platform operator to "
    "reactivate it.",
    "failed": "The identity provider did not sign you in. Try again, or ask the platform operator.",
    "ended": "Your sign-in at the identity provider has ended, so your session here has too. Sign in again.",
    "stale": "This page does not answer a sign-in started in this browser (it may be an old or copied link), so "
    "it was ignored. Nothing was changed: if you were signed in, you still are. To sign in, start again.",
}
TEAM_ROLE_RANK = {Role.TEAM_ADMIN: 0, Role.MEMBER: 1}


class SignInRefused(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(REFUSALS[code])
        self.code = code


def groups_of(claims: dict) -> list[str]:
    value = claims.get(settings.OIDC_GROUPS_CLAIM) or []
    if isinstance(value, str):
        value = [value]
    return sorted({str(group) for group in value})


def rules_for_groups(groups: list[str]) -> list[GroupRule]:
    return list(GroupRule.objects.filter(group__in=groups).select_related("team"))


def grants_from_rules(rules: list[GroupRule]) -> set[tuple[str, int | None, int | None]]:
    """The memberships the rules give: one role per team (a team admin rule wins over a member rule)."""
    grants = {rule.grant() for rule in rules if rule.role not in (Role.TEAM_ADMIN, Role.MEMBER)}
    per_team: dict[int, tuple[str, int | None, int | None]] = {}
    for rule in rules:
        if rule.team_id is None:
            continue
        best = per_team.get(rule.team_id)
        if best is None or TEAM_ROLE_RANK[rule.role] < TEAM_ROLE_RANK[best[0]]:
            per_team[rule.team_id] = rule.grant()
    return grants | set(per_team.values())


def sso_sign_in(*, claims: dict) -> object:
    """The user these verified claims (ID token and userinfo) sign in, with their memberships brought in line
    with the group rules; SignInRefused when no rule admits them (taking back what rules gave them before)."""
    issuer, subject = str(claims["iss"]), str(claims["sub"])
    groups = groups_of(claims)
    rules = rules_for_groups(groups)
    with transaction.atomic():
        identity = (
            Identity.objects.select_for_update()
            .select_related("user")
            .filter(issuer=issuer, subject=subject)
            .first()
        )
        if identity is None and not rules:
            raise SignInRefused("no_group")
        if identity is None:
            identity = _identity_create(issuer=issuer, subject=subject, claims=claims)
        user = identity.user
        _profile_update(user=user, claims=claims)
        identity.groups = groups
        identity.last_sign_in_at = timezone.now()
        _memberships_sync(user=user, wanted=grants_from_rules(rules))
        _admin_sync(identity=identity, wanted=any(rule.admin_site for rule in rules))
        identity.save()
    # Outside the block: a refusal must keep the memberships it took back.
    if not rules:
        raise SignInRefused("no_group")
    if Access.for_user(user).locked_out:
        raise SignInRefused("deactivated")
    return user


def _username_for(claims: dict, subject: str) -> str:
    wanted = str(claims.get("preferred_username") or claims.get("email") or subject)
    base = re.sub(r"[^\w.@+-]", "-", wanted)[:120] or "sso"
    User = get_user_model()
    if not User.objects.filter(username=base).exists():
        return base
    # Taken (by a local account, or by someone at another provider): never share it.
    return f"{base}-{hashlib.sha256(subject.encode()).hexdigest()[:8]}"


def _identity_create(*, issuer: str, subject: str, claims: dict) -> Identity:
    User = get_user_model()
    user = User(username=_username_for(claims, subject))
    user.set_unusable_password()
    user.save()
    try:
        with transaction.atomic():
            identity = Identity.objects.create(user=user, issuer=issuer, subject=subject)
    except IntegrityError as exc:  # a parallel first sign-in of the same person
        raise SignInRefused("failed") from exc
    audit_record(actor=ACTOR, action="user.create", instance=user, source="sso", details={"issuer": issuer})
    return identity


def _profile_update(*, user, claims: dict) -> None:
    fields = {
        "email": claims.get("email") or "",
        "first_name": (claims.get("given_name") or "")[:150],
        "last_name": (claims.get("family_name") or "")[:150],
    }
    changed = [name for name, value in fields.items() if getattr(user, name) != value]
    for name in changed:
        setattr(user, name, fields[name])
    if changed:
        user.save(update_fields=changed)


def _memberships_sync(*, user, wanted: set[tuple[str, int | None, int | None]]) -> None:
    given = Membership.objects.filter(user=user, sso_grant__isnull=False)
    for membership in given:
        if (membership.role, membership.tenant_id, membership.team_id) not in wanted:
            audit_record(actor=ACTOR, action="membership.delete", instance=membership, source="sso")
            membership.delete()
    held = Membership.objects.filter(user=user)
    for role, tenant_id, team_id in sorted(wanted, key=str):
        if _already_held(held, role=role, tenant_id=tenant_id, team_id=team_id):
            continue
        membership = Membership.objects.create(user=user, role=role, tenant_id=tenant_id, team_id=team_id)
        Grant.objects.create(membership=membership)
        audit_record(actor=ACTOR, action="membership.create", instance=membership, source="sso")


def _already_held(held, *, role: str, tenant_id: int | None, team_id: int | None) -> bool:
    """A membership in the same place (made by hand, or given before) stands: one role per team, per tenant's
    admins, per operator, as the membership's own constraints say."""
    if team_id is not None:
        return held.filter(team_id=team_id).exists()
    if role == Role.TENANT_ADMIN:
        return held.filter(role=role, tenant_id=tenant_id).exists()
    return held.filter(role=role).exists()


def _admin_sync(*, identity: Identity, wanted: bool) -> None:
    user = identity.user
    if wanted and not (user.is_staff and user.is_superuser):
        user.is_staff = user.is_superuser = True
        identity.admin_granted = True
        user.save(update_fields=["is_staff", "is_superuser"])
        audit_record(actor=ACTOR, action="user.admin_grant", instance=user, source="sso")
    elif not wanted and identity.admin_granted:
        user.is_staff = user.is_superuser = False
        identity.admin_granted = False
        user.save(update_fields=["is_staff", "is_superuser"])
        audit_record(actor=ACTOR, action="user.admin_revoke", instance=user, source="sso")
