"""A real engine's prompt as token ids, asked of the engine itself: vLLM's `POST /tokenize`.

The door keys a prompt's blocks by their token ids, and vLLM's KV events carry the ids of the
blocks it cached: the two meet only if the door's ids are exactly the engine's. Rather than
load each model's tokenizer and chat template into the door (its files are on the engine's host,
and every template option would have to be read the same way), the door asks an engine of the
model: the API server tokenizes with what it serves, chat template included, in a millisecond or
two, on its own event loop (a hung engine core does not stop it). Whatever goes wrong (no
answer within TOKENIZE_TIMEOUT_S, an error, a body it cannot take) leaves the request to the
router, as a prompt the door cannot read always was.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

from motor.engine_key import authorization, engine_key

logger = logging.getLogger(__name__)

TOKENIZE_TIMEOUT_S = 1.0
# A chat request's fields that change what its template renders (vLLM's /tokenize takes them).
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "tools", "chat_template", "chat_template_kwargs",
               "add_special_tokens", "documents", "mm_processor_kwargs")  # fmt: skip


def tokenize_request(path: str, request: dict[str, Any], model: str) -> dict[str, Any] | None:
    """vLLM's /tokenize body for this completion's prompt (`request`, its body read:
    kv_prompt.json_object), or None (no one prompt to tokenize)."""
    if path.endswith("/chat/completions"):
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        asked = {"model": model, "messages": messages}
        asked.update((name, request[name]) for name in CHAT_FIELDS if name in request)
        return asked
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # (several prompts are several answers: no one engine to choose)
    if not isinstance(prompt, str):
        return None
    asked = {"model": model, "prompt": prompt}
    if "add_special_tokens" in request:
        asked["add_special_tokens"] = request["add_special_tokens"]
    return asked


class EngineTokenizer:
    """Asks engines for token ids, on one session of kept-alive connections, with the engine key."""

    def __init__(self, timeout: float = TOKENIZE_TIMEOUT_S) -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.headers = authorization(engine_key())
        self._session: aiohttp.ClientSession | None = None

    async def ids(self, url: str, asked: dict[str, Any]) -> list[int] | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        try:
            async with self._session.post(url + "/tokenize", json=asked) as reply:
                if reply.status != 200:
                    logger.info("KV routing: %s/tokenize answered %d: to the router", url, reply.status)
                    return None
                answer = await reply.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            logger.info("KV routing: %s/tokenize failed (%s): the request goes to the router", url, type(exc).__name__)
            return None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
