"""The public generation routes, one entry each: what the router, the simulator and the docs know of a route.

Dispatch (routing/server/app.py), the field rules (routing/rendering/fields.py), the checks (routing/server/checks.py), tokenising
(routing/rendering/tokenize.py, routing/rendering/tokenize_pool.py), answer assembly (routing/server/assemble.py), the P/D step
(routing/scheduling/disagg.py), the engine simulator's server and docs/request-fields.md read this table: a new route is a
new entry. Run `python -m routing.rendering.routes` to write the table of docs/request-fields.md from it.

No Django here: the simulator and the tokenizing workers import it too.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from routing.rendering.dialects import ANTHROPIC, OPENAI, Dialect
from routing.rendering.dialects import RESPONSES as RESPONSES_DIALECT

# How a route's prompt becomes the engine's tokens; the shape of its answer follows from it. A `prompt` text is
# tokenised as it is, with the tokenizer's special tokens (or comes as token ids); OpenAI chat messages go through
# the model's chat template; Anthropic messages and Responses input items are made chat messages first
# (routing/rendering/conversion.py), then go through it too.
PROMPT_TEXT = "prompt_text"
CHAT_MESSAGES = "chat_messages"
ANTHROPIC_MESSAGES = "anthropic_messages"
RESPONSES_INPUT = "responses_input"
TEMPLATED = (CHAT_MESSAGES, ANTHROPIC_MESSAGES, RESPONSES_INPUT)


@dataclass(frozen=True, slots=True)
class Route:
    """`fields`: the public fields, the only ones forwarded (routing/rendering/fields.py). `prompt`: the field that holds
    the prompt (the conversation of a templated route). `renders`: how the prompt becomes tokens (above).
    `output_limit`: the fields the engine reads its output limit from, in its order (the first one set counts);
    only they set the reservation. `disaggregated`: a prefill leg may run for it on another engine (OpenAI's
    routes only: the leg reads OpenAI's usage and sets `max_tokens`)."""

    path: str
    dialect: Dialect
    fields: frozenset[str]
    prompt: str
    renders: str
    output_limit: tuple[str, ...]
    disaggregated: bool = False

    def __post_init__(self):
        if self.renders not in (PROMPT_TEXT, *TEMPLATED):
            raise ValueError(f"{self.path}: unknown rendering {self.renders!r}")
        if not {self.prompt, *self.output_limit} <= self.fields:
            raise ValueError(f"{self.path}: its prompt and output-limit fields must be public fields")
        if self.disaggregated and self.dialect is not OPENAI:
            raise ValueError(f"{self.path}: only OpenAI's routes may be disaggregated")

    @property
    def templated(self) -> bool:
        return self.renders in TEMPLATED

    def output_limit_of(self, payload: dict) -> tuple[str, object]:
        """The output limit the engine reads from `payload`, and its field (the last one when none is set)."""
        for field in self.output_limit[:-1]:
            value = payload.get(field)
            if value is not None:
                return field, value
        return self.output_limit[-1], payload.get(self.output_limit[-1])


# Sampling and output controls vLLM takes on top of OpenAI's, on chat and text completions.
VLLM_SAMPLING = frozenset(
    {
        "top_k",
        "min_p",
        "repetition_penalty",
        "length_penalty",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "truncate_prompt_tokens",
        "prompt_logprobs",
        "allowed_token_ids",
        "bad_words",
        "structured_outputs",
        "return_tokens_as_token_ids",
        "return_token_ids",
        "return_token_offsets",
        "logprob_token_ids",
        "thinking_token_budget",
        "repetition_detection",
        "stream_interval",
    }
)

OPENAI_SHARED = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "n",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "seed",
        "user",
        "response_format",
    }
)

CHAT_COMPLETIONS = Route(
    path="/v1/chat/completions",
    dialect=OPENAI,
    fields=OPENAI_SHARED
    | VLLM_SAMPLING
    | frozenset(
        {
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "top_logprobs",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "functions",
            "function_call",
            "reasoning_effort",
            "metadata",
            "store",
            "service_tier",
            "prompt_cache_key",
            "safety_identifier",
            "verbosity",
            "modalities",
            "prediction",
            "web_search_options",
            "include_reasoning",
            # Template options the router's own renderer applies too (routing/rendering/tokenize.py).
            "add_generation_prompt",
            "continue_final_message",
            "chat_template_kwargs",
            "echo",
            "add_special_tokens",
            "documents",
        }
    ),
    prompt="messages",
    renders=CHAT_MESSAGES,
    output_limit=("max_completion_tokens", "max_tokens"),
    disaggregated=True,
)

COMPLETIONS = Route(
    path="/v1/completions",
    dialect=OPENAI,
    fields=OPENAI_SHARED
    | VLLM_SAMPLING
    | frozenset({"prompt", "max_tokens", "echo", "suffix", "best_of", "add_special_tokens"}),
    prompt="prompt",
    renders=PROMPT_TEXT,
    output_limit=("max_tokens",),
    disaggregated=True,
)

MESSAGES = Route(
    path="/v1/messages",
    dialect=ANTHROPIC,
    fields=frozenset(
        {
            "model",
            "messages",
            "system",
            "max_tokens",
            "metadata",
            "stop_sequences",
            "stream",
            "temperature",
            "top_p",
            "top_k",
            "tools",
            "tool_choice",
            "thinking",
            "service_tier",
            "context_management",
            "output_format",
            "output_config",
            "chat_template_kwargs",
        }
    ),
    prompt="messages",
    renders=ANTHROPIC_MESSAGES,
    output_limit=("max_tokens",),
)

RESPONSES = Route(
    path="/v1/responses",
    dialect=RESPONSES_DIALECT,
    fields=frozenset(
        {
            "model",
            "input",
            "instructions",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "max_output_tokens",
            "max_tool_calls",
            "temperature",
            "top_p",
            "top_logprobs",
            "stream",
            "store",
            "reasoning",
            "text",
            "include",
            "metadata",
            "prompt_cache_key",
            "safety_identifier",
            "service_tier",
            "truncation",
            "user",
            "previous_response_id",
            "background",
            # vLLM's sampling extras on this route
            "frequency_penalty",
            "presence_penalty",
            "logit_bias",
            "seed",
            "stop",
            "top_k",
            "min_p",
            "repetition_penalty",
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "stop_token_ids",
            "structured_outputs",
            "include_reasoning",
            "chat_template_kwargs",
        }
    ),
    prompt="input",
    renders=RESPONSES_INPUT,
    output_limit=("max_output_tokens",),
)

# By path. A test may add an entry for as long as it runs (and the simulator serves what is here when it starts).
ROUTES: dict[str, Route] = {
    route.path: route for route in (CHAT_COMPLETIONS, COMPLETIONS, MESSAGES, RESPONSES)
}


def listed(paths, last: str) -> str:
    """`a, b and c` (or `or c`): paths for a message."""
    paths = sorted(paths)
    return paths[0] if len(paths) == 1 else f"{', '.join(paths[:-1])} {last} {paths[-1]}"


# --- docs/request-fields.md -------------------------------------------------------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "request-fields.md"
DOC_BEGIN = "<!-- the table below is written by `python -m routing.rendering.routes` from routing/rendering/routes.py -->"
DOC_END = "<!-- end of the written table -->"


def fields_table() -> str:
    """The table of docs/request-fields.md: one row per route."""
    rows = [
        "| Route | Dialect | Prompt | Output limit | Prefill elsewhere | Fields forwarded |",
        "|---|---|---|---|---|---|",
    ]
    for route in sorted(ROUTES.values(), key=lambda r: r.path):
        rows.append(
            f"| `{route.path}` | {route.dialect.name} | `{route.prompt}` "
            f"| {', else '.join(f'`{field}`' for field in route.output_limit)} "
            f"| {'yes' if route.disaggregated else 'no'} "
            f"| {', '.join(f'`{name}`' for name in sorted(route.fields))} |"
        )
    return "\n".join([DOC_BEGIN, *rows, DOC_END])


def with_fields_table(doc: str) -> str:
    """`doc` with its written table replaced by the table of the routes as they are."""
    span = re.compile(re.escape(DOC_BEGIN) + ".*?" + re.escape(DOC_END), re.DOTALL)
    if not span.search(doc):
        raise ValueError(f"the doc has no table to write: it needs the line {DOC_BEGIN}")
    return span.sub(lambda _: fields_table(), doc, count=1)


if __name__ == "__main__":
    DOC.write_text(with_fields_table(DOC.read_text()))
    sys.stdout.write(f"wrote the table of {DOC}\n")
