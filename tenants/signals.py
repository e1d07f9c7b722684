"""What follows a change made anywhere (API, portal, admin, shell): personal tokens die with a password, and the
routers reload when a deployment's tenants change."""

from __future__ import annotations

from django.contrib.auth import get_user_model


def revoke_tokens_on_password_change_mark(sender, instance, update_fields=None, **kwargs) -> None:
    """Before a user is saved: note whether the stored password changes (a new password, an unusable one, or a
    new hash of it), which makes every session of theirs invalid (Django checks them against the hash)."""
    if instance.pk is None or (update_fields is not None and "password" not in update_fields):
        return
    stored = sender.objects.filter(pk=instance.pk).values_list("password", flat=True).first()
    if stored is not None and stored != instance.password:
        instance._password_hash_changed = True


def revoke_tokens_on_password_change(sender, instance, **kwargs) -> None:
    """After it is saved: revoke all their personal API tokens too, as their sessions are."""
    if getattr(instance, "_password_hash_changed", False):
        from knox.models import AuthToken

        instance._password_hash_changed = False
        AuthToken.objects.filter(user=instance).delete()


def deployment_tenants_changed(sender, action: str, **kwargs) -> None:
    if action in ("post_add", "post_remove", "post_clear"):
        from inference_platform.config_version import bump_config_version_on_commit

        bump_config_version_on_commit()


def connect() -> None:
    from django.db.models.signals import m2m_changed, post_save, pre_save

    from serving.models import ModelDeployment

    user_model = get_user_model()
    pre_save.connect(
        revoke_tokens_on_password_change_mark, sender=user_model, dispatch_uid="tokens-password-mark"
    )
    post_save.connect(
        revoke_tokens_on_password_change, sender=user_model, dispatch_uid="tokens-password-revoke"
    )
    m2m_changed.connect(
        deployment_tenants_changed,
        sender=ModelDeployment.tenants.through,
        dispatch_uid="router-cache-deployment-tenants",
    )
