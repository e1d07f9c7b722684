from django.urls import path

from . import views

urlpatterns = [
    path("platform", views.platform_metrics, name="metrics-platform"),
    path("engines", views.engine_scrape_targets, name="metrics-engines"),
]
