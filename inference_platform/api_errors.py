"""Errors from the provisioning API are JSON that says what went wrong and what to fix."""

from django.db import IntegrityError
from django.db.models import ProtectedError, RestrictedError
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler


def exception_handler(exc, context):
    if isinstance(exc, ProtectedError | RestrictedError):
        related = exc.protected_objects if isinstance(exc, ProtectedError) else exc.restricted_objects
        blockers = sorted({str(obj._meta.verbose_name_plural) for obj in related})
        return Response(
            {
                "detail": f"Cannot delete this: it still has {', '.join(blockers)}. Remove or move those first."
            },
            status=status.HTTP_409_CONFLICT,
        )
    if isinstance(exc, IntegrityError):
        # Serializers validate first; this is the race where two writers collide on a constraint.
        return Response(
            {
                "detail": "This change conflicts with existing data (a uniqueness or consistency rule). Reload and retry."
            },
            status=status.HTTP_409_CONFLICT,
        )
    return drf_exception_handler(exc, context)
