from django.apps import AppConfig
from django.db.models.signals import m2m_changed, post_delete, post_save

# The tables whose rows the router caches; any committed change makes every replica reload.
CACHED_MODELS = (
    "tenants.Tenant",
    "tenants.Team",
    "tenants.ApiKey",
    "tenants.Quota",
    "tenants.PriceSheet",
    "tenants.ModelAlias",
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
        # The models a team or a key may call.
        for label, relation in (("tenants.Team", "deployments"), ("tenants.ApiKey", "deployments")):
            through = getattr(apps.get_model(label), relation).through
            m2m_changed.connect(_changed, sender=through, dispatch_uid=f"router-cache-{label}-{relation}")
