"""A request's prompt as token ids, as the engine will tokenize it, for the door's KV-cache scorer.

Only engines whose tokenizer the door has: the simulated engine's (motor/contract/sim_tokenizer.py).
A real model's prompt would need its own tokenizer and chat template in the door; until then its
requests are left to the router (None)."""

from __future__ import annotations

import json
from typing import Any

from motor.contract.sim_tokenizer import render_chat, tokenize

SIM = "sim"
TOKENIZERS = frozenset({SIM})


def prompt_ids(path: str, body: bytes, tokenizer: str) -> list[int] | None:
    """The prompt's token ids, or None when the door cannot know them."""
    if tokenizer != SIM:
        return None
    try:
        request: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    if path.endswith("/chat/completions"):
        messages = request.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        return tokenize(render_chat(messages))
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        prompt = "\n".join(prompt)
    return tokenize(prompt) if isinstance(prompt, str) else None
