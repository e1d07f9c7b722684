"""Personal API tokens: a person signs in with a password for a token, and revokes it (or all of theirs).

Tokens are django-rest-knox's: the token is shown once, only its SHA-512 digest is stored, and it expires after
`PERSONAL_TOKEN_TTL_HOURS`. Sign-ins here are throttled per client address (`API_LOGIN_RATE`) and counted by
django-axes like the admin's and the portal's, so repeated failures lock that username out from that address.
"""

from __future__ import annotations

from django.contrib.auth import authenticate
from django.contrib.auth.signals import user_logged_in
from django.db.models import Q
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from knox.models import AuthToken
from knox.settings import knox_settings
from knox.views import LogoutAllView, LogoutView
from rest_framework import permissions, serializers, status
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.response import Response
from rest_framework.throttling import ScopedRateThrottle
from rest_framework.views import APIView

from inference_platform.model_validation import StrictTypesMixin

from ..access import TENANT_DEACTIVATED, Access
from .authentication import PersonalTokenAuthentication


class TokenRequestSerializer(StrictTypesMixin, serializers.Serializer):
    username = serializers.CharField(max_length=150)
    password = serializers.CharField(max_length=4096, trim_whitespace=False, style={"input_type": "password"})


class IssuedTokenSerializer(serializers.Serializer):
    token = serializers.CharField(help_text="The token. Shown once, now; only its digest is kept.")
    expiry = serializers.DateTimeField(help_text="When it stops working.")


_Error = inline_serializer("Error", {"detail": serializers.CharField()})


def personal_token_create(*, user, request=None) -> tuple[AuthToken, str]:
    """A new token for `user`, refused once they hold the most unexpired tokens allowed."""
    limit = knox_settings.TOKEN_LIMIT_PER_USER
    if limit is not None:
        live = user.auth_token_set.filter(Q(expiry__gt=timezone.now()) | Q(expiry__isnull=True))
        if live.count() >= limit:
            raise PermissionDenied(f"You hold {limit} tokens, the most allowed: revoke one first.")
    instance, token = AuthToken.objects.create(user=user)
    return instance, token


class TokenCreateView(APIView):
    """Sign in with a username and password for a personal API token (`Authorization: Bearer <token>`)."""

    authentication_classes: list = []
    permission_classes = [permissions.AllowAny]
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "login"

    @extend_schema(
        request=TokenRequestSerializer,
        responses={
            201: IssuedTokenSerializer,
            400: OpenApiResponse(
                OpenApiTypes.OBJECT, description="Wrong username or password (`detail`), or a field's errors."
            ),
            403: OpenApiResponse(
                _Error, description="The person's tenant is deactivated, or too many tokens."
            ),
            429: OpenApiResponse(
                description="Too many sign-ins from this address, or this username locked out."
            ),
        },
        auth=[],
    )
    def post(self, request, format=None):
        query = TokenRequestSerializer(data=request.data)
        query.is_valid(raise_exception=True)
        # The Django request, so that django-axes counts this sign-in like a form's (and its middleware answers
        # a locked-out one with 429).
        user = authenticate(request._request, **query.validated_data)
        if user is None:
            raise ValidationError({"detail": "Unable to sign in with that username and password."})
        if Access.for_user(user).locked_out:
            raise PermissionDenied(TENANT_DEACTIVATED)
        instance, token = personal_token_create(user=user)
        user_logged_in.send(sender=user.__class__, request=request._request, user=user)
        body = IssuedTokenSerializer({"token": token, "expiry": instance.expiry}).data
        return Response(body, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})


class TokenRevokeView(LogoutView):
    """Revoke the token this request is signed with."""

    authentication_classes = [PersonalTokenAuthentication]

    @extend_schema(request=None, responses={204: None})
    def post(self, request, format=None):
        return super().post(request, format)


class TokenRevokeAllView(LogoutAllView):
    """Revoke every personal token of the person this request's token belongs to."""

    authentication_classes = [PersonalTokenAuthentication]

    @extend_schema(request=None, responses={204: None})
    def post(self, request, format=None):
        return super().post(request, format)
