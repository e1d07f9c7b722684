"""Create the demo operator, tenant, team, key, price sheet and deployment. Safe to run again.

The operator (a superuser whose password is printed) is made only under DEBUG.

It lives in `serving` because what it sets up ends in a served model: the tenant, team, key and price sheet are
there so that the demo deployment can be called and billed. `serving` already builds on `tenants` (audit rows),
while `tenants` knows nothing of deployments; the deployment is made by the same service as the API's and the
portal's (serving.services.deployment_create).
"""

import secrets
from decimal import Decimal

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction
from django.db.models import Model
from django.utils import timezone

from routing.models import RoutingPolicy
from serving.models import EngineKind, ModelDeployment
from serving.services import deployment_create
from tenants.audit import audited
from tenants.keys import api_key_create
from tenants.models import ApiKey, Membership, PriceSheet, Quota, Role, Scope, Team, Tenant

DEMO_MODEL = "tiny-qwen"
# Room for a real Claude Code or Codex session: their first request alone is about 9-13K tokens (system prompt
# and tools), and Claude Code asks for up to 32,000 output tokens. The tiny model declares enough positions for it.
DEMO_MAX_MODEL_LEN = 131_072


def _create(audit_name: str, model: type[Model], /, **fields) -> Model:
    """A row of the demo, made and audited as the system's."""
    with audited(audit_name, actor=None, source="system") as change:
        change.instance = model.objects.create(**fields)
    return change.instance


def _operator(user) -> dict:
    return {"username": user.get_username(), "operator": True}


class Command(BaseCommand):
    help = "Create a demo operator, tenant, team and API key (printed once), with a price sheet and a deployment."

    def add_arguments(self, parser):
        parser.add_argument("--username", default="operator")

    @transaction.atomic
    def handle(self, *args, username: str, **options):
        User = get_user_model()
        user = User.objects.filter(username=username).first()
        if user is None and not settings.DEBUG:
            # A superuser with a printed password is for a developer's machine only.
            self.stdout.write(
                "Operator:  not created (DEBUG is off); make one with `manage.py createsuperuser` and give "
                "them the operator role in the admin"
            )
        elif user is None:
            password = secrets.token_urlsafe(12)
            with audited("user", actor=None, source="system", snapshot_of=_operator) as change:
                user = change.instance = User.objects.create_superuser(
                    username=username, email="", password=password
                )
                Membership.objects.create(user=user, role=Role.OPERATOR)
            self.stdout.write(f"Operator:  {username} / {password}   (shown once; change it in the admin)")
        else:
            self.stdout.write(f"Operator:  {username} (exists)")

        tenant = Tenant.objects.filter(slug="demo").first() or _create(
            "tenant", Tenant, slug="demo", name="Demo Inc."
        )
        team = Team.objects.filter(tenant=tenant, slug="agents").first()
        if team is None:
            team = _create("team", Team, tenant=tenant, slug="agents", name="Agents")
            _create(
                "quota",
                Quota,
                team=team,
                requests_per_minute=600,
                max_concurrent_requests=64,
                token_budget=2_000_000_000,
            )
        self.stdout.write(f"Tenant:    {tenant.slug}, team {team.slug}")

        if not PriceSheet.objects.filter(served_model_name=DEMO_MODEL, tenant=None).exists():
            _create(
                "price_sheet",
                PriceSheet,
                served_model_name=DEMO_MODEL,
                effective_from=timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0),
                input_per_mtok=Decimal("0.50"),
                cached_input_per_mtok=Decimal("0.05"),
                output_per_mtok=Decimal("1.50"),
            )

        deployment = ModelDeployment.objects.filter(name="tiny-demo").first()
        if deployment is None:
            # The Celery worker starts its two simulated engines once this commits (the beat would too).
            deployment = deployment_create(
                actor=None,
                source="system",
                fields={
                    "name": "tiny-demo",
                    "served_model_name": DEMO_MODEL,
                    "model_source": "models/tiny-qwen",
                    "engine_kind": EngineKind.SIM,
                    "max_model_len": DEMO_MAX_MODEL_LEN,
                },
                pools=[{"name": "main", "replicas": 2}],
            )
            RoutingPolicy.objects.create(deployment=deployment)
        self.stdout.write(
            f"Deployment: {deployment.name}, {deployment.engine_kind} engines, served as {DEMO_MODEL}, "
            f"context {deployment.max_model_len} tokens"
        )
        # Tool calling is on by default: the tiny model is a qwen2, whose family default is the hermes parser.
        tools = deployment.tool_calling()
        self.stdout.write(
            f"Tool calls: {tools.tool_call_parser or 'off'} ({tools.source})"
            + ("" if tools.tool_call_parser else f": {tools.note}")
        )

        if not ApiKey.objects.filter(team=team, name="demo agent").exists():
            issued = api_key_create(
                team=team,
                name="demo agent",
                scopes=[Scope.INFERENCE, Scope.READ_USAGE],
                actor=None,
                source="system",
            )
            self.stdout.write(f"API key:   {issued.secret}   (shown once; keep it now)")
        else:
            self.stdout.write(
                "API key:   demo key exists (its secret was shown when it was made; issue another in the admin)"
            )
