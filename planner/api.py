"""`/api/what-if-runs/`: start a what-if on a recorded period of a deployment (planner/whatif.py), read its
status, progress and result, list them. Platform operators only: a run replays every tenant's traffic."""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.exceptions import APIException
from rest_framework.response import Response

from inference_platform.api_base import PeopleOnly, access_of
from serving.models import ModelDeployment

from .models import WhatIfRun
from .whatif import WhatIfBusy, WhatIfError, whatif_create


class OperatorsOnly(permissions.BasePermission):
    message = "What-if runs are for platform operators: a run replays every tenant's traffic."

    def has_permission(self, request, view) -> bool:
        return access_of(request).is_operator


class WhatIfRunsBusy(APIException):
    """Too many runs at once (planner.whatif.WhatIfBusy): a 429 that says how many and which setting."""

    status_code = status.HTTP_429_TOO_MANY_REQUESTS
    default_code = "what_if_runs_busy"


class WhatIfRunSerializer(serializers.ModelSerializer):
    deployment_name = serializers.CharField(source="deployment.name", read_only=True)
    requested_by = serializers.CharField(source="requested_by.get_username", read_only=True, default=None)

    class Meta:
        model = WhatIfRun
        fields = [
            "id",
            "deployment",
            "deployment_name",
            "since",
            "until",
            "baseline_profile",
            "changes",
            "status",
            "progress",
            "stage",
            "message",
            "result",
            "requested_by",
            "created_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields


class WhatIfRunCreateSerializer(serializers.Serializer):
    deployment = serializers.PrimaryKeyRelatedField(queryset=ModelDeployment.objects.all())
    since = serializers.DateTimeField(help_text="Start of the recorded period, inclusive (UTC unless given).")
    until = serializers.DateTimeField(required=False, help_text="End of the period, exclusive; default now.")
    baseline_profile = serializers.CharField(
        required=False,
        allow_blank=True,
        help_text="A profile in planner/profiles/ for the deployment's engines.",
    )
    changes = serializers.JSONField(required=False, help_text="What the changed fleet does differently.")

    def create(self, validated_data) -> WhatIfRun:
        try:
            return whatif_create(
                deployment=validated_data["deployment"],
                since=validated_data["since"],
                until=validated_data.get("until") or timezone.now(),
                changes=validated_data.get("changes"),
                baseline_profile=validated_data.get("baseline_profile"),
                user=self.context["request"].user,
            )
        except WhatIfError as exc:
            raise serializers.ValidationError(exc.errors) from None
        except WhatIfBusy as exc:
            raise WhatIfRunsBusy(str(exc)) from None


class WhatIfRunViewSet(
    mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    """What-if runs. POST starts one: `deployment`, `since`, `until` (default now), `baseline_profile`
    (optional) and `changes` (see docs/planner.md); the run is simulated in the background, and GET shows its
    `status` (pending, running, succeeded, failed), `progress` (percent), `stage`, `message` and, once done,
    `result`: both fleets' predicted figures beside the period's actual ones. `until` may not be in the future.
    At most PLANNER_WHATIF_MAX_RUNNING runs are pending or running at once, platform-wide: past it, a 429."""

    permission_classes = [permissions.IsAuthenticated, PeopleOnly, OperatorsOnly]
    filterset_fields = ["deployment", "status"]

    def get_queryset(self):
        return WhatIfRun.objects.select_related("deployment", "requested_by")

    def get_serializer_class(self):
        return WhatIfRunCreateSerializer if self.action == "create" else WhatIfRunSerializer

    @extend_schema(
        request=WhatIfRunCreateSerializer,
        responses={
            201: WhatIfRunSerializer,
            429: OpenApiResponse(
                OpenApiTypes.OBJECT,
                description="PLANNER_WHATIF_MAX_RUNNING runs are pending or running already (`detail`).",
            ),
        },
    )
    def create(self, request, *args, **kwargs):
        serializer = WhatIfRunCreateSerializer(data=request.data, context=self.get_serializer_context())
        serializer.is_valid(raise_exception=True)
        run = serializer.save()
        return Response(WhatIfRunSerializer(run).data, status=status.HTTP_201_CREATED)
