"""A request's prompt as token ids, as the engine will tokenize it, for the door's KV-cache scorer,
where the door knows them without asking: a prompt given as token ids, or any prompt of the
simulated engine (its tokenizer is motor/contract/sim_tokenizer.py). A real engine's text prompt
is tokenized by the engine itself (front_door/kv_tokenize.py)."""

from __future__ import annotations

import json
from typing import Any

from motor.contract.sim_tokenizer import render_chat, tokenize

SIM = "sim"


def json_object(body: bytes) -> dict[str, Any] | None:
    """A request's body read once for the scorer (kv_tokenize.py's request too): None if it is
    not a JSON object."""
    try:
        request: Any = json.loads(body)
    except ValueError:
        return None
    return request if isinstance(request, dict) else None


def prompt_ids(path: str, request: dict[str, Any], tokenizer: str) -> list[int] | None:
    """The prompt's token ids, or None when the door cannot know them here."""
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return prompt if tokenizer else None
    if tokenizer != SIM:
        return None
    if path.endswith("/chat/completions"):
        messages = request.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        return tokenize(render_chat(messages))
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        prompt = "\n".join(prompt)
    return tokenize(prompt) if isinstance(prompt, str) else None
