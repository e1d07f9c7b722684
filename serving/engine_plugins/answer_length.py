"""A vLLM logits processor that ends every answer after a fixed number of tokens, for engines on random weights.

A model loaded with `--load-format dummy` writes noise and never the end-of-sequence token, so every answer runs to
its output limit, and an agent (Claude Code) takes an answer cut there for an error. With this processor the
engine plays a model that stops by itself, as the simulator does with `--answer-length`: once a request has
`PLATFORM_ANSWER_LENGTH - 1` tokens (default 317), its next token is forced to be the end-of-sequence token (else its
first stop token). Requests with `ignore_eos` or without stop tokens are left alone; vLLM loads no custom logits
processor beside speculative decoding, so such pools are started without it. The platform loads it only for dummy weights
(serving/engine_command.py):

    PYTHONPATH=<repository> python -m vllm.entrypoints.openai.api_server ... \\
        --logits-processors serving.engine_plugins.answer_length:AnswerLength
"""

from __future__ import annotations

import os

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

DEFAULT_LENGTH = 317


class AnswerLength(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.length = int(os.environ.get("PLATFORM_ANSWER_LENGTH") or DEFAULT_LENGTH)
        # batch index -> (the request's running output token ids, the token that ends it)
        self.requests: dict[int, tuple[list[int], int]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins

    @staticmethod
    def _track(params, _prompt_ids, output_ids: list[int]):
        if params.ignore_eos:
            return None
        stop = params.eos_token_id
        if stop is None:
            if not params.all_stop_token_ids:
                return None
            stop = min(params.all_stop_token_ids)
        return output_ids, stop

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.requests, batch_update, self._track)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (output_ids, stop) in self.requests.items():
            if len(output_ids) >= self.length - 1:
                logits[index].fill_(float("-inf"))
                logits[index, stop] = 0.0
        return logits
