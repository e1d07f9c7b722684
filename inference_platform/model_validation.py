"""Run the model's own validation (field validators, unique and check constraints) from a DRF serializer,
so the API and the admin report the same clear messages that the database constraints stand behind."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers


class ModelCleanMixin:
    def get_validators(self):
        # The model's full_clean() checks unique constraints below, with their own messages; DRF's own
        # unique-together validators would also make every field of a constraint required.
        return []

    def validate(self, attrs):
        attrs = super().validate(attrs)
        model = self.Meta.model
        instance = model() if self.instance is None else model.objects.get(pk=self.instance.pk)
        for name, value in attrs.items():
            field = (
                model._meta.get_field(name) if name in {f.name for f in model._meta.get_fields()} else None
            )
            if field is not None and not field.many_to_many and not field.one_to_many:
                setattr(instance, name, value)
        exclude = self.model_clean_exclude(instance)
        try:
            instance.full_clean(exclude=exclude, validate_unique=True, validate_constraints=True)
        except DjangoValidationError as exc:
            detail = {
                ("non_field_errors" if key == "__all__" else key): [str(m) for m in messages]
                for key, messages in exc.message_dict.items()
            }
            raise serializers.ValidationError(detail) from exc
        return attrs

    def model_clean_exclude(self, instance) -> set[str]:
        """Fields not to validate here: relations the serializer fills in later (such as a nested parent)."""
        return set()
