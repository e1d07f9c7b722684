"""The stream relay's fast path: the leading run of ordinary events is passed on whole, and what it counts and
keeps matches looking at every event one by one."""

from __future__ import annotations

import orjson
import pytest

from routing.dialects import ANTHROPIC, OPENAI


def event(data: dict | str) -> bytes:
    return b"data: " + (data.encode() if isinstance(data, str) else orjson.dumps(data)) + b"\n\n"


def content(text: str) -> bytes:
    return event({"id": "c", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})


USAGE = event({"id": "c", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
DONE = event("[DONE]")


def events_of(stream: bytes) -> list[bytes]:
    return [piece for piece in stream[:-2].split(b"\n\n")] if stream else []


def special(dialect, piece: bytes) -> bool:
    return dialect.usage_from_event(piece) is not None or dialect.is_terminal_event(piece)


PLAIN = content("a") + content("b") + content("c")
ROLE = event({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})


@pytest.mark.parametrize(
    "events, expected",
    [
        (PLAIN, len(PLAIN)),
        (PLAIN + USAGE + DONE, len(PLAIN)),
        (USAGE + DONE, 0),
        (DONE, 0),
        (ROLE + content("x") + USAGE, len(ROLE + content("x"))),
        # Text that reads like a marker is escaped inside the JSON, so it does not cut the run short...
        (content('"usage" and "choices":[{') + USAGE + DONE, len(content('"usage" and "choices":[{'))),
        # ...except a bare [DONE], which only makes the relay look at the rest one by one.
        (content("a") + content("[DONE]") + USAGE + DONE, len(content("a"))),
    ],
)
def test_the_plain_prefix_is_whole_ordinary_events_counted_as_one_by_one(events, expected):
    plain = OPENAI.plain_prefix(events)
    assert plain == expected
    head = events_of(events[:plain])
    assert b"\n\n".join(head) + (b"\n\n" if head else b"") == events[:plain]  # whole events
    assert not any(special(OPENAI, piece) for piece in head)
    assert events[:plain].count(OPENAI.CONTENT_MARKER) == sum(OPENAI.is_content_event(p) for p in head)


def test_the_usage_event_and_the_end_are_never_in_the_plain_prefix():
    events = content("a") + USAGE + DONE
    assert events[OPENAI.plain_prefix(events) :] == USAGE + DONE


def test_a_dialect_without_markers_looks_at_every_event():
    stream = b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n'
    assert ANTHROPIC.plain_prefix(stream) == 0


@pytest.mark.parametrize(
    "event, stripped",
    [
        (
            b'data: {"choices":[{"delta":{"content":"a}"}}],"usage":{"prompt_tokens":5,"completion_tokens":1}}',
            b'data: {"choices":[{"delta":{"content":"a}"}}]}',
        ),
        (  # counts nested in objects of counts
            b'data: {"choices":[{}],"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":4},'
            b'"completion_tokens":1},"extra":1}',
            b'data: {"choices":[{}],"extra":1}',
        ),
        (b'data: {"choices":[{"delta":{}}]}', b'data: {"choices":[{"delta":{}}]}'),  # none to take out
        (
            b'data: {"choices":[{}],"usage":{"prompt_tokens":5',
            b'data: {"choices":[{}],"usage":{"prompt_tokens":5',
        ),
    ],
)
def test_the_running_usage_the_router_asked_for_is_taken_out_of_a_chunk(event, stripped):
    assert OPENAI.without_running_usage(event) == stripped
