"""A stream continued on another engine, token for token (docs/failure-handling.md, "A stream whose
engine dies"; front_door/streams.py writes it).

The door asks the engine for token ids (vLLM's `return_token_ids`) on every streamed completion and
chat completion it can continue, and keeps them: the prompt's ids and those of every token sent to
the client. When the answer is cut (its engine died, or sent an error event of its own), the rest is
asked of another engine as a completion whose prompt is the prompt's ids followed by the ids sent,
with `max_tokens` lowered and the same sampling parameters. Greedy decoding on a deterministic engine
then gives exactly the tokens the first engine would have: the client reads one stream, its id,
`created`, `object` and `usage` those of one answer. The ids are shown to a client only if it asked.

What is not continued, and why (such a stream, cut, ends with an OpenAI error event instead):
- `n` or `best_of` over 1, or several prompts: the door keeps one answer's tokens;
- guided decoding (`guided_*`, `structured_outputs`, a `response_format` other than text) and
  `tools`: their state lives in the engine, which a prompt of ids does not restore;
- `stop` strings: the engine holds back text that may begin one, and its tokens' ids are sent before
  their text; the door cannot tell which text of the ids it holds the client has not seen;
- `echo`, and a body larger than the door reads whole (MAX_PARSED) or with too many JSON values.
What changes in a continued answer: a `seed` seeds the continuation's sampling afresh (with a
temperature above 0 the rest is another valid sample, not the one the first engine would have drawn);
presence and frequency penalties count the continuation's own tokens only (vLLM counts output
tokens, and the earlier ones are now prompt); a reasoning or tool parser of the server does not see
the continued text (it comes as plain `content`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
COMPLETION_DEFAULT = 16  # a completion's max_tokens when it gives none (vLLM's, and the simulated engine's)
MAX_PARSED = 8 * 1024 * 1024  # a streamed request's body is read whole up to this (a 2M-token prompt)
MAX_VALUES = 20_000  # objects and lists in it at most: each costs memory to build (front_door/model_field.py)
GUIDED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# What a completion's sampling takes from the request it continues (the rest is chat's own or the door's).
SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
    "ignore_eos",
    "stop_token_ids",
    "bad_words",
    "logit_bias",
    "allowed_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "return_tokens_as_token_ids",
    "priority",
    "user",
    "stream_options",
    "vllm_xargs",
)
EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
# A token's event read without building it: its ids (a key after a comma: never inside a string,
# where a quote is escaped), the fields a client that did not ask is not shown, the answer not done.
TOKEN_IDS = re.compile(rb',\s*"token_ids":\s*\[([0-9,\s]*)\]')
PROMPT_IDS_NULL = re.compile(rb',\s*"prompt_token_ids":\s*null')
NOT_FINISHED = re.compile(rb'"finish_reason":\s*null')
SOME_TEXT = re.compile(rb'"(?:text|content|reasoning_content|reasoning)":\s*"[^"]')  # a token's text not held back ("")
# An engine's own error event mid-stream that another engine may not repeat (vLLM: EngineDeadError
# and its kin are 500s; the stall watchdog and a draining server answer 503).
ENGINE_FAILURES = frozenset({"InternalServerError", "ServiceUnavailableError", "EngineDeadError"})


def engine_failure(error: dict[str, Any]) -> bool:
    code = error.get("code")
    return error.get("type") in ENGINE_FAILURES or (isinstance(code, int) and code >= 500)


def token_limit(body: dict[str, Any]) -> int | None:
    """The request's `max_tokens` (`max_completion_tokens` where that is null or absent)."""
    limit = body.get("max_tokens")
    limit = body.get("max_completion_tokens") if limit is None else limit
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def why_not(path: str, body: dict[str, Any]) -> str | None:
    """Why a streamed request `body` to `path` cannot be continued, or None if it can."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "n > 1"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt) and len(prompt) > 1:
        return "several prompts"
    if body.get("echo"):
        return "echo"
    if path == CHAT and token_limit(body) is None:
        # vLLM's chat answers to the end of the context; a completion's default is 16 tokens, and
        # the door does not know the context's length to ask for the rest of it
        return "a chat completion without max_tokens"
    if body.get("stop"):
        return "stop strings"
    if any(body.get(name) for name in GUIDED):
        return "guided decoding"
    if body.get("tools") and body.get("tool_choice") != "none":
        return "tools"
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "guided decoding"
    return None


def plan(path: str, body: bytes, limit: int) -> Plan | None:
    """The plan to continue a streamed request (None: not continued), with the body to send in its
    place, which asks the engine for token ids. (Read where the body is: off the loop if large.)"""
    if limit <= 0 or path not in (COMPLETIONS, CHAT) or b'"stream"' not in body or len(body) > MAX_PARSED:
        return None
    if body.count(b"{") + body.count(b"[") > MAX_VALUES:
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None  # the engine says what is wrong with it
    if not isinstance(request, dict) or request.get("stream") is not True or why_not(path, request):
        return None
    asked = request.get("return_token_ids") is True
    if asked:
        sent = body
    elif "return_token_ids" in request:
        sent = json.dumps({**request, "return_token_ids": True}).encode()
    else:  # (inserted, not rebuilt: a long prompt is not written again)
        at = body.index(b"{") + 1
        sent = body[:at] + b'"return_token_ids": true, ' + body[at:]
    return Plan(path, request, sent, limit, asked)


@dataclass
class Plan:
    """One streamed answer's tokens, what its client was shown, and how to ask for the rest."""

    path: str
    request: dict[str, Any]
    body: bytes  # the request as sent, asking for token ids
    limit: int  # continuations at most
    asked: bool  # the client asked for token ids itself
    continuations: int = 0
    prompt_ids: list[int] | None = None
    sent_ids: list[int] = field(default_factory=list)
    text_sent: int = 0  # characters of text the client was sent (a continuation's logprobs' offsets)
    whole_upto: int = 0  # of sent_ids, those up to the last token whose text came (not held back)
    repeated: int = 0  # tokens the continuation makes again whose ids (and logprobs) the client has
    text_at_cut: int = 0  # text_sent when the continuation was asked for (its offsets start there)
    errored: bool = False  # an error event of the engine's own passed to the client (not gone on with)
    answer: dict[str, Any] = field(default_factory=dict)  # id, object, created, model of the first event
    finished: bool = False  # its finish_reason came
    usage_sent: bool = False
    done: bool = False  # `data: [DONE]` came after a whole answer
    failed: str = ""  # an engine's error event came (the reason it is continued)
    continuing: bool = False  # the events now are a continuation's (a completion's, translated)
    seen: bool = False  # an event of the answer came (and was written on)
    sent_at_cut: int = 0  # tokens sent when it was last cut

    @property
    def chat(self) -> bool:
        return self.path == CHAT

    def events(self, data: bytes) -> bytes:
        """Whole SSE events read from the engine, as the client is to be sent them."""
        out = []
        start = 0
        for match in EVENT_END.finditer(data):
            out.append(self._event(data[start : match.start()]))
            start = match.end()
        if start < len(data):  # whitespace after the last event (an unended event is held by Stream)
            out.append(data[start:])
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        payload = event[5:].strip() if event.startswith(b"data:") and b"\n" not in event else None
        if payload == b"[DONE]":
            if self.failed:
                return b""  # ends an answer the door goes on with
            self.done = True
            return b"data: [DONE]\n\n"
        if payload is not None and (fast := self._token(payload)) is not None:
            return fast
        try:
            chunk = json.loads(payload) if payload is not None else None
        except ValueError:
            chunk = None
        error = chunk.get("error") if isinstance(chunk, dict) else None
        if isinstance(error, dict) and engine_failure(error) and not self.finished:
            self.failed = "engine_error"
            return b""
        self.seen = True
        if not isinstance(chunk, dict):
            return event + b"\n\n"  # not one the door reads: passed on as it came
        if error is not None:
            self.errored = True  # the engine refused the request itself: another would too
        shown = self._translated(chunk) if self.continuing else self._kept(chunk)
        if shown is None:
            return b""
        return b"data: " + json.dumps(shown, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    def _token(self, payload: bytes) -> bytes | None:
        """A token's event of the first answer (most events), its ids kept and hidden as `_kept`
        does, without building it (a fifth of the cost); None if it is another event."""
        if self.continuing or not self.answer or self.counts_text or b'"error"' in payload or b'"usage"' in payload:
            return None
        if b'"prompt_token_ids"' in payload and not PROMPT_IDS_NULL.search(payload):
            return None
        found = TOKEN_IDS.findall(payload)
        if len(found) != 1 or not NOT_FINISHED.search(payload):
            return None
        self.seen = True
        self.sent_ids.extend(int(i) for i in found[0].split(b",") if i.strip())
        if SOME_TEXT.search(payload):
            self.whole_upto = len(self.sent_ids)
        if not self.asked:
            payload = PROMPT_IDS_NULL.sub(b"", TOKEN_IDS.sub(b"", payload))
        return b"data: " + payload + b"\n\n"

    @property
    def counts_text(self) -> bool:
        """Whether the text sent is counted: a continuation's logprobs' offsets follow it."""
        return not self.chat and self.request.get("logprobs") is not None

    def _kept(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """An event of the first answer: its ids kept, hidden from a client that did not ask."""
        if not self.answer and "id" in chunk:
            self.answer = {key: chunk[key] for key in ("id", "object", "created", "model") if key in chunk}
        ids = chunk.pop("prompt_token_ids", None) if not self.asked else chunk.get("prompt_token_ids")
        if ids is not None:
            self.prompt_ids = list(ids)
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            ids = choice.get("prompt_token_ids") if self.asked else choice.pop("prompt_token_ids", None)
            if ids is not None:
                self.prompt_ids = list(ids)
            self._took(choice, choice.get("text") if not self.chat else delta_text(choice.get("delta")))
            if not self.asked:
                choice.pop("token_ids", None)
        if "usage" in chunk and not chunk.get("choices"):
            self.usage_sent = True
        return chunk

    def _took(self, choice: dict[str, Any], text: object) -> None:
        self.sent_ids.extend(choice.get("token_ids") or ())
        if isinstance(text, str) and text:
            self.text_sent += len(text)
            self.whole_upto = len(self.sent_ids)
        if choice.get("finish_reason") is not None:
            self.finished = True

    def _translated(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """An event of a continuation (a completion's) as one of the answer the client reads."""
        shown: dict[str, Any] = {**self.answer}
        choices = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            text = choice.get("text") or ""
            logprobs = choice.get("logprobs")
            if self.repeated:  # made again: shown already, but for their text (held back then)
                self._drop_repeated(choice, logprobs)
            if isinstance(logprobs, dict) and logprobs.get("text_offset"):
                logprobs["text_offset"] = [offset + self.text_at_cut for offset in logprobs["text_offset"]]
            self._took(choice, text)
            if self.chat:
                out: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {}}
                top = self.request.get("top_logprobs")
                out["logprobs"] = chat_logprobs(logprobs, top if isinstance(top, int) else 0) if logprobs else None
            else:
                out = {"index": 0, "text": text, "logprobs": logprobs}
            out["finish_reason"] = choice.get("finish_reason")
            if "stop_reason" in choice:
                out["stop_reason"] = choice["stop_reason"]
            if self.asked:
                out["token_ids"] = choice.get("token_ids")
            elif self.chat and not text and not logprobs and out["finish_reason"] is None:
                continue  # a token whose text is held back: chat sends no chunk for it
            choices.append(out)
        if not choices and "usage" not in chunk:
            return None
        shown["choices"] = choices
        if chunk.get("usage") is not None:
            shown["usage"] = self.usage()
            self.usage_sent = self.usage_sent or not choices
        return shown

    def _drop_repeated(self, choice: dict[str, Any], logprobs: object) -> None:
        ids = choice.get("token_ids") or []
        count = min(self.repeated, len(ids))
        self.repeated -= count
        self.sent_ids.extend(ids[:count])  # counted once, as they were
        choice["token_ids"] = ids[count:]
        if isinstance(logprobs, dict):
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                if isinstance(logprobs.get(key), list):
                    logprobs[key] = logprobs[key][count:]

    def usage(self) -> dict[str, int]:
        """The whole answer's: the prompt's tokens, and every token sent of it."""
        prompt = len(self.prompt_ids or ())
        sent = len(self.sent_ids)
        return {"prompt_tokens": prompt, "completion_tokens": sent, "total_tokens": prompt + sent}

    def can_continue(self) -> bool:
        """Under its limit, with the ids to go on from (an engine that sends none, as SGLang: not),
        or with nothing sent yet (the request is sent again as it was)."""
        if self.errored:
            return False
        return self.continuations < self.limit and (self.prompt_ids is not None or not self.seen)

    def next_request(self) -> tuple[str, bytes]:
        """The path and body that ask another engine for the rest of the answer."""
        self.continuations += 1
        self.failed = ""
        self.sent_at_cut = len(self.sent_ids)
        self.text_at_cut = self.text_sent
        if self.prompt_ids is None:  # nothing came but the head: the request once more, as it was
            return self.path, self.body
        self.continuing = True
        # From the last token whose text came: vLLM's detokenizer, primed with a prompt that ends
        # inside a character, writes the whole prompt's text first (vLLM 0.32, tokenizers 0.23's
        # DecodeStream); tokens whose text was held back are made again (the same, greedy), their
        # text with them, their ids and logprobs not shown twice.
        held = self.sent_ids[self.whole_upto :]
        del self.sent_ids[self.whole_upto :]
        self.repeated += len(held)
        request = self.request
        body: dict[str, Any] = {name: request[name] for name in SAMPLING if name in request}
        body.update(model=request.get("model"), prompt=self.prompt_ids + self.sent_ids, stream=True)
        body["return_token_ids"] = True
        limit = token_limit(request)
        limit = COMPLETION_DEFAULT if limit is None else limit  # (a chat without one is not gone on with)
        body["max_tokens"] = max(1, limit - len(self.sent_ids))
        if isinstance(request.get("min_tokens"), int):
            body["min_tokens"] = max(0, request["min_tokens"] - len(self.sent_ids))
        if self.chat and request.get("logprobs") is True:
            body["logprobs"] = request.get("top_logprobs") or 0
        elif not self.chat and isinstance(request.get("logprobs"), int):
            body["logprobs"] = request["logprobs"]
        return COMPLETIONS, json.dumps(body).encode()

    def tail(self) -> bytes:
        """The end of an answer cut after its finish_reason: its usage (where asked) and `[DONE]`."""
        options = self.request.get("stream_options")
        data = b""
        if isinstance(options, dict) and options.get("include_usage") and not self.usage_sent:
            usage = {**self.answer, "choices": [], "usage": self.usage()}
            data = b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n"
        return data + b"data: [DONE]\n\n"


def delta_text(delta: object) -> str:
    """A chat chunk's text: its content, or its reasoning (a reasoning parser's, vLLM's two names)."""
    if not isinstance(delta, dict):
        return ""
    pieces = (delta.get(key) for key in ("reasoning_content", "reasoning", "content"))
    return "".join(piece for piece in pieces if isinstance(piece, str))


def chat_logprobs(logprobs: dict[str, Any], top: int) -> dict[str, Any]:
    """A completion's logprobs (tokens, token_logprobs, top_logprobs) in chat's shape (content)."""

    def entry(token: str, logprob: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = []
    tops = logprobs.get("top_logprobs") or []
    for index, (token, logprob) in enumerate(zip(logprobs.get("tokens") or (), logprobs.get("token_logprobs") or ())):
        best = tops[index] if index < len(tops) and isinstance(tops[index], dict) else {}
        alternatives = [entry(t, lp) for t, lp in best.items()][:top]
        content.append({**entry(token, logprob), "top_logprobs": alternatives})
    return {"content": content}
