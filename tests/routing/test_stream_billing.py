"""A stream that ends without its final usage is billed for what the engine did, never 0.

vLLM ends a stream that fails midway with an error event and `data: [DONE]`, and no usage chunk; with speculative
decoding or a `stream_interval` one chunk carries several tokens. The router asks for the running usage in every
chunk (`continuous_usage_stats`) and bills the last count it saw.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from ..serving.engines import MODEL_NAME
from .conftest import make_fleet
from .test_engine_errors import HostileEngine, openai_client
from .usage import usage_events


def chunk(text: str, prompt: int, completion: int, index: int = 0) -> bytes:
    data = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL_NAME,
        "choices": [{"index": index, "delta": {"content": text}, "finish_reason": None}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def fails_midway(request):
    """Three chunks of four tokens each (as with speculative decoding), then vLLM's error event and the end,
    in vLLM's compact JSON."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for index in range(3):
        await response.write(chunk("abcd", 900, 4 * (index + 1)))
        await asyncio.sleep(0.01)
    error = {"error": {"message": "engine step failed", "type": "InternalServerError", "code": 500}}
    await response.write(
        b"data: " + json.dumps(error, separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n"
    )
    return response


def test_a_stream_that_ends_without_usage_is_billed_its_running_counts(router_process):
    engine = HostileEngine({"/v1/chat/completions": fails_midway})
    fleet = make_fleet(router_process, [engine])
    stream = openai_client(fleet).chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=50, stream=True
    )
    request_id = stream.headers["x-request-id"]
    try:
        for _ in stream.parse():
            pass
    except Exception:
        pass  # the client sees the engine's error; what matters here is the bill
    (event,) = usage_events([request_id], wait_for=1)
    assert event.prompt_tokens == 900  # the engine's count, from its running usage
    assert event.output_tokens == 12  # its last running count: three chunks carried twelve tokens


async def two_choices_fail_midway(request):
    """n=2: vLLM's running count in each chunk is that choice's own (8 and 6 tokens by the end)."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for index, count in ((0, 4), (1, 4), (0, 8), (1, 6)):
        await response.write(chunk("abcd", 900, count, index))
    await response.write(b"data: [DONE]\n\n")
    return response


def test_several_choices_are_billed_the_sum_of_their_running_counts(router_process):
    engine = HostileEngine({"/v1/chat/completions": two_choices_fail_midway})
    fleet = make_fleet(router_process, [engine])
    stream = openai_client(fleet).chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=50, n=2, stream=True
    )
    for _ in stream.parse():
        pass
    (event,) = usage_events([stream.headers["x-request-id"]], wait_for=1)
    assert (event.prompt_tokens, event.output_tokens) == (900, 14)
