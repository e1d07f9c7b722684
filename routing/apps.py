from django.apps import AppConfig
from django.db.models.signals import post_delete, post_save

# The tables whose rows the router caches; any committed change makes every replica reload.
CACHED_MODELS = (
    "tenants.Tenant",
    "tenants.Team",
    "tenants.ApiKey",
    "tenants.Quota",
    "tenants.PriceSheet",
    "serving.ModelDeployment",
    "serving.Pool",
    "serving.Endpoint",
    "routing.RoutingPolicy",
)


def _changed(sender, **kwargs) -> None:
    from inference_platform.config_version import bump_config_version_on_commit

    bump_config_version_on_commit()


class RoutingConfig(AppConfig):
    name = "routing"
    verbose_name = "Routing"

    def ready(self) -> None:
        from django.apps import apps

        for label in CACHED_MODELS:
            model = apps.get_model(label)
            post_save.connect(_changed, sender=model, dispatch_uid=f"router-cache-{label}-save")
            post_delete.connect(_changed, sender=model, dispatch_uid=f"router-cache-{label}-delete")
