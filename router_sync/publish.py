"""Telling the front door's process (front_door/cli.py) what the router can route: `PUT /served`
with the sync's table, model -> parent model, the models Motor serves that no engine can
serve right now (`unavailable`: answered 503 with Retry-After, not 404), and the engines that
publish KV cache events (`engines`: each one's id, generation, URL, models, KV-events address and
tokenizer), which a door started with --kv-routing follows (front_door/kv_routing.py).

The sync pushes at the start of every pass over the router and at its end (RouterSync's
`publish` hook): a model Motor withdrew leaves the front door's table before the router loses its
last worker, and a model is served once the router has it. And every `interval` seconds however
quiet: a front door that was restarted has the table again within one interval. Pushes are one at
a time and each sends the table as it is when sent, so a late push never puts back an old table.

A front door that does not answer is said once and once when it is back; the sync goes on keeping
the router either way (each push has a short deadline).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

logger = logging.getLogger(__name__)


class TablePublisher:
    def __init__(
        self,
        url: str,
        announce: Callable[[str], None],
        interval: float = 1.0,
        timeout: float = 1.0,
        unavailable: Callable[[], list[str]] | None = None,
        engines: Callable[[], list[dict]] | None = None,
    ):
        self.url = url.rstrip("/") + "/served"
        # The models Motor serves that cannot be served now (RouterSync.unavailable), pushed with
        # the table: the door answers them 503 with Retry-After, not 404.
        self.unavailable = unavailable
        self.engines = engines  # RouterSync.kv_engines: what the door's KV routing learns engines from
        self.announce, self.interval = announce, interval
        self.client = httpx.AsyncClient(timeout=timeout)
        self._lock = asyncio.Lock()
        self._failing: str | None = None
        self._last: dict | None = None  # the body the front door last took

    async def push(self, current: Callable[[], dict[str, str | None] | None], again: bool = False) -> None:
        """Push the table `current()` gives when its turn comes (None: not known yet, nothing
        pushed); one equal to the last pushed only when `again` (the periodic push)."""
        async with self._lock:
            served = current()
            if served is None:
                return
            body: dict = {"served": served}
            if self.unavailable is not None:
                body["unavailable"] = self.unavailable()
            if self.engines is not None:
                body["engines"] = self.engines()
            if body == self._last and not again:
                return
            try:
                reply = await self.client.put(self.url, json=body)
                reply.raise_for_status()
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
                if self._failing is None:
                    self.announce(
                        f"front door {self.url} does not take the table ({why}); the router is kept all the same, "
                        f"pushing again every {self.interval:g}s"
                    )
                self._failing, self._last = why, None
                return
            if self._failing is not None:
                self.announce(f"front door {self.url} takes the table again")
                self._failing = None
            self._last = body

    async def run(self, current: Callable[[], dict[str, str | None] | None]) -> None:
        """Until cancelled: the table again every `interval` (a restarted front door has none)."""
        while True:
            await self.push(current, again=True)
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        await self.client.aclose()
