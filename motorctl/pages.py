"""Reads every page of a paged List RPC (AIP-158) and returns one response holding them all,
so motorctl's tables and JSON look the same at 10 nodes as at 10,000."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PAGE_SIZE = 500


def all_pages(call: Callable[..., Any], request: Any, field: str, timeout: float) -> Any:
    """`call(request)` page after page; the first response, with `field` extended by the others."""
    request.page_size = PAGE_SIZE
    first = reply = call(request, timeout=timeout)
    while reply.next_page_token:
        request.page_token = reply.next_page_token
        reply = call(request, timeout=timeout)
        getattr(first, field).extend(getattr(reply, field))
    first.next_page_token = ""
    return first
