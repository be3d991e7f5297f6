"""The `model` a JSON request body names, read without building the body.

`json.loads` of a body to read one field builds every value in it: ten million empty lists (30 MB
of JSON, 30 kB of gzip) take about 700 MB and seconds of CPU. This reads only the object's top-level
keys: strings are skipped at C speed (`bytes.find` of their quotes), brackets between them counted with
`bytes.count`, so the work grows with the number of strings (and escaped quotes) in the body, not with its nesting or
its size, and nothing is built but the `model` value itself. What it reads of a valid JSON body is
what `json.loads` would read (the last `model` key wins, as in Python's and pydantic's parsers); a
body that is not valid JSON is passed on for the engine to answer, as before.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WHITESPACE = re.compile(rb"[ \t\r\n]*")
_SCALAR = re.compile(rb"-?[0-9][0-9eE.+-]*|true|false|null")
WINDOW = 256 * 1024  # bytes searched or counted per call: each holds Python's lock, the door's loop waits
MAX_STEPS = 200_000  # strings and escaped quotes read at most (well under a second); more is refused


class TooComplex(Exception):
    """A body with more strings than the door reads (no real request has millions)."""


NOT_NAMED = object()  # the body is an object without a top-level `model`
NOT_A_STRING = object()  # `model` is an object or a list


@dataclass
class ModelField:
    is_object: bool  # the body is a JSON object (else the door's rules leave it alone)
    value: object = NOT_NAMED  # the `model` value: a str, None, a number, NOT_A_STRING or NOT_NAMED


def _skip_whitespace(body: bytes, at: int) -> int:
    return _WHITESPACE.match(body, at).end()


class _Steps:
    """The work a body costs, counted: past `limit` it is refused (TooComplex)."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def take(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise TooComplex


def _find_quote(body: bytes, at: int) -> int:
    while at < len(body):
        found = body.find(b'"', at, at + WINDOW)
        if found >= 0:
            return found
        at += WINDOW
    return -1


def _depth_change(body: bytes, start: int, end: int) -> int:
    change = 0
    for at in range(start, end, WINDOW):
        stop = min(end, at + WINDOW)
        change += body.count(b"{", at, stop) + body.count(b"[", at, stop)
        change -= body.count(b"}", at, stop) + body.count(b"]", at, stop)
    return change


def _string_end(body: bytes, quote: int, steps: _Steps) -> int:
    """Where the string opened at `quote` ends (after its closing quote), or -1 if it does not."""
    at = quote + 1
    while True:
        steps.take()
        end = _find_quote(body, at)
        if end < 0:
            return -1
        # Escaped if an odd run of backslashes precedes it (read back in blocks: a run may be long).
        run, back = 0, end
        while back > at:
            block = body[max(at, back - 4096) : back]
            kept = len(block.rstrip(b"\\"))
            run += len(block) - kept
            if kept:
                break
            back -= len(block)
        if run % 2 == 0:
            return end + 1
        at = end + 1


def model_field(body: bytes, max_steps: int = MAX_STEPS) -> ModelField:
    start = _skip_whitespace(body, 0)
    if body[start : start + 1] != b"{":
        return ModelField(False)
    field, depth, at, steps = ModelField(True), 1, start + 1, _Steps(max_steps)
    while True:
        quote = _find_quote(body, at)
        if quote < 0:
            return field
        depth += _depth_change(body, at, quote)  # no string between: its brackets are structure
        at = _string_end(body, quote, steps)
        if at < 0:
            return field  # an unterminated string: not JSON, the engine says so
        if depth != 1 or at - quote > 64:  # "model" spelled with escapes is under 64 bytes
            continue
        colon = _skip_whitespace(body, at)
        if body[colon : colon + 1] != b":":
            continue  # a value, not a key
        if json.loads(body[quote:at]) != "model":
            continue
        value_at = _skip_whitespace(body, colon + 1)
        first = body[value_at : value_at + 1]
        if first == b'"':
            at = _string_end(body, value_at, steps)
            if at < 0:
                return field
            field.value = json.loads(body[value_at:at])
        elif first in (b"{", b"["):
            field.value, at = NOT_A_STRING, value_at  # counted as structure from here
        else:
            scalar = _SCALAR.match(body, value_at)
            if scalar is None:
                return field
            try:
                field.value = json.loads(scalar.group())
            except ValueError:
                return field
            at = scalar.end()


def with_model(body: bytes, model: str) -> bytes:
    """The object `body` with `model` set: added as its last key, which wins over any before."""
    end = body.rstrip().rstrip(b"}")
    empty = end.rstrip().endswith(b"{")
    return end + (b"" if empty else b", ") + b'"model": ' + json.dumps(model).encode() + b"}"
