"""Keeping a router's workers equal to the engines Motor lists (plain logic over RouterAdmin).

`RouterSync` holds what Motor wants (`wanted`: url -> (worker type, model), from WatchEndpoints) and what
it believes the router has (`believed`). Every pass removes what the router has and Motor does
not list, then adds what Motor lists and the router lacks, each group concurrently (removals
first: a worker that cannot serve leaves before anything else happens). `believed` is re-read
from the router (`GET /list_workers`) on every snapshot (a (re)connect to the controller), after
the router failed to answer, and every `relist_interval` however often the stream changes (a
router restarted between two of our calls has an empty list): so workers the router has and
Motor does not list are removed. Between passes a watch reads the router's list every
`watch_interval` (0.5 s): a router that holds none of what it held (restarted) or answers again
after failing gets a pass at once, not at the next re-list or at the end of the backoff.

A router that does not answer: one announcement, retries with a capped backoff, and one
announcement when it is back, with what the re-sync changed. A worker the router refuses: one
announcement naming it and the router's answer; it is tried again at the next re-list.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from motor.contract.router_workers import adapter_worker_url
from motor.service.retry import RepeatedFailure
from motor.v1 import controller_pb2, types_pb2
from router_sync.admin import Refused, RouterAdmin, RouterDown

logger = logging.getLogger(__name__)

# The router's worker type of each Motor role in a P/D router; None: a regular worker.
PD_WORKER_TYPES = {types_pb2.ROLE_PREFILL: "prefill", types_pb2.ROLE_DECODE: "decode"}


def worker_type(role: int, pd: bool) -> str | None:
    """What the router is told an engine of `role` is. A regular router takes every role as a
    regular worker (an engine of a P/D pair also serves whole requests alone)."""
    return PD_WORKER_TYPES.get(role) if pd else None


def router_workers_of(endpoint: controller_pb2.Endpoint) -> list[tuple[str, str | None, str | None]]:
    """(router worker URL, model, parent model) of each name the engine serves: its deployment's
    model at its own URL, then one worker per loaded adapter (parent: that model)."""
    if not endpoint.models:
        return [(endpoint.url, None, None)]
    base, *adapters = endpoint.models
    return [(endpoint.url, base, None)] + [(adapter_worker_url(endpoint.url, a), a, base) for a in adapters]


def kv_source(endpoint: controller_pb2.Endpoint) -> dict:
    """An engine as the door's KV routing takes it (front_door/kv_routing.py, parse_engines)."""
    return {
        "engine_id": endpoint.engine_id,
        "generation": endpoint.generation,
        "url": endpoint.url,
        "models": list(endpoint.models),
        "kv_events": endpoint.kv_events,
        "tokenizer": endpoint.tokenizer,
    }


class RouterSync:
    def __init__(
        self,
        admin: RouterAdmin,
        announce: Callable[[str], None],
        pd: bool = False,
        by_model: bool = False,
        relist_interval: float = 5.0,
        backoff_base: float = 0.2,
        backoff_cap: float = 5.0,
        watch_interval: float = 0.5,
    ):
        self.admin, self.announce, self.pd, self.by_model = admin, announce, pd, by_model
        self.relist_interval, self.watch_interval = relist_interval, watch_interval
        self.wanted: dict[str, tuple[str | None, str | None]] = {}  # worker URL -> (type, model)
        # Each engine's worker URLs (its own, and one per loaded adapter when filed by model).
        self.workers_of: dict[str, list[str]] = {}
        self.parents: dict[str, str] = {}  # adapter worker URL -> the model the adapter is of
        # What each URL was added as: a URL that comes back as another model or type (its port
        # given to another deployment's engine) is added again, which re-files it in the router.
        self.filed: dict[str, tuple[str | None, str | None]] = {}
        self.believed: set[str] | None = None  # None: to be re-read from the router
        self.known: set[str] = set()  # the router's list as last read and changed (kept while re-read)
        self._served: dict[str, str | None] | None = None
        # The engines that publish KV cache events, by URL: what a door's KV routing is pushed
        # (kv_engines). Not in a P/D router: a request sent straight to one engine would skip its pair.
        self.kv_sources: dict[str, dict] = {}
        # Every model name Motor serves, engine or not (WatchEndpoints' models_added/removed): one
        # with no worker in the router is `unavailable` (503 at the door, to retry; not 404).
        self.deployed: set[str] = set()
        self.refused: dict[str, str] = {}  # url -> the router's answer, until the next re-list
        self.have_snapshot = False  # before Motor's first list the router's list is left alone
        self.router_down = RepeatedFailure(backoff_base, backoff_cap)
        self.wake = asyncio.Event()
        self.answers_again = asyncio.Event()  # the watch saw a router that was down answer: retry now
        self.passing = False  # a pass is changing the router (its list is half-way meanwhile)
        self.relisted_at = time.monotonic()  # when the router's list was last read in full
        # What the router held at the end of the last pass (None: never read), and a flag set
        # whenever that or the router's health changed: what the controller is told (report.py).
        self.held: frozenset[str] | None = None
        self.router_restarts = 0  # times the router came back without what it held, or after not answering
        self.changed = asyncio.Event()
        # Tells the front door's process what is served (router_sync/publish.py), at the start of
        # each pass (a withdrawn model leaves its table before the router loses the worker) and
        # at its end (a model is served once the router has it).
        self.publish: Callable[[Callable[[], dict[str, str | None] | None]], Awaitable[None]] | None = None

    # What Motor says ------------------------------------------------------------------------

    def apply(self, message: controller_pb2.WatchEndpointsResponse) -> None:
        """One WatchEndpoints message: a snapshot replaces the wanted list (and the router's list
        is re-read); a change removes and adds."""
        if message.snapshot:
            self.wanted, self.workers_of, self.parents, self.kv_sources = {}, {}, {}, {}
            self.deployed = set()
            self.believed = None
            self.have_snapshot = True
        self.deployed.difference_update(message.models_removed)
        self.deployed.update(message.models_added)
        for gone in message.removed:
            self.kv_sources.pop(gone.url, None)
            for url in self.workers_of.pop(gone.url, [gone.url]):
                self.wanted.pop(url, None)
                self.parents.pop(url, None)
        for new in message.added:
            kind = worker_type(new.role, self.pd)
            if new.kv_events and not self.pd:
                self.kv_sources[new.url] = kv_source(new)
            workers = router_workers_of(new) if self.by_model else [(new.url, None, None)]
            self.workers_of[new.url] = [url for url, _, _ in workers]
            for url, model, parent in workers:
                self.wanted[url] = (kind, model)
                if parent:
                    self.parents[url] = parent
        self._served = None
        self.wake.set()

    def kv_engines(self) -> list[dict]:
        """The engines that publish KV cache events, as the door's KV routing takes them, by URL."""
        return [self.kv_sources[url] for url in sorted(self.kv_sources)]

    def served(self) -> dict[str, str | None]:
        """The models a request may name now: model -> the model it is an adapter of (None for a
        deployment's model). Only names with a worker the router has (added, not yet removed):
        a name is served once the router can route it, and stops being served as soon as Motor
        withdraws its last engine, before the router hears of it."""
        if self._served is None:  # computed once per change, not per request
            self._served = {
                model: self.parents.get(url)
                for url, (kind, model) in self.wanted.items()
                if model is not None and url in self.known and self.filed.get(url, (kind, model)) == (kind, model)
            }
        return self._served

    def unavailable(self) -> list[str]:
        """The models Motor serves that no worker of the router serves now (an engine stalled,
        restarting): sorted. A controller that does not say what it serves names none."""
        served = self.served()
        return sorted(name for name in self.deployed if name not in served)

    def knows_served(self) -> bool:
        """Whether served() is known: after Motor's first list and a pass over the router."""
        return self.held is not None

    # Keeping the router -----------------------------------------------------------------------

    async def run(self) -> None:
        """Passes until cancelled: at once after each change, and a full re-list every
        relist_interval (and at once when the watch finds the router restarted)."""
        watching = asyncio.create_task(self.watch(), name="router watch")
        try:
            await self._passes()
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)

    async def watch(self) -> None:
        """Every watch_interval, the router's list: a router restarted between two passes is
        empty while the front door sends it requests, so it must not wait for the re-list (nor
        for a backoff grown while it was down). One that holds none of what it held, or answers
        again after failing, gets a pass with a fresh read of its list at once."""
        while True:
            await asyncio.sleep(self.watch_interval)
            if self.passing or self.held is None:
                continue
            try:
                listed = await self.admin.workers()
            except RouterDown:
                if not self.router_down.count and self.believed is not None:
                    self.believed = None  # down between passes: the next pass says so and backs off
                    self.wake.set()
                continue
            if self.router_down.count:
                self.answers_again.set()
            elif not self.passing and self.held & self.wanted.keys() and not self.held & listed:
                self.believed = None  # restarted: the pass re-reads it, says so and refills it
                self.wake.set()

    async def _passes(self) -> None:
        while True:
            self.wake.clear()
            try:
                await self.reconcile()
            except RouterDown as exc:
                self.believed = None
                self.changed.set()
                if self.router_down.failed(exc):
                    self.announce(
                        f"router {self.admin.base_url} not answering ({exc}); retrying with backoff, "
                        f"the whole worker list is re-synced when it answers"
                        + (f" (failure {self.router_down.count})" if self.router_down.count > 1 else "")
                    )
                self.answers_again.clear()
                try:  # the backoff, cut short when the watch sees the router answer again
                    await asyncio.wait_for(self.answers_again.wait(), self.router_down.delay())
                except TimeoutError:
                    pass
                continue
            # The re-list is a period, not a quiet spell: a stream that changes more often than
            # relist_interval (a flapping engine) must not keep a restarted router's list unread.
            due = self.relisted_at + self.relist_interval - time.monotonic()
            if due > 0:
                try:
                    await asyncio.wait_for(self.wake.wait(), due)
                    continue
                except TimeoutError:
                    pass
            self.believed = None
            self.relisted_at = time.monotonic()  # due again one period on, even before Motor's first list

    async def reconcile(self) -> None:
        if not self.have_snapshot:
            return
        self.passing = True
        try:
            await self._reconcile()
        finally:
            self.passing = False

    async def _reconcile(self) -> None:
        relisted = self.believed is None
        if relisted:
            self.believed = self.known = await self.admin.workers()
            self.relisted_at = time.monotonic()
            self.refused.clear()
            held = self.held or frozenset()
            lost = sorted(held & self.wanted.keys() - self.believed)
            # A restarted router is empty: none of what it held is left (a gateway that dropped one
            # worker it could not reach is not a restart). One that was down is announced below.
            if lost and not held & self.believed and not self.router_down.count:
                self.router_restarts += 1
                self.announce(
                    f"router {self.admin.base_url} holds none of the {len(held)} worker(s) it held (restarted); "
                    f"giving it its whole list again"
                )
        believed = self.believed
        extra = sorted(believed - self.wanted.keys())
        missing = sorted(
            url
            for url, worker in self.wanted.items()
            if (url not in believed or self.filed.get(url, worker) != worker) and url not in self.refused
        )
        await self._publish()
        began = time.monotonic()
        removed = await self._each(extra, self.admin.remove, believed.discard)
        added = await self._each(missing, self._add, believed.add)
        if relisted or removed or added:
            self._served = None
        if removed or added:
            logger.info(
                "router %s: removed %s, added %s (%.0f ms)",
                self.admin.base_url,
                removed or "none",
                added or "none",
                1000 * (time.monotonic() - began),
            )
        if relisted or removed or added or self.held is None:
            self.held = frozenset(believed)
            self.changed.set()
        if self.router_down.count:
            self.router_restarts += 1
            count = self.router_down.recovered()
            self.announce(
                f"router {self.admin.base_url} answers again after {count} failed call(s); re-synced "
                f"its whole worker list: {len(believed)} worker(s), removed {removed or 'none'}, "
                f"added {added or 'none'}"
            )
        await self._publish()

    def known_served(self) -> dict[str, str | None] | None:
        """served(), or None before it is known (knows_served)."""
        return self.served() if self.knows_served() else None

    async def _publish(self) -> None:
        if self.publish is not None:
            await self.publish(self.known_served)

    async def _add(self, url: str) -> None:
        worker = self.wanted.get(url, (None, None))
        await self.admin.add(url, *worker)
        self.filed[url] = worker

    async def _each(
        self, urls: Iterable[str], call: Callable[[str], Awaitable[None]], done: Callable[[str], None]
    ) -> list[str]:
        """`call(url)` for every url at once; those that succeeded are `done` and returned. A
        refusal is announced; a router that does not answer is raised after the others ran."""
        urls = list(urls)
        results = await asyncio.gather(*(call(url) for url in urls), return_exceptions=True)
        succeeded, down = [], None
        for url, result in zip(urls, results):
            if result is None:
                done(url)
                succeeded.append(url)
            elif isinstance(result, Refused):
                self.refused[url] = result.answer
                self.announce(
                    f"router {self.admin.base_url} refused worker {url}: HTTP {result.status}: "
                    f"{result.answer}; tried again at the next re-list"
                )
            elif isinstance(result, RouterDown):
                down = result
            else:
                raise result
        if down is not None:
            raise down
        return succeeded
