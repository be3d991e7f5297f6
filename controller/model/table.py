"""A table read like a dict, changed only through its owner's methods (node and slot tables)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

V = TypeVar("V")


class Table(Mapping[str, V], Generic[V]):
    def __init__(self) -> None:
        self._rows: dict[str, V] = {}

    def __getitem__(self, key: str) -> V:
        return self._rows[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def values(self):  # the dict's own view: Mapping's would look every key up again
        return self._rows.values()
