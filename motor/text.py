"""Text of a caller's quoted back in a message: cut to a length a person reads (a 1 MB id is not
echoed back whole). Below every room of motor/: its config reader, the contract's checks and the
services' errors all quote what they refuse."""

from __future__ import annotations

# Longest part of a rejected value quoted back in an error message.
EXCERPT_CHARS = 64


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """repr() of `value`, cut to `limit` characters of it: a 1 MB id is not echoed back whole."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    return repr(value)
