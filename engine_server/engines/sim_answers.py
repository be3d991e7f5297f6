"""What the simulated engine answers, in the OpenAI wire format vLLM's API server speaks:
completions and chat completions, whole or as server-sent events a token each (sim_tokens.py makes
the tokens), with vLLM's `return_token_ids`, `logprobs` and `stream_options.include_usage`
fields, and vLLM's error bodies.

With `return_token_ids`: a completion's choice carries `prompt_token_ids` and `token_ids`; a chat
completion carries `prompt_token_ids` at its top and `token_ids` in its choice. Streamed, a
completion's first chunk's choice carries `prompt_token_ids` (null after), every chunk's choice
the `token_ids` of its token; a chat stream's first chunk (role "assistant", content "") carries
`prompt_token_ids` at its top, every later chunk's choice its `token_ids`."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from engine_server.engines.admission import UNAVAILABLE_HEADERS, unavailable_body
from engine_server.engines.sim_request import SimRequest
from engine_server.engines.sim_tokens import WORDS, deterministic_text, token_text

__all__ = ["WORDS", "Answer", "deterministic_text", "error", "json_body", "model_not_found", "unavailable"]


def model_not_found(model: str, served: str) -> web.Response:
    """vLLM's answer to a request for a model it does not serve (entrypoints/serve/engine/serving.py)."""
    message = f"The model `{model}` does not exist. Valid aliases: {served}."
    return web.json_response(
        {"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}}, status=404
    )


def unavailable(message: str) -> web.Response:
    return web.Response(status=503, body=unavailable_body(message), headers=UNAVAILABLE_HEADERS)


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def json_body(request: web.Request) -> tuple[dict[str, Any], web.Response | None]:
    try:
        body = await request.json()
    except ValueError:
        return {}, error(400, "the body must be a JSON object")
    if not isinstance(body, dict):
        return {}, error(400, "the body must be a JSON object")
    return body, None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Answer:
    """One answer in the making: `add` each token as the model makes it (its id, text, and its
    logprobs when asked for), then `chunk` (streamed) or `whole` (not streamed) in vLLM's shapes."""

    def __init__(self, request: SimRequest, answer_id: str, model: str):
        self.request, self.answer_id, self.model = request, answer_id, model
        self.created = int(time.time())
        self.ids: list[int] = []
        self.text: list[str] = []
        self._logprobs: list[list[tuple[int, float]]] = []
        self._text_offset = 0  # completions' logprobs: where the next token's text starts

    def add(self, token: int, piece: str, logprobs: list[tuple[int, float]] | None = None) -> None:
        self.ids.append(token)
        self.text.append(piece)
        if logprobs is not None:
            self._logprobs.append(logprobs)

    @property
    def usage(self) -> dict[str, int]:
        return _usage(len(self.request.prompt_ids), len(self.ids))

    def _envelope(self, choices: list[dict[str, Any]], streamed: bool) -> dict[str, Any]:
        chat = self.request.chat
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if chat else "text_completion"
        return {"id": self.answer_id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs_of(self, start: int) -> dict[str, Any] | None:
        """vLLM's logprobs of the tokens from `start` on (completions: parallel lists; chat: content)."""
        top = self.request.logprobs
        if top is None:
            return None
        steps = self._logprobs[start:]
        if self.request.chat:
            return {"content": [_chat_logprob(step, top) for step in steps]}
        shape: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for step in steps:
            token = token_text(step[0][0])
            shape["text_offset"].append(self._text_offset)
            shape["token_logprobs"].append(step[0][1])
            shape["tokens"].append(token)
            shape["top_logprobs"].append({token_text(t): lp for t, lp in step[: top + 1]})
            self._text_offset += len(token)
        return shape

    def first_chunk(self) -> dict[str, Any] | None:
        """A chat stream's first chunk: the role, and the prompt's ids when asked for (none for completions)."""
        if not self.request.chat:
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        chunk = self._envelope([choice], streamed=True)
        if self.request.return_token_ids:
            chunk["prompt_token_ids"] = self.request.prompt_ids
        return chunk

    def chunk(self) -> dict[str, Any]:
        """The streamed chunk of the token added last."""
        index = len(self.ids) - 1
        finish = "length" if len(self.ids) == self.request.max_tokens else None
        choice: dict[str, Any] = {"index": 0}
        if self.request.chat:
            choice["delta"] = {"content": self.text[index]}
        else:
            choice["text"] = self.text[index]
        choice["logprobs"] = self._logprobs_of(index)
        choice["finish_reason"] = finish
        if self.request.return_token_ids:
            if not self.request.chat:
                choice["prompt_token_ids"] = self.request.prompt_ids if index == 0 else None
            choice["token_ids"] = self.ids[index:]
        return self._envelope([choice], streamed=True)

    def usage_chunk(self) -> dict[str, Any]:
        """stream_options.include_usage: the last chunk before [DONE], with no choices."""
        return {**self._envelope([], streamed=True), "usage": self.usage}

    def whole(self) -> dict[str, Any]:
        """The whole (not streamed) completion or chat completion."""
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": 0}
        if self.request.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs_of(0)
        choice["finish_reason"] = "length"
        answer = self._envelope([choice], streamed=False)
        if self.request.return_token_ids:
            choice["token_ids"] = list(self.ids)
            target = answer if self.request.chat else choice
            target["prompt_token_ids"] = self.request.prompt_ids
        answer["usage"] = self.usage
        return answer


def _chat_logprob(step: list[tuple[int, float]], top: int) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}

    return {**entry(*step[0]), "top_logprobs": [entry(*alternative) for alternative in step[:top]]}


def sse(chunk: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


DONE = b"data: [DONE]\n\n"
