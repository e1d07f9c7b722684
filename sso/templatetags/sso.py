from django import template
from django.conf import settings

from ..views import sso_enabled

register = template.Library()


@register.simple_tag
def local_sign_in() -> bool:
    """Whether the page shows the username-and-password form."""
    return settings.LOCAL_SIGN_IN


@register.inclusion_tag("sso/sign_in_button.html", takes_context=True)
def sso_sign_in_button(context, next_url: str = "") -> dict:
    return {"enabled": sso_enabled(), "provider": settings.OIDC_PROVIDER_NAME, "next": next_url}
