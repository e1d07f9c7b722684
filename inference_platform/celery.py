import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

app = Celery("inference_platform")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
