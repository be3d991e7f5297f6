"""A simulated engine's request, read from its body as vLLM reads it: the prompt as token ids (a
completion's `prompt` a string, a list of strings or a list of token ids; a chat's messages
rendered to text, then tokenized), `max_tokens`, `stream` and `stream_options.include_usage`,
`return_token_ids`, and `logprobs` (completions: a count; chat: `logprobs: true` and
`top_logprobs`). `ignore_eos`, `temperature`, `seed` and `stop` are accepted and change nothing:
the simulated model is greedy and deterministic and never ends before `max_tokens`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from motor.contract.sim_tokenizer import VOCAB_SIZE, render_chat, tokenize


@dataclass(frozen=True)
class SimRequest:
    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    return_token_ids: bool = False
    logprobs: int | None = None  # top alternatives per token, None: no logprobs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_ids(body: dict[str, Any], chat: bool) -> list[int] | str:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return 'messages: must be a non-empty list of {"role", "content"} objects'
        return tokenize(render_chat(messages))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(_is_int(p) for p in prompt):
        if not all(0 <= p < VOCAB_SIZE for p in prompt):
            return f"prompt: token ids must be at least 0 and below the vocabulary's size {VOCAB_SIZE}"
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompt = "\n".join(prompt)
    if not isinstance(prompt, str):
        return "prompt: must be a string, a list of strings or a list of token ids"
    return tokenize(prompt)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None | str:
    if chat:
        top = body.get("top_logprobs")
        if body.get("logprobs") is not True:
            return "top_logprobs: needs logprobs: true" if top else None
        if top is None:
            return 0
        return top if _is_int(top) and 0 <= top <= 20 else "top_logprobs: must be an integer from 0 to 20"
    count = body.get("logprobs")
    if count is None:
        return None
    return count if _is_int(count) and 0 <= count <= 20 else "logprobs: must be an integer from 0 to 20"


def parse(body: dict[str, Any], chat: bool, default_max_tokens: int) -> SimRequest | str:
    """The request, or what is wrong with it (a 400's message)."""
    prompt_ids = _prompt_ids(body, chat)
    if isinstance(prompt_ids, str):
        return prompt_ids
    if not prompt_ids:
        return "prompt: the prompt is empty (no tokens)"
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if not _is_int(max_tokens) or max_tokens < 1:
        return "max_tokens: must be a positive integer"
    logprobs = _logprobs(body, chat)
    if isinstance(logprobs, str):
        return logprobs
    options = body.get("stream_options")
    return SimRequest(
        chat=chat,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        stream=body.get("stream") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        return_token_ids=body.get("return_token_ids") is True,
        logprobs=logprobs,
    )
