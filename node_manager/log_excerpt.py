"""The part of an engine's log that may explain its failure: the lines since its last launch, less
the records of other clients' malformed requests.

An engine's log holds every start of it (a node manager appends a launch line before each), and
its HTTP server logs a request it cannot parse with a traceback (`Error handling request`, then
`BadHttpMessage ... Pause on PRI/Upgrade: b'\\x00\\x00...'` for an HTTP/2 preface from a port
scan). Neither is why the engine failed: shown as its log excerpt, they read as the cause.
"""

from __future__ import annotations

import re

# The head line of a log record: `<time> LEVEL logger: message` (text) or a JSON object.
_RECORD_START = re.compile(r"^(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d\S* [A-Z]+ \S+: |\{)")
_LAUNCH = ("--- ", '"message": "--- launching')
# Records about one client's request the server could not read (aiohttp; uvicorn under vLLM).
_OTHER_CLIENTS = ("Error handling request", "Invalid HTTP request received")


def since_last_launch(lines: list[str]) -> list[str]:
    last = max((i for i, line in enumerate(lines) if _is_launch(line)), default=-1)
    return lines[last + 1 :]


def _is_launch(line: str) -> bool:
    return line.startswith(_LAUNCH[0]) or _LAUNCH[1] in line


def records(lines: list[str]) -> list[list[str]]:
    """Lines grouped by log record: a traceback's lines belong to the record above them."""
    grouped: list[list[str]] = []
    for line in lines:
        if _RECORD_START.match(line) or not grouped:
            grouped.append([line])
        else:
            grouped[-1].append(line)
    return grouped


def failure_excerpt(text: str, count: int, limit: int = 600) -> str:
    """The last `count` non-empty lines that may explain a failure, joined by ' | ', at most
    `limit` characters (the end kept)."""
    kept = [
        line.strip()
        for record in records(since_last_launch(text.splitlines()))
        if not any(marker in record[0] for marker in _OTHER_CLIENTS)
        for line in record
        if line.strip()
    ]
    tail = " | ".join(kept[-count:])
    return tail if len(tail) <= limit else "..." + tail[-limit:]
