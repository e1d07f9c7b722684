"""A vLLM logits processor that makes a model on random weights call tools, as the simulator's model does.

A model loaded with `--load-format dummy` writes noise, so an agent on it (Claude Code, Codex) never gets a tool
call to run, and the path a real model's calls take (vLLM's tool-call parser, the router, the CLI running the tool and
sending its result back) goes untested on the real engine. With this processor the engine plays the simulator's
model (simulator/server.py): a conversation that offers tools and whose last message is the user's gets a
call of the first tool, its arguments the schema's required properties with simple values
(serving/engine_plugins/tool_arguments.py), until the conversation holds `PLATFORM_TOOL_CALLS_PER_CONVERSATION`
calls (default 2); every other answer is left to the model. The call is written in the Hermes format the tiny
model's template and its `hermes` parser use (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`), token by
token, then the end-of-sequence token. The platform loads it beside AnswerLength for local vLLM engines on dummy
weights with the `hermes` tool parser (serving/engine_command.py):

    PYTHONPATH=<repository> python -m vllm.entrypoints.openai.api_server ... --logits-processors \\
        serving.engine_plugins.answer_length:AnswerLength serving.engine_plugins.tool_calls:ToolCalls
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tokenizers import Tokenizer
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from serving.engine_plugins.tool_arguments import planned_call

DEFAULT_CALLS = 2


class ToolCalls(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        folder = Path(vllm_config.model_config.tokenizer)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.limit = int(os.environ.get("PLATFORM_TOOL_CALLS_PER_CONVERSATION") or DEFAULT_CALLS)
        # batch index -> (the request's running output token ids, the tokens it is to write)
        self.requests: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins

    def _track(self, params, prompt_ids, output_ids: list[int]):
        if not prompt_ids:
            return None
        prompt = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        call = planned_call(prompt, self.limit)
        if call is None:
            return None
        script = self.tokenizer.encode(call, add_special_tokens=False).ids
        stop = params.eos_token_id
        if stop is None and params.all_stop_token_ids:
            stop = min(params.all_stop_token_ids)
        return output_ids, script + ([stop] if stop is not None else [])

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.requests, batch_update, self._track)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (output_ids, script) in self.requests.items():
            position = len(output_ids)
            if position < len(script):
                logits[index].fill_(float("-inf"))
                logits[index, script[position]] = 0.0
        return logits
