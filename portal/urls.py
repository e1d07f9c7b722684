from django.contrib.auth import views as auth_views
from django.urls import path

from . import alerts, views, whatif
from .api import HistoryView
from .forms import SignInForm

app_name = "portal"
urlpatterns = [
    path("", views.home, name="home"),
    path(
        "login/",
        auth_views.LoginView.as_view(template_name="portal/login.html", authentication_form=SignInForm),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(next_page="portal:login"), name="logout"),
    path("fleet/", views.fleet, name="fleet"),
    path("deployments/new/", views.deployment_new, name="deployment-new"),
    path("deployments/<int:pk>/", views.deployment_detail, name="deployment"),
    path("deployments/<int:pk>/status/", views.deployment_status, name="deployment-status"),
    path("deployments/<int:pk>/scale/<int:pool_pk>/", views.deployment_scale, name="deployment-scale"),
    path("deployments/<int:pk>/delete/", views.deployment_remove, name="deployment-delete"),
    path("deployments/<int:pk>/cost/", views.deployment_cost, name="deployment-cost"),
    path("live/", views.live, name="live"),
    path("history/", HistoryView.as_view(), name="history"),
    path("teams/", views.teams, name="teams"),
    path("teams/<int:pk>/", views.team_detail, name="team"),
    path("teams/<int:pk>/keys/", views.key_create, name="key-create"),
    path("teams/<int:pk>/settings/", views.team_settings, name="team-settings"),
    path("teams/<int:pk>/aliases/", views.alias_create, name="alias-create"),
    path("teams/<int:pk>/aliases/<int:alias_pk>/", views.alias_move, name="alias-move"),
    path("teams/<int:pk>/aliases/<int:alias_pk>/delete/", views.alias_delete, name="alias-delete"),
    path("keys/<int:pk>/revoke/", views.key_revoke, name="key-revoke"),
    path("reports/", views.reports, name="reports"),
    path("reports/export.csv", views.reports_csv, name="reports-csv"),
    path("alerts/", alerts.alerts_index, name="alerts"),
    path("alerts/destinations/", alerts.destination_new, name="alert-destination-new"),
    path("alerts/destinations/<int:pk>/delete/", alerts.destination_delete, name="alert-destination-delete"),
    path("alerts/destinations/<int:pk>/secret/", alerts.destination_rotate, name="alert-destination-rotate"),
    path("alerts/rules/", alerts.rule_new, name="alert-rule-new"),
    path("alerts/rules/<int:pk>/delete/", alerts.rule_delete, name="alert-rule-delete"),
    path("what-if/", whatif.whatif_index, name="whatif"),
    path("what-if/<int:pk>/", whatif.whatif_run, name="whatif-run"),
    path("what-if/<int:pk>/status/", whatif.whatif_status, name="whatif-status"),
]
