"""A deployment's tool calling, reasoning and chat template settings, through the REST API, the admin and the
portal: the family default shown with where it came from, unknown parsers refused, "none" switching them off."""

from __future__ import annotations

import pytest
from django.test import Client

from serving.engine_command import EnginePorts, render_engine_command
from serving.model_families import REASONING_PARSERS, TOOL_CALL_PARSERS
from serving.models import ModelDeployment

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def rendered(deployment: ModelDeployment) -> list[str]:
    deployment.refresh_from_db()
    return render_engine_command(
        deployment=deployment, pool=deployment.pools.get(), ports=EnginePorts(http=8100, kv_events=5557)
    ).argv


def new_deployment(**fields) -> dict:
    return {
        "name": "agent-model",
        "served_model_name": "agent-model",
        "model_source": "models/tiny-qwen",
        "engine_kind": "sim",
        "pools": [{"name": "main", "replicas": 1}],
        **fields,
    }


# --- the REST API -------------------------------------------------------------------------------------


def test_it_shows_the_family_default_and_where_it_came_from(world, client_for):
    body = client_for(world.operator).get(f"/api/deployments/{world.deployment.pk}/").json()
    assert (body["tool_call_parser"], body["reasoning_parser"], body["chat_template"]) == ("", "", "")
    tools = body["tool_calling"]
    assert tools["tool_call_parser"] == "hermes" and tools["reasoning_parser"] is None
    assert tools["source"] == tools["reasoning_source"] == "family qwen2" and tools["family"] == "qwen2"
    assert "config.json model_type 'qwen2'" in tools["note"]
    assert tools == client_for(world.operator).get("/api/deployments/").json()["results"][0]["tool_calling"]


@pytest.mark.parametrize(
    "field, value, valid",
    [
        ("tool_call_parser", "qwen3", TOOL_CALL_PARSERS),  # a reasoning parser's name
        ("tool_call_parser", "Hermes", TOOL_CALL_PARSERS),
        ("reasoning_parser", "hermes", REASONING_PARSERS),
    ],
)
def test_an_unknown_parser_is_a_400_listing_the_valid_ones(world, client_for, field, value, valid):
    response = client_for(world.operator).post(
        "/api/deployments/", new_deployment(**{field: value}), format="json"
    )
    assert response.status_code == 400, response.content
    [message] = response.json()[field]
    assert f'"{value}" is not a' in message and '"none"' in message
    assert all(name in message for name in valid)
    assert not ModelDeployment.objects.filter(name="agent-model").exists()

    response = client_for(world.operator).patch(
        f"/api/deployments/{world.deployment.pk}/", {field: value}, format="json"
    )
    assert response.status_code == 400 and field in response.json()


def test_none_switches_tool_calling_off_and_an_explicit_parser_is_the_deployments(world, client_for):
    url = f"/api/deployments/{world.deployment.pk}/"
    response = client_for(world.operator).patch(url, {"tool_call_parser": "none"}, format="json")
    assert response.status_code == 200, response.content
    tools = response.json()["tool_calling"]
    assert (tools["tool_call_parser"], tools["source"]) == (None, "deployment")
    assert "switched off" in tools["note"]
    assert "--tool-call-parser" not in rendered(world.deployment)

    response = client_for(world.operator).patch(
        url, {"tool_call_parser": "pythonic", "reasoning_parser": "qwen3"}, format="json"
    )
    tools = response.json()["tool_calling"]
    assert (tools["tool_call_parser"], tools["reasoning_parser"]) == ("pythonic", "qwen3")
    assert tools["source"] == tools["reasoning_source"] == "deployment"
    argv = rendered(world.deployment)
    assert argv[argv.index("--tool-call-parser") + 1] == "pythonic"
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"

    # Blank again: back to the family's default.
    response = client_for(world.operator).patch(
        url, {"tool_call_parser": "", "reasoning_parser": ""}, format="json"
    )
    assert response.json()["tool_calling"]["tool_call_parser"] == "hermes"


def test_a_model_of_no_known_family_is_created_with_tool_calling_off_and_told_why(world, client_for):
    response = client_for(world.operator).post(
        "/api/deployments/", new_deployment(model_source="example-org/house-model"), format="json"
    )
    assert response.status_code == 201, response.content
    tools = response.json()["tool_calling"]
    assert (tools["tool_call_parser"], tools["source"], tools["family"]) == (None, "none", None)
    assert "No model family matched example-org/house-model" in tools["note"]
    assert "set tool_call_parser to enable tool calls" in tools["note"]


def test_the_chat_template_is_checked_and_rendered_as_given(world, client_for):
    url = f"/api/deployments/{world.deployment.pk}/"
    response = client_for(world.operator).patch(url, {"chat_template": "{% if %}"}, format="json")
    assert response.status_code == 400 and "not valid Jinja" in response.json()["chat_template"][0]
    response = client_for(world.operator).patch(url, {"chat_template": "chat.jinja"}, format="json")
    assert response.status_code == 400 and "not a path" in response.json()["chat_template"][0]

    response = client_for(world.operator).patch(url, {"chat_template": TEMPLATE}, format="json")
    assert response.status_code == 200 and response.json()["chat_template"] == TEMPLATE
    argv = rendered(world.deployment)
    assert argv[argv.index("--chat-template") + 1] == TEMPLATE


def test_only_operators_change_the_tool_calling_settings(world, client_for):
    url = f"/api/deployments/{world.deployment.pk}/"
    response = client_for(world.admin_a).patch(url, {"tool_call_parser": "none"}, format="json")
    assert response.status_code == 403
    world.deployment.refresh_from_db()
    assert world.deployment.tool_call_parser == ""


# --- the admin and the portal -------------------------------------------------------------------------


@pytest.fixture
def operator_client(world) -> Client:
    world.operator.is_staff = True
    world.operator.is_superuser = True
    world.operator.save()
    client = Client()
    client.force_login(world.operator)
    return client


def admin_form(deployment: ModelDeployment, **fields) -> dict:
    data = {
        "name": deployment.name,
        "served_model_name": deployment.served_model_name,
        "model_source": deployment.model_source,
        "engine_kind": deployment.engine_kind,
        "orchestrator": deployment.orchestrator,
        "max_model_len": deployment.max_model_len,
        "block_size": deployment.block_size,
        "desired_status": deployment.desired_status,
        "tool_call_parser": "",
        "reasoning_parser": "",
        "chat_template": "",
        # The pools inline, left as it is.
        "pools-TOTAL_FORMS": "0",
        "pools-INITIAL_FORMS": "0",
        "pools-MIN_NUM_FORMS": "0",
        "pools-MAX_NUM_FORMS": "1000",
    }
    return {**data, **fields}


@pytest.fixture
def bare_deployment(db) -> ModelDeployment:
    return ModelDeployment.objects.create(
        name="bare", served_model_name="bare-qwen", model_source="models/tiny-qwen", engine_kind="sim"
    )


def test_the_admin_shows_what_is_in_effect_and_refuses_an_unknown_parser(operator_client, bare_deployment):
    url = f"/admin/serving/modeldeployment/{bare_deployment.pk}/change/"
    page = operator_client.get(url).content.decode()
    assert "Tool-call parser: hermes (family qwen2)" in page

    response = operator_client.post(url, admin_form(bare_deployment, tool_call_parser="hermez"))
    assert response.status_code == 200  # the form again, with the error
    errors = response.context["adminform"].form.errors
    assert '"hermez" is not a tool-call parser' in errors["tool_call_parser"][0]
    assert "llama3_json" in errors["tool_call_parser"][0]
    bare_deployment.refresh_from_db()
    assert bare_deployment.tool_call_parser == ""

    response = operator_client.post(url, admin_form(bare_deployment, tool_call_parser="none"))
    assert response.status_code == 302, response.content[:3000]
    bare_deployment.refresh_from_db()
    assert bare_deployment.tool_call_parser == "none"
    page = operator_client.get(url).content.decode()
    assert "Tool-call parser: off (deployment)" in page
    listing = operator_client.get("/admin/serving/modeldeployment/").content.decode()
    assert '<td class="field-tool_calling_summary">off</td>' in listing


def test_the_portal_page_shows_the_effective_parsers_and_why_they_are_off(operator_client, world):
    url = f"/portal/deployments/{world.deployment.pk}/"
    page = operator_client.get(url).content.decode()
    section = page.split('id="tool-calling"')[1].split("</section>")[0]
    assert '<td id="tool-call-parser">hermes</td>' in section and "family qwen2" in section
    assert "the model's own" in section  # no template override

    ModelDeployment.objects.filter(pk=world.deployment.pk).update(model_source="example-org/house-model")
    section = operator_client.get(url).content.decode().split('id="tool-calling"')[1].split("</section>")[0]
    assert '<td id="tool-call-parser">off</td>' in section
    assert "No model family matched example-org/house-model" in section
    assert "set tool_call_parser to enable tool calls" in section
