"""Run the model's own validation (field validators, unique and check constraints) from a DRF serializer,
so the API and the admin report the same clear messages that the database constraints stand behind; and take
each field only in the JSON type the API's schema gives it."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers
from rest_framework.settings import api_settings


def _type_of(field: serializers.Field) -> tuple[type, ...] | None:
    """The JSON types (as Python decodes them) the schema documents for a field; None: any."""
    if isinstance(field, serializers.BooleanField):
        return (bool,)
    if isinstance(field, serializers.IntegerField | serializers.PrimaryKeyRelatedField):
        return (int,)
    if isinstance(field, serializers.FloatField):
        return (int, float)
    if isinstance(field, serializers.DecimalField):
        as_string = getattr(field, "coerce_to_string", None)
        if as_string is None:
            as_string = api_settings.COERCE_DECIMAL_TO_STRING
        return (str,) if as_string else (int, float, str)
    if isinstance(
        field, serializers.ListField | serializers.ListSerializer | serializers.MultipleChoiceField
    ):
        return (list,)
    if isinstance(field, serializers.JSONField):
        return None
    if isinstance(field, serializers.Serializer):
        return (dict,)
    if isinstance(field, serializers.CharField | serializers.ChoiceField | serializers.DateTimeField):
        return (str,)
    if isinstance(field, serializers.DateField | serializers.DurationField | serializers.TimeField):
        return (str,)
    return None


TYPE_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "an object",
}


class StrictTypesMixin:
    """Refuse a value of the wrong JSON type with a 400 that names the type wanted. DRF would coerce it
    (`"5"` to 5, `0` to `"0"`, `"yes"` to true): the API's schema, which clients are generated from, promises
    the types, so a client sending another has a bug it should hear about."""

    def to_internal_value(self, data):
        if isinstance(data, dict):
            errors = {}
            for name, field in self.fields.items():
                if field.read_only or field.source == "*" or name not in data:
                    continue
                value, wanted = data[name], _type_of(field)
                if value is None or wanted is None:
                    continue
                if isinstance(value, bool) and bool not in wanted:
                    ok = False
                else:
                    ok = isinstance(value, wanted)
                if not ok:
                    names = " or ".join(dict.fromkeys(TYPE_NAMES[t] for t in wanted))
                    errors[name] = [f"Must be {names}, not {type(value).__name__}: {value!r:.40}."]
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)


class ModelCleanMixin(StrictTypesMixin):
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
