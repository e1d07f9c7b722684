"""Query parameters the provisioning API refuses, with a 400 that says what to fix, instead of ignoring.

DRF's pagination and django-filter skip a value they cannot read (`?offset=abc`, `?since=`) and answer as if
it had not been sent, so a client's typo silently widens what it gets. Here such a value is an error.
"""

from __future__ import annotations

import django_filters
from django import forms
from django_filters.rest_framework import DjangoFilterBackend
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination

_BOOLEANS = {"true", "false"}


class StrictFilterSet(django_filters.FilterSet):
    """A filter given with an empty value, or a boolean other than true or false, is refused, not ignored."""

    def is_valid(self) -> bool:
        valid = super().is_valid()
        for name in self.filters:
            if name not in self.data:
                continue
            values = self.data.getlist(name) if hasattr(self.data, "getlist") else [self.data[name]]
            if isinstance(self.filters[name], django_filters.BooleanFilter) and not all(
                str(v).lower() in _BOOLEANS for v in values
            ):
                self.form.add_error(name, "Give true or false.")
                valid = False
            elif not any(str(v).strip() for v in values):
                self.form.add_error(name, "Give a value, or leave this parameter out.")
                valid = False
        return valid


class StrictFilterBackend(DjangoFilterBackend):
    filterset_base = StrictFilterSet


class StrictLimitOffsetPagination(LimitOffsetPagination):
    """`limit` (1 to max_limit) and `offset` (0 or more) must be whole numbers when given."""

    max_limit = 1000

    def _read(self, request, name: str, minimum: int, maximum: int | None = None) -> int | None:
        raw = request.query_params.get(name)
        if raw is None:
            return None
        value = int(raw) if raw.isdigit() else None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            most = f" and at most {maximum}" if maximum is not None else ""
            raise ValidationError(
                {name: [f"Give a whole number of at least {minimum}{most}, or leave {name} out."]}
            )
        return value

    def get_limit(self, request):
        limit = self._read(request, self.limit_query_param, 1, self.max_limit)
        return self.default_limit if limit is None else limit

    def get_offset(self, request):
        return self._read(request, self.offset_query_param, 0) or 0

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == self.limit_query_param:
                parameter["schema"].update(minimum=1, maximum=self.max_limit)
            elif parameter["name"] == self.offset_query_param:
                parameter["schema"]["minimum"] = 0
        return parameters


class WholeNumberField(forms.IntegerField):
    """Digits only: `1.0`, `0.5` or `1e3` are not an id."""

    def to_python(self, value):
        if value not in self.empty_values and not str(value).strip().isdigit():
            raise forms.ValidationError("Give a whole number.", code="invalid")
        return super().to_python(value)


class IdFilter(django_filters.NumberFilter):
    field_class = WholeNumberField
