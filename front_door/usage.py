"""The tokens an answer took, for a tenant's tokens per minute (front_door/admission.py).

- An answer that is not a stream (JSON, vLLM's `usage` near its end): `UsageReader` writes it on
  as the relay would, keeping only its last bytes (TAIL), and reads `usage` out of them when it
  ends: cheap (one regular expression over at most 4 KiB) and bounded, whatever the answer's size.
- A stream the door follows (front_door/continuation.py's Plan: it asks the engine for token ids):
  the prompt's ids and the ids of every token sent, continuations included.
- Any other answer (a stream the door does not follow; an answer whose `usage` it did not find):
  the prompt counted as its bytes / 4 and the request's `max_tokens` (else DEFAULT_COMPLETION),
  a ceiling: such a tenant is charged at most what it asked for.
An answer that is not a success (4xx, 5xx) takes no tokens.
"""

from __future__ import annotations

import json
import re

from front_door.messages import Request

TAIL = 4096
CHUNKED = re.compile(rb"\r\ntransfer-encoding:[ \t]*chunked[ \t]*(\r\n|$)")
FIELD = re.compile(rb'"(prompt_tokens|completion_tokens|total_tokens)"\s*:\s*(\d+)')
DEFAULT_COMPLETION = 16  # vLLM's max_tokens for a completion that names none is what is left of the context: unknown
BYTES_PER_TOKEN = 4


def usage_in(data: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens of the last `usage` object in `data`, or None."""
    at = data.rfind(b'"usage"')
    if at < 0:
        return None
    end = data.find(b"}", at)  # the object's end (or its first detail's: the three counts come first)
    fields = dict(FIELD.findall(data, at, end if end > 0 else len(data)))  # (names and digits as bytes)
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
    its last bytes; `usage` is read from them when it ends (`request.usage`)."""

    def __init__(self, transport, request: Request, chunked: bool, head: bytes = b"") -> None:
        self.transport = transport
        self.head = head  # written with the body's first bytes: one write, not two (Nagle's delay)
        self.request = request
        self.chunked = chunked
        self.read: list[bytes] = []
        self.tail = b""

    def body(self, data: bytes) -> None:
        self.read.append(data)

    def flush(self) -> None:
        if not self.read:
            return
        data = self.read[0] if len(self.read) == 1 else b"".join(self.read)
        self.read.clear()
        self.tail = (self.tail + data)[-TAIL:] if len(data) < TAIL else data[-TAIL:]
        head, self.head = self.head, b""
        self.transport.write(head + (b"%x\r\n" % len(data) + data + b"\r\n" if self.chunked else data))

    def end(self, broken: bool) -> bool:
        self.flush()
        if self.head:  # an answer without a body
            self.transport.write(self.head)
            self.head = b""
        self.request.usage = usage_in(self.tail)
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
    return estimate(request.body)


def estimate(body: bytes) -> tuple[int, int]:
    """The prompt as its bytes / 4, the completion as the request's `max_tokens` (a ceiling)."""
    prompt = len(body) // BYTES_PER_TOKEN
    completion = DEFAULT_COMPLETION
    if b"max_tokens" in body or b"max_completion_tokens" in body:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            limit = parsed.get("max_tokens", parsed.get("max_completion_tokens"))
            if isinstance(limit, int) and limit >= 0:
                completion = limit
    return prompt, completion
