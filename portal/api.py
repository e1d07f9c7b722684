"""The charts' data as JSON (portal/charts.py), scoped like the portal's pages: the fleet and deployments (with
their pools' charts, latency among them) to operators, a team (its latency too) to whoever may see its page, a
tenant to its admins. Another tenant's team is not found."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import permissions, serializers
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from inference_platform.api_base import PeopleOnly, access_of
from serving.models import ModelDeployment

from .charts import PERIODS, deployment_history, fleet_history, team_history, tenant_history

SCOPES = ("fleet", "deployment", "team", "tenant")


class HistoryQuerySerializer(serializers.Serializer):
    scope = serializers.ChoiceField(choices=SCOPES)
    id = serializers.IntegerField(
        required=False, min_value=1, help_text="The deployment's, team's or tenant's."
    )
    period = serializers.ChoiceField(
        choices=tuple(PERIODS),
        default="day",
        help_text="The last hour or day (per minute), week or month (per hour).",
    )


class HistoryView(APIView):
    """Time series for the portal's charts: a step per minute (hour, day) or per hour (week, month)."""

    permission_classes = [permissions.IsAuthenticated, PeopleOnly]

    @extend_schema(parameters=[HistoryQuerySerializer], responses={200: dict})
    def get(self, request):
        query = HistoryQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        scope, ident, period = (
            query.validated_data["scope"],
            query.validated_data.get("id"),
            query.validated_data["period"],
        )
        if scope != "fleet" and ident is None:
            raise ValidationError({"id": [f"Give the {scope}'s id."]})
        access = access_of(request)
        now = timezone.now()
        if scope in ("fleet", "deployment") and not access.is_operator:
            raise PermissionDenied("Operators only.")
        if scope == "fleet":
            return Response(fleet_history(period=period, now=now))
        if scope == "deployment":
            deployment = get_object_or_404(ModelDeployment, pk=ident)
            return Response(deployment_history(deployment=deployment, period=period, now=now))
        if scope == "team":
            team = get_object_or_404(access.teams_qs(), pk=ident)
            return Response(team_history(team=team, period=period, now=now))
        tenant = get_object_or_404(access.tenants_qs(), pk=ident)
        if not access.can_admin_tenant(tenant.pk):
            raise PermissionDenied("Only the tenant's admins can see its whole usage.")
        return Response(tenant_history(tenant=tenant, period=period, now=now))
