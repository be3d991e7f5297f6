"""A stand-in for the router's admin API as RouterSync uses it (router_sync/admin.py), in memory:
what it holds, each call, and a restart or an outage on demand."""

from __future__ import annotations

from router_sync.admin import RouterDown


class FakeRouterAdmin:
    base_url = "http://router"

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.calls: list[tuple[str, str]] = []  # (add|remove|list, url or "")
        self.down = False  # every call fails as a router that does not answer

    def restart(self) -> None:
        """A router started again: empty."""
        self.held = set()

    def _answer(self) -> None:
        if self.down:
            raise RouterDown(f"{self.base_url}: ConnectError: refused")

    async def workers(self) -> set[str]:
        self._answer()
        self.calls.append(("list", ""))
        return set(self.held)

    async def add(self, url, worker_type=None, model=None) -> None:
        self._answer()
        self.held.add(url)
        self.calls.append(("add", url))

    async def remove(self, url) -> None:
        self._answer()
        self.held.discard(url)
        self.calls.append(("remove", url))
