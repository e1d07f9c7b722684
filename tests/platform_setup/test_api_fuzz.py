"""Schemathesis over the whole REST API, from the schema it serves at /api/schema/: the examples, coverage
(boundary and negative values for every parameter and body) and fuzzing phases per operation, then the stateful
phase (create, then read, change and revoke what was created, following the schema's links).

What must hold: no server error, every response matches its documented schema and content type, and data the
schema forbids is refused with a 4xx. Calls go straight to the WSGI app as an operator with a personal token,
against the real PostgreSQL (committed, as in production: no test transaction around the requests).

Run time is bounded by SCHEMATHESIS_MAX_EXAMPLES (per operation and phase; default 5).
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from knox.models import AuthToken
from schemathesis.config import SchemathesisConfig

MAX_EXAMPLES = int(os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "5"))

# Revoking the run's own token would sign the rest of the run out; those two are tested in
# tests/tenants/test_sign_in_limits.py.
SIGNS_OUT = "^/api/auth/token/revoke"


def _config() -> SchemathesisConfig:
    return SchemathesisConfig.from_dict(
        {
            "generation": {"mode": "all", "max-examples": MAX_EXAMPLES},
            "phases": {
                "examples": {"enabled": True},
                "coverage": {"enabled": True},
                "fuzzing": {"enabled": True},
                "stateful": {"enabled": True},
            },
            "checks": {
                "enabled": False,
                "not_a_server_error": {"enabled": True},
                "content_type_conformance": {"enabled": True},
                "response_schema_conformance": {"enabled": True},
                "response_headers_conformance": {"enabled": True},
                # 429: the token endpoint's throttle, documented; it refuses before reading the body.
                "negative_data_rejection": {
                    "enabled": True,
                    "expected-statuses": [
                        "400",
                        "401",
                        "403",
                        "404",
                        "405",
                        "406",
                        "409",
                        "415",
                        "422",
                        "429",
                    ],
                },
            },
        }
    )


def _load_schema():
    from inference_platform.wsgi import application

    # Loaded as the tests are collected (schemathesis makes one test per operation); asks no database.
    loaded = schemathesis.openapi.from_wsgi("/api/schema/?format=json", application, config=_config())
    return loaded.exclude(path_regex=SIGNS_OUT)


schema = _load_schema()


@pytest.fixture
def operator_token(world, transactional_db) -> str:
    _, token = AuthToken.objects.create(user=world.operator)
    return token


_hypothesis = hypothesis_settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same cases on every run: a failure here is reproducible
    database=None,
    suppress_health_check=list(HealthCheck),
)


@schema.parametrize()
@_hypothesis
def test_every_operation_answers_within_its_schema(case, operator_token):
    case.call_and_validate(headers={"Authorization": f"Bearer {operator_token}"})


def test_linked_operations_hold_together(operator_token):
    headers = {"Authorization": f"Bearer {operator_token}"}

    class Workflow(schema.as_state_machine()):
        def get_call_kwargs(self, case):
            return {"headers": headers}

    Workflow.run(
        settings=hypothesis_settings(
            max_examples=MAX_EXAMPLES,
            stateful_step_count=6,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
    )
