"""The tokens an answer took, for a tenant's tokens per minute (front_door/admission.py).

- An answer that is not a stream (JSON): `UsageReader` writes it on as the relay would, keeping
  only the bytes from the last `"usage"` key it passed (at most WINDOW: what comes after `usage`,
  vLLM's `prompt_token_ids` or `prompt_logprobs`, may be megabytes), and reads the counts out of
  that object when the answer ends: OpenAI's names (`prompt_tokens`, `completion_tokens`,
  `total_tokens`) or those of the Responses and Anthropic APIs (`input_tokens`, `output_tokens`),
  the nested details objects stepped over. Cheap (a byte search per chunk) and bounded, whatever
  the answer's size.
- A stream the door follows (front_door/continuation.py's Plan: it asks the engine for token ids):
  the prompt's ids and the ids of every token sent, continuations included.
- Any other answer (a stream the door does not follow; an answer whose `usage` it did not find):
  the prompt counted as its bytes / 4 and the completion as the request's limit (`max_tokens`, else
  `max_completion_tokens`, else `max_output_tokens`, else DEFAULT_COMPLETION) times the choices it
  asks for (`n`, `best_of`): a ceiling, so a tenant is charged at most what it asked for, and no
  less (a `max_tokens` of null does not hide `max_completion_tokens`); a streamed completion or
  chat the door does not follow is charged at least one token an event it sent (vLLM sends one
  token an event), so one that names no limit is not charged 16 however long it runs.
An answer that is not a success (4xx, 5xx) takes no tokens.
"""

from __future__ import annotations

import json
import re

from front_door.messages import Request

USAGE = b'"usage"'
WINDOW = 2048  # bytes kept from the last `"usage"` key: the object with its details fits many times
CHUNKED = re.compile(rb"\r\ntransfer-encoding:[ \t]*chunked[ \t]*(\r\n|$)")
OBJECT = re.compile(rb'"usage"\s*:\s*\{')
FIELD = re.compile(rb'"(prompt_tokens|completion_tokens|total_tokens|input_tokens|output_tokens)"\s*:\s*(\d+)')
NAMES = {b"input_tokens": b"prompt_tokens", b"output_tokens": b"completion_tokens"}
DEFAULT_COMPLETION = 16  # vLLM's max_tokens for a completion that names none is what is left of the context: unknown
BYTES_PER_TOKEN = 4
LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def object_end(data: bytes, start: int) -> int:
    """Where the JSON object opening at `start` ends (its nested objects stepped over; counts hold
    no braces in strings), or len(data) when it is cut."""
    depth, at = 0, start
    while True:
        opens, closes = data.find(b"{", at), data.find(b"}", at)
        if closes < 0:
            return len(data)
        if 0 <= opens < closes:
            depth, at = depth + 1, opens + 1
            continue
        depth, at = depth - 1, closes + 1
        if depth == 0:
            return at


def usage_in(data: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens of the last `usage` object in `data`, or None."""
    at = data.rfind(USAGE)
    key = OBJECT.match(data, at) if at >= 0 else None
    if key is None:
        return None
    start = key.end() - 1
    found = FIELD.findall(data, start, object_end(data, start))  # (names and digits as bytes)
    fields: dict[bytes, bytes] = {}
    for name, value in found:
        fields.setdefault(NAMES.get(name, name), value)  # the object's own, before a detail's
    total = fields.get(b"total_tokens")
    prompt = fields.get(b"prompt_tokens", total)
    if prompt is None:
        return None
    prompt = int(prompt)
    completion = fields.get(b"completion_tokens")
    if completion is None:
        return prompt, max(0, int(total) - prompt) if total is not None else 0
    return prompt, int(completion)


class UsageReader:
    """Writes a JSON answer on (as it came: its length, or its chunks re-chunked as read), keeping
    the bytes from the last `"usage"` key it passed; the counts are read from them when it ends
    (`request.usage`)."""

    def __init__(self, transport, request: Request, chunked: bool, head: bytes = b"") -> None:
        self.transport = transport
        self.head = head  # written with the body's first bytes: one write, not two (Nagle's delay)
        self.request = request
        self.chunked = chunked
        self.read: list[bytes] = []
        self.usage = b""  # from the last `"usage"` key passed, WINDOW bytes at most
        self.edge = b""  # the last bytes written: a key cut between two reads is found whole

    def body(self, data: bytes) -> None:
        self.read.append(data)

    def flush(self) -> None:
        if not self.read:
            return
        data = self.read[0] if len(self.read) == 1 else b"".join(self.read)
        self.read.clear()
        if 0 < len(self.usage) < WINDOW:  # the object goes on in this read
            self.usage += data[: WINDOW - len(self.usage)]
        seen = self.edge + data
        at = seen.rfind(USAGE)
        if at >= 0:
            self.usage = seen[at : at + WINDOW]
        self.edge = data[-len(USAGE) + 1 :]
        head, self.head = self.head, b""
        self.transport.write(head + (b"%x\r\n" % len(data) + data + b"\r\n" if self.chunked else data))

    def end(self, broken: bool) -> bool:
        self.flush()
        if self.head:  # an answer without a body
            self.transport.write(self.head)
            self.head = b""
        self.request.usage = usage_in(self.usage) if self.usage else None
        if broken:
            return False
        if self.chunked:
            self.transport.write(b"0\r\n\r\n")
        return True


def read_usage(request: Request, status: int, head: bytes, transport) -> UsageReader | None:
    """A reader for a JSON answer's usage, which writes it on to `transport` (its head with its
    body's first bytes); None to pass it as it came (not JSON, or framed otherwise)."""
    if status != 200:
        return None
    end = head.find(b"\r\n\r\n")
    if end < 0:
        return None
    lower = head[:end].lower()
    if b"application/json" not in lower:
        return None
    chunked = b"transfer-encoding" in lower
    if chunked and not CHUNKED.search(lower):
        return None
    return UsageReader(transport, request, chunked, head[: end + 4])


def tokens_taken(request: Request, status: int) -> tuple[int, int]:
    """(prompt, completion) tokens the answer to `request` took, as well as the door knows."""
    if not 200 <= status < 300:
        return 0, 0
    if request.usage is not None:
        return request.usage
    follow = request.follow
    if follow is not None and follow.prompt_ids is not None:
        return len(follow.prompt_ids), len(follow.sent_ids)
    prompt, completion = estimate(request.body)
    return prompt, max(completion, request.events)  # a stream that outran the ceiling: what it sent


def estimate(body: bytes) -> tuple[int, int]:
    """The prompt as its bytes / 4, the completion as the request's limit times its choices (a ceiling)."""
    prompt = len(body) // BYTES_PER_TOKEN
    if b'"max_' not in body and b'"n"' not in body and b'"best_of"' not in body:
        return prompt, DEFAULT_COMPLETION
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        return prompt, DEFAULT_COMPLETION
    limits = [parsed.get(name) for name in LIMITS]
    limit = next((value for value in limits if counted(value)), DEFAULT_COMPLETION)
    choices = max([1] + [value for value in (parsed.get("n"), parsed.get("best_of")) if counted(value)])
    return prompt, limit * choices


def counted(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
