from django.contrib import admin
from django.http import JsonResponse
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from alerts.api import views as alerts
from planner.api import WhatIfRunViewSet
from routing.api.views import RoutingPolicyViewSet
from serving.api.views import AutoscalingPolicyViewSet, ModelDeploymentViewSet, ScalingEventViewSet
from tenants.api import reports, tokens
from tenants.api import views as tenants

router = DefaultRouter()
router.register("tenants", tenants.TenantViewSet, basename="tenant")
router.register("teams", tenants.TeamViewSet, basename="team")
router.register("memberships", tenants.MembershipViewSet, basename="membership")
router.register("keys", tenants.ApiKeyViewSet, basename="apikey")
router.register("quotas", tenants.QuotaViewSet, basename="quota")
router.register("price-sheets", tenants.PriceSheetViewSet, basename="pricesheet")
router.register("model-aliases", tenants.ModelAliasViewSet, basename="modelalias")
router.register("deployments", ModelDeploymentViewSet, basename="deployment")
router.register("routing-policies", RoutingPolicyViewSet, basename="routingpolicy")
router.register("autoscaling-policies", AutoscalingPolicyViewSet, basename="autoscalingpolicy")
router.register("scaling-events", ScalingEventViewSet, basename="scalingevent")
router.register("usage", tenants.UsageViewSet, basename="usage")
router.register("audit-log", tenants.AuditLogViewSet, basename="auditlog")
router.register("alert-destinations", alerts.DestinationViewSet, basename="alertdestination")
router.register("alert-rules", alerts.AlertRuleViewSet, basename="alertrule")
router.register("alerts", alerts.AlertViewSet, basename="alert")
router.register("alert-deliveries", alerts.DeliveryViewSet, basename="alertdelivery")
router.register("what-if-runs", WhatIfRunViewSet, basename="whatifrun")


def healthz(request):
    return JsonResponse({"status": "ok"})


urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/reports/usage/", reports.UsageReportView.as_view(), name="report-usage"),
    path("api/reports/usage.csv", reports.UsageReportCsvView.as_view(), name="report-usage-csv"),
    path("api/", include(router.urls)),
    path("portal/", include("portal.urls")),
    path("sso/", include("sso.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/auth/token/", tokens.TokenCreateView.as_view(), name="token-create"),
    path("api/auth/token/revoke/", tokens.TokenRevokeView.as_view(), name="token-revoke"),
    path("api/auth/token/revoke-all/", tokens.TokenRevokeAllView.as_view(), name="token-revoke-all"),
    path("api/auth/", include("rest_framework.urls")),
    path("metrics/", include("control_metrics.urls")),
    path("healthz", healthz),
]
