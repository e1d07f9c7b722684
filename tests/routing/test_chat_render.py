"""A conversation's next turn renders exactly as the whole template would, while the messages it shares with a
recent turn are not rendered again; a template whose message loop may depend on more is always rendered whole."""

from __future__ import annotations

import copy
import json
import random

import pytest

from routing.rendering.chat_render import Ineligible, SplitTemplate
from routing.rendering.tokenize import RouterTokenizer, TemplateSandbox

from ..serving.engines import MODEL_DIR
from .render_corpus import CASES, CHAT, MESSAGES, RESPONSES

pytestmark = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)

# A template in the manner of the reasoning models': a namespace set by a reverse scan before the loop decides
# which assistant turns keep their reasoning, a macro renders content, and the loop looks at its neighbours.
REASONING = """
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}{%- else -%}{%- for part in content -%}{{ part.text }}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_query=messages|length - 1) -%}
{%- for m in messages[::-1] -%}
{%- if m.role == 'user' and ns.last_query == messages|length - 1 -%}{%- set ns.last_query = messages|length - 1 - loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}<|im_start|>user{%- endif %}
<tool_response>{{ text(message.content) }}</tool_response>
{%- if loop.last or loop.nextitem.role != 'tool' -%}<|im_end|>
{% endif -%}
{%- else -%}
<|im_start|>{{ message.role }}
{% if message.role == 'assistant' and message.reasoning_content and loop.index0 > ns.last_query -%}
<think>{{ message.reasoning_content }}</think>
{% endif -%}
{{ text(message.content) }}
{%- for call in message.tool_calls or [] -%}
{%- if not loop.first %}
{% endif %}<tool_call>{{ call.function.name }} {{ call.function.arguments | tojson }}</tool_call>
{%- endfor -%}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>
{% endif -%}{%- endif -%}
"""

# The system prompt taken out before the loop (messages[0]), the loop's index in every message.
NUMBERED = """
{%- if messages[0].role == 'system' -%}{%- set system = messages[0].content -%}{%- set start = 1 -%}
{%- else -%}{%- set system = 'You are helpful.' -%}{%- set start = 0 -%}{%- endif -%}
<|im_start|>system
{{ system }}<|im_end|>
{% for message in messages -%}
{%- if loop.index0 >= start -%}
<|im_start|>{{ message.role }} #{{ loop.index }}
{{ message.content if message.content is string else '' }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""

# A message's text that depends on the message before it, unguarded: the first one's reads the last one.
WRAPPING = """{% for message in messages %}{{ message.role }} after {{ messages[loop.index0 - 1].role }}
{% endfor %}"""

INELIGIBLE = {
    "loop.length": "{% for message in messages %}{{ loop.length }}{{ message.role }}{% endfor %}",
    "namespace written in the loop": (
        "{% set ns = namespace(n=0) %}{% for message in messages %}{% set ns.n = ns.n + 1 %}{{ ns.n }}"
        "{% endfor %}"
    ),
    "messages as a whole": "{% for message in messages %}{{ messages | length }}{% endfor %}",
    "a far index": "{% for message in messages %}{{ messages[-1].role }}{% endfor %}",
    "continue": "{% for message in messages %}{% if loop.first %}{% continue %}{% endif %}x{% endfor %}",
    "a joiner": "{% set comma = joiner(',') %}{% for message in messages %}{{ comma() }}{% endfor %}",
    "the random filter": "{% for message in messages %}{{ [1, 2] | random }}{% endfor %}",
    "a filtered loop": "{% for message in messages if message.role != 'system' %}x{% endfor %}",
    "a macro reading messages": (
        "{% macro last() %}{{ messages[-1].role }}{% endmacro %}{% for message in messages %}{{ last() }}"
        "{% endfor %}"
    ),
    "two message loops": "{% for m in messages %}a{% endfor %}{% for message in messages %}b{% endfor %}",
}


def sandbox() -> TemplateSandbox:
    """The environment the router renders templates in (routing/rendering/tokenize.py)."""
    return tokenizer_with(None).template.environment


def tokenizer_with(template: str | None) -> RouterTokenizer:
    return RouterTokenizer(MODEL_DIR, chat_template=template)


def whole(tokenizer: RouterTokenizer, payload: dict, path: str) -> str:
    return tokenizer.render(tokenizer.chat_inputs(copy.deepcopy(payload), path))


class Counted:
    """Counts the messages a tokenizer's split template renders on their own."""

    def __init__(self, tokenizer: RouterTokenizer):
        self.rendered = 0
        piece = tokenizer.split._piece

        def counted(*args):
            self.rendered += 1
            return piece(*args)

        tokenizer.split._piece = counted


def tool_session(path: str, turns: int, seed: int = 0) -> list[dict]:
    """The payloads of an agent's successive turns: tool calls and their results, now and then a new user
    prompt, the whole conversation re-sent each time (parsed afresh, as the router gets it)."""
    rng = random.Random(seed)
    tools = [
        {"name": f"tool_{i}", "description": f"Tool {i}.", "input_schema": {"type": "object"}}
        for i in range(3)
    ]
    if path == RESPONSES:
        payload = {
            "instructions": "You are a coding agent.",
            "tools": [
                {"type": "function", "name": t["name"], "parameters": t["input_schema"]} for t in tools
            ],
            "input": [{"type": "message", "role": "user", "content": "Fix the failing test."}],
        }
    elif path == MESSAGES:
        payload = {
            "system": [
                {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}
            ],
            "tools": tools,
            "messages": [{"role": "user", "content": "Fix the failing test."}],
        }
    else:
        payload = {
            "tools": [
                {"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}
                for t in tools
            ],
            "messages": [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Fix the failing test."},
            ],
        }
    out = [copy.deepcopy(payload)]
    pending = None  # the second result of two parallel calls, sent a turn later
    for turn in range(turns):
        calls = [f"c{turn}", f"d{turn}"] if rng.random() < 0.3 else [f"c{turn}"]
        if pending:
            new, pending = [result(path, pending)], None
        elif rng.random() < 0.2:
            new = [{"role": "user", "content": f"Now also look at case {turn}."}]
        else:
            new = [assistant(path, turn, calls), result(path, calls[0])]
            pending = calls[1] if len(calls) > 1 else None
        field = "input" if path == RESPONSES else "messages"
        if path == RESPONSES:
            new = [item for message in new for item in responses_items(message)]
        payload[field] = payload[field] + new
        out.append(json.loads(json.dumps(payload)))
    return out


def responses_items(message: dict) -> list[dict]:
    """A chat message as Codex sends it to the Responses API: reasoning, text and calls as items of their own."""
    if message["role"] == "tool":
        return [
            {"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]}
        ]
    if message["role"] == "user":
        return [
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": message["content"]}],
            }
        ]
    return [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": message["reasoning_content"]}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": message["content"]}],
        },
        *(
            {
                "type": "function_call",
                "call_id": call["id"],
                "name": "tool_1",
                "arguments": call["function"]["arguments"],
            }
            for call in message["tool_calls"]
        ),
    ]


def assistant(path: str, turn: int, calls: list[str]) -> dict:
    arguments = {"path": f"src/m{turn}.py"}
    if path == MESSAGES:
        return {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": f"step {turn}", "signature": "x"},
                {"type": "text", "text": f"Reading {turn}."},
                *({"type": "tool_use", "id": call, "name": "tool_1", "input": arguments} for call in calls),
            ],
        }
    return {
        "role": "assistant",
        "content": f"Reading {turn}.",
        "reasoning_content": f"step {turn}",
        "tool_calls": [
            {
                "id": call,
                "type": "function",
                "function": {"name": "tool_1", "arguments": json.dumps(arguments)},
            }
            for call in calls
        ],
    }


def result(path: str, call: str) -> dict:
    if path == MESSAGES:
        return {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call, "content": f"file {call}"}],
        }
    return {"role": "tool", "tool_call_id": call, "content": f"file {call}"}


@pytest.mark.heavy
@pytest.mark.parametrize(
    "template",
    [None, REASONING, NUMBERED, WRAPPING],
    ids=["model's own", "reasoning", "numbered", "wrapping"],
)
@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
def test_each_next_turn_renders_as_the_whole_template_and_only_new_messages_are_rendered(template, path):
    tokenizer = tokenizer_with(template)
    assert tokenizer.split is not None
    counted = Counted(tokenizer)
    turns = tool_session(path, 30)
    for payload in turns:
        assert tokenizer.render_request(payload, path) == whole(tokenizer, payload, path)
    # A whole render per turn would render about 31 * 30 messages; each turn renders its new messages, the
    # one before them (which was last) and the first one (whose neighbour before it would be the last).
    assert counted.rendered < 10 * len(turns)


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
def test_each_next_turn_tokenises_as_its_whole_text(path):
    """The ids of the characters a turn shares with the last are taken from it without comparing them."""
    tokenizer = tokenizer_with(None)
    for payload in tool_session(path, 20, seed=5):
        text = whole(tokenizer, payload, path)
        expected = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        assert list(tokenizer.encode_request(payload, path)) == expected


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_a_changed_message_anywhere_is_rendered_again(path):
    tokenizer = tokenizer_with(REASONING)
    turns = tool_session(path, 12, seed=3)
    for payload in turns:
        tokenizer.render_request(payload, path)
    rng = random.Random(7)
    last = turns[-1]
    for _ in range(20):
        edited = copy.deepcopy(last)
        message = edited["messages"][rng.randrange(len(edited["messages"]))]
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = content + " (edited)"
        else:
            message["content"] = "replaced"
        edited["messages"].append({"role": "user", "content": "and?"})
        assert tokenizer.render_request(edited, path) == whole(tokenizer, edited, path)
        # The original branch is still continued correctly after its edited sibling.
        assert tokenizer.render_request(last, path) == whole(tokenizer, last, path)


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_what_else_the_template_sees_is_compared_too(path):
    tokenizer = tokenizer_with(REASONING)
    payload = tool_session(path, 6)[-1]
    tokenizer.render_request(payload, path)
    variants = [
        {**payload, "tools": payload["tools"][:1]},
        {**payload, "chat_template_kwargs": {"enable_thinking": False}},
        {**payload, "messages": payload["messages"][:-1]},  # the conversation cut back: a new last message
    ]
    if path == MESSAGES:
        variants.append({**payload, "system": "A different system prompt."})
    else:
        variants.append(
            {**payload, "messages": [{"role": "system", "content": "Other."}, *payload["messages"][1:]]}
        )
    for variant in variants:
        assert tokenizer.render_request(variant, path) == whole(tokenizer, variant, path)
        assert tokenizer.render_request(payload, path) == whole(tokenizer, payload, path)


@pytest.mark.heavy
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_every_agent_shape_renders_alike_message_by_message(case):
    """Each corpus request, grown message by message (or Responses input item by item) as a conversation
    would be, renders as the whole template does."""
    tokenizer = tokenizer_with(None)
    field = "input" if case.path == RESPONSES else "messages"
    messages = case.payload[field]
    grown = (
        [copy.deepcopy(case.payload)]
        if isinstance(messages, str)
        else [{**case.payload, field: messages[:count]} for count in range(1, len(messages) + 1)]
    )
    for payload in map(copy.deepcopy, grown):
        try:
            expected = whole(tokenizer, payload, case.path)
        except ValueError as exc:  # a conversation cut where the template refuses it
            with pytest.raises(type(exc)):
                tokenizer.render_request(payload, case.path)
            continue
        assert tokenizer.render_request(payload, case.path) == expected


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(INELIGIBLE))
def test_a_loop_that_may_depend_on_more_is_rendered_whole(name):
    env = sandbox()
    with pytest.raises(Ineligible):
        SplitTemplate(env, INELIGIBLE[name])
    tokenizer = tokenizer_with(INELIGIBLE[name])
    assert tokenizer.split is None
    payload = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    if name != "the random filter":  # whose every render may differ
        assert tokenizer.render_request(payload, CHAT) == whole(tokenizer, payload, CHAT)


def test_the_split_reads_neighbours_as_the_template_does():
    env = sandbox()
    split = SplitTemplate(env, tokenizer_with(None).template_source)
    assert (split.low, split.high, split.fixed, split.pre_fixed) == (-1, 1, -1, 0)
    split = SplitTemplate(env, REASONING)
    assert (split.low, split.high, split.pre_fixed) == (-1, 1, None)  # the reverse scan reads every message
    split = SplitTemplate(env, NUMBERED)
    assert (split.low, split.high, split.pre_fixed) == (0, 0, 0)


def test_recent_conversations_are_kept_within_their_bound():
    tokenizer = tokenizer_with(None)
    tokenizer.conversations.max_chars = 5_000
    sessions = [tool_session(CHAT, 8, seed=seed) for seed in range(12)]
    for turn in range(9):
        for session in sessions:
            payload = copy.deepcopy(session[turn])
            payload["messages"][1]["content"] += f" (session {sessions.index(session)})"
            assert tokenizer.render_request(payload, CHAT) == whole(tokenizer, payload, CHAT)
    conversations = tokenizer.conversations
    kept = [c for group in conversations._groups.values() for c in group]
    assert conversations._chars == sum(c.counted for c in kept)
    assert conversations._chars <= 5_000 or len(conversations._groups) == 1
    assert len(kept) < len(sessions)
    # Many short conversations: bounded by their number too.
    conversations.max_chars, conversations.max_groups = 10**9, 5
    for n in range(20):
        payload = {"messages": [{"role": "user", "content": f"question {n}"}]}
        assert tokenizer.render_request(payload, CHAT) == whole(tokenizer, payload, CHAT)
    assert len(conversations._groups) == 5
