from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants, keys and billing"

    def ready(self) -> None:
        from . import signals

        signals.connect()
