"""Paging and filtering of ListNodes, ListInstances and ListEndpoints (AIP-158).

A page holds at most `page_size` items in id order (0: every item, as before paging existed;
more than MAX_PAGE_SIZE: MAX_PAGE_SIZE). `next_page_token` names the last id returned, so items
added or removed between two pages neither repeat nor shift the next page. A token is valid
only with the filter it was issued for.

The filter is a list of space-separated `field=value` terms that must all hold; a value ending
in '*' matches a prefix. Enum fields (state, role) take the short name (READY), any case.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from motor.errors import InvalidArgument

MAX_PAGE_SIZE = 1000

V = TypeVar("V")


class PagedRequest(Protocol):
    page_size: int
    page_token: str
    filter: str


@dataclass(frozen=True)
class Field(Generic[V]):
    read: Callable[[V], str]
    enum: bool = False  # compared in upper case


class Filter(Generic[V]):
    def __init__(self, text: str, fields: Mapping[str, Field[V]]):
        self.terms: list[tuple[Field[V], str]] = []
        for term in text.split():
            name, sep, value = term.partition("=")
            if not sep or not value:
                raise InvalidArgument(f"filter: {term!r} is not a field=value term (fields: {', '.join(fields)})")
            field = fields.get(name)
            if field is None:
                raise InvalidArgument(f"filter: unknown field {name!r} (fields: {', '.join(fields)})")
            self.terms.append((field, value.upper() if field.enum else value))

    def matches(self, item: V) -> bool:
        for field, value in self.terms:
            have = field.read(item)
            if value.endswith("*"):
                if not have.startswith(value[:-1]):
                    return False
            elif have != value:
                return False
        return True


def _token(after: str, filter_text: str) -> str:
    return base64.urlsafe_b64encode(json.dumps({"after": after, "filter": filter_text}).encode()).decode()


def _after(token: str, filter_text: str) -> str:
    if not token:
        return ""
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        after, issued_for = data["after"], data["filter"]
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise InvalidArgument(
            "page_token: not a token this controller issued (pass next_page_token unchanged)"
        ) from None
    if issued_for != filter_text:
        raise InvalidArgument(
            f"page_token: issued for filter {issued_for!r}, not {filter_text!r}; keep the filter of the first page"
        )
    return after


def page(request: PagedRequest, rows: Mapping[str, V], fields: Mapping[str, Field[V]]) -> tuple[list[V], str]:
    """One page of `rows` (id -> item) for `request`: (items in id order, next page token)."""
    if request.page_size < 0:
        raise InvalidArgument(
            f"page_size: {request.page_size} is negative (0 means everything, at most {MAX_PAGE_SIZE} a page)"
        )
    matcher = Filter(request.filter, fields)
    after = _after(request.page_token, request.filter)
    size = min(request.page_size, MAX_PAGE_SIZE) or len(rows)
    keys = sorted(rows)
    out: list[V] = []
    for index in range(bisect.bisect_right(keys, after) if after else 0, len(keys)):
        item = rows[keys[index]]
        if not matcher.matches(item):
            continue
        out.append(item)
        if len(out) == size:
            more = any(matcher.matches(rows[k]) for k in keys[index + 1 :])
            return out, _token(keys[index], request.filter) if more else ""
    return out, ""
