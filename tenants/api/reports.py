"""Billing reports through the REST API, as JSON or CSV; the caller's scope decides what is counted."""

from __future__ import annotations

import csv

from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework import permissions, serializers
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from inference_platform.api_base import PeopleOnly, access_of

from ..billing import (
    GROUPS,
    METRICS,
    PERIODS,
    Period,
    PeriodError,
    Report,
    period_parse,
    report_csv_rows,
    usage_report,
)
from ..models import PriorityClass


class ReportQuerySerializer(serializers.Serializer):
    period = serializers.ChoiceField(choices=PERIODS, default="month")
    at = serializers.DateField(required=False, help_text="A day inside the period (UTC); default today.")
    since = serializers.DateTimeField(required=False, help_text="Start of a custom period (inclusive).")
    until = serializers.DateTimeField(required=False, help_text="End of a custom period (exclusive).")
    group_by = serializers.ChoiceField(choices=GROUPS, default="team")
    tenant = serializers.IntegerField(required=False, min_value=1)
    team = serializers.IntegerField(required=False, min_value=1)
    key = serializers.IntegerField(required=False, min_value=1)
    model = serializers.CharField(required=False, max_length=200)
    priority_class = serializers.ChoiceField(
        choices=PriorityClass.choices, required=False, help_text="Only the requests served in this class."
    )


class ReportRowSerializer(serializers.Serializer):
    key = serializers.CharField(allow_null=True)
    label = serializers.CharField()
    currency = serializers.CharField()
    requests = serializers.IntegerField()
    errors = serializers.IntegerField()
    input_tokens = serializers.IntegerField(help_text="All prompt tokens, cached ones included.")
    cached_input_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    cost = serializers.DecimalField(max_digits=30, decimal_places=8)


class ReportSerializer(serializers.Serializer):
    start = serializers.DateTimeField(source="period.start")
    end = serializers.DateTimeField(source="period.end")
    group_by = serializers.CharField()
    rows = ReportRowSerializer(many=True)
    totals = ReportRowSerializer(many=True)


PERIOD_OUT_OF_RANGE = "This period reaches beyond the years 1 to 9999: give a nearer day or times."


def report_from_query(request, params) -> Report:
    # A plain dict, so that an empty parameter (`?until=`) is refused like any other bad value, not skipped.
    query = ReportQuerySerializer(data=params.dict())
    query.is_valid(raise_exception=True)
    q = query.validated_data
    try:
        period: Period = period_parse(
            period=q["period"], at=q.get("at"), since=q.get("since"), until=q.get("until")
        )
    except PeriodError as exc:
        raise ValidationError({"period": [str(exc)]}) from None
    except (ValueError, OverflowError):  # the period's bounds fall outside the years 1 to 9999
        raise ValidationError({"at": [PERIOD_OUT_OF_RANGE]}) from None
    return usage_report(
        access=access_of(request),
        period=period,
        group_by=q["group_by"],
        tenant_id=q.get("tenant"),
        team_id=q.get("team"),
        api_key_id=q.get("key"),
        model=q.get("model"),
        priority_class=q.get("priority_class"),
    )


# A spreadsheet reads a cell that starts with one of these as a formula (which can run commands or send the
# sheet's data away). Key and team names are chosen by tenants, so such a cell is written as text instead.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: str) -> str:
    """`value` as a spreadsheet shows it, never evaluates it: a leading quote marks a would-be formula as text."""
    return "'" + value if value.startswith(_FORMULA_STARTS) else value


def csv_response(report: Report) -> HttpResponse:
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    name = f"usage-{report.group_by}-{report.period.start:%Y%m%d}-{report.period.end:%Y%m%d}.csv"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    csv.writer(response).writerows([csv_cell(cell) for cell in row] for row in report_csv_rows(report))
    return response


class UsageReportView(APIView):
    """Usage and cost for a period grouped by tenant, team, key, model, deployment, priority class or day.

    Totals (one per currency) equal the sums of the usage records the caller can see in the period.
    """

    permission_classes = [permissions.IsAuthenticated, PeopleOnly]
    allow_api_keys = True

    @extend_schema(parameters=[ReportQuerySerializer], responses={200: ReportSerializer})
    def get(self, request):
        return Response(ReportSerializer(report_from_query(request, request.query_params)).data)


class UsageReportCsvView(APIView):
    """The same report as CSV: a header, one row per group and currency, then a TOTAL row per currency."""

    permission_classes = [permissions.IsAuthenticated, PeopleOnly]
    allow_api_keys = True

    @extend_schema(parameters=[ReportQuerySerializer], responses={(200, "text/csv"): str})
    def get(self, request):
        return csv_response(report_from_query(request, request.query_params))


__all__ = [
    "METRICS",
    "PERIOD_OUT_OF_RANGE",
    "UsageReportCsvView",
    "UsageReportView",
    "csv_cell",
    "csv_response",
    "report_from_query",
]
