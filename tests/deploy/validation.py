"""Validate Kubernetes objects against official schemas: built-in kinds with kubernetes-validate (strict),
custom resources against the CRDs carried in deploy/crds (made strict the same way: unknown fields refused).

The CRDs' CEL rules (x-kubernetes-validations) are not evaluated; everything else in their OpenAPI schema is.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

KUBERNETES_VERSION = "1.37.0"  # the newest that kubernetes-validate 1.37 ships
CRD_DIR = Path(__file__).resolve().parents[2] / "deploy" / "crds"
BUILT_IN_GROUPS = {
    "v1",
    "apps/v1",
    "batch/v1",
    "autoscaling/v2",
    "rbac.authorization.k8s.io/v1",
    "policy/v1",
    "networking.k8s.io/v1",
}


def _strict(schema):
    """Refuse unknown fields wherever the CRD lists the fields (as the API server's strict field validation)."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the strict OpenAPI schema of every served version of every carried CRD."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    schemas = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=loader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                schemas[(f"{group}/{version['name']}", kind)] = _strict(version["schema"]["openAPIV3Schema"])
    return schemas


def validate_object(obj: dict) -> str:
    """Raise with the reason when `obj` is invalid; return what it was checked against."""
    key = (obj["apiVersion"], obj["kind"])
    if key in crd_schemas():
        jsonschema.Draft7Validator(crd_schemas()[key]).validate(obj)
        return f"CRD {key[1]} {key[0]}"
    if obj["apiVersion"] not in BUILT_IN_GROUPS:
        raise AssertionError(f"no schema for {key}: carry its CRD in deploy/crds")
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    return f"Kubernetes {KUBERNETES_VERSION} strict"


def validate_objects(objects: list[dict]) -> None:
    errors = []
    for obj in objects:
        try:
            validate_object(obj)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            where = ".".join(str(part) for part in exc.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")
    assert not errors, "\n".join(errors)
