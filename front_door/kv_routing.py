"""The door's choice of engine by KV cache (docs/router.md, "Which engine a request goes to").

vllm-router takes its KV-event sources only as start-up flags (`--kv-event-source URL=ENDPOINT`),
so its index could not follow engines that come and go without restarting it; the door keeps the
index instead and sends a request to the engine it chose, straight (front_door/relay.py), falling
back to the router when that engine refuses or fails.

The engines come from motor-router-sync's pushes (`take`: each copy's id, generation, URL, models,
KV-event endpoint and tokenizer). Only engines in the last push get anything: one that left it
(died, hung, draining, not serving) has its feed stopped and its index dropped at once, and a new
generation starts with an empty index. An engine the door could not reach is avoided AVOID_S.

The cost of an engine for a request, in blocks of prefill: OVERLAP_WEIGHT x the request's blocks
it has not cached, plus the uncached blocks of the requests the door has in flight there (its
prefill queue), plus one per request in flight; the cheapest wins (ties: fewest in flight, then at
random), so a cached prefix draws its requests until its engine's queue costs more than computing
the prefix again elsewhere: no hot spot.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge

from front_door.kv_events_feed import EventsFeed
from front_door.kv_index import EngineIndex
from front_door.kv_prompt import SIM, json_object, prompt_ids
from front_door.kv_tokenize import EngineTokenizer, tokenize_request
from front_door.messages import Answer, Forward, Passed, Request
from motor.contract.kv_events import BLOCK_SIZE, prefix_keys

logger = logging.getLogger(__name__)

OVERLAP_WEIGHT = 1.0
AVOID_S = 5.0
ROUTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


@dataclass
class Engine:
    engine_id: str
    generation: int
    url: str
    models: frozenset[str]
    kv_events: str
    tokenizer: str
    index: EngineIndex = field(default_factory=EngineIndex)
    feed: EventsFeed | None = None
    in_flight: int = 0
    backlog: int = 0  # uncached blocks of the requests in flight here
    avoid_until: float = 0.0

    def same_copy(self, other: Engine) -> bool:
        return (self.generation, self.url, self.kv_events, self.tokenizer) == (
            other.generation,
            other.url,
            other.kv_events,
            other.tokenizer,
        )


def parse_engines(value: object) -> list[Engine] | str:
    """The pushed `engines` list, or what is wrong with it."""
    wanted = '"engines": [{"engine_id", "generation", "url", "models": [...], "kv_events", "tokenizer"}, ...]'
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        return f"give {wanted}"
    engines = []
    for item in value:
        models = item.get("models")
        texts = [item.get(k, "") for k in ("engine_id", "url", "kv_events", "tokenizer")]
        generation = item.get("generation", 0)
        if (
            not all(isinstance(t, str) for t in texts)
            or not texts[0]
            or not texts[1]
            or not isinstance(generation, int)
            or not isinstance(models, list)
            or not all(isinstance(m, str) for m in models)
        ):
            return f"give {wanted}"
        engine_id, url, kv_events, tokenizer = texts
        engines.append(Engine(engine_id, generation, url.rstrip("/"), frozenset(models), kv_events, tokenizer))
    return engines


class KvRouting:
    def __init__(
        self,
        served: Callable[[], dict[str, str | None]],
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
        overlap_weight: float = OVERLAP_WEIGHT,
    ) -> None:
        self.served, self.clock, self.overlap_weight = served, clock, overlap_weight
        self.engines: dict[str, Engine] = {}
        self._sent: dict[int, tuple[Engine, int]] = {}  # id(request) -> (its engine, its uncached blocks)
        self._context: zmq.asyncio.Context | None = None
        self.tokenizer = EngineTokenizer()
        self.decisions = Counter(
            "motor_front_door_kv_decisions",
            "Requests by how the door routed them: cached (to the engine holding most of the prompt's "
            "prefix), balanced (no engine held any: the least loaded), router (left to the router), "
            "fallback (the chosen engine failed: sent to the router).",
            ["model", "reason"],
            registry=registry,
        )
        self.blocks = Counter(
            "motor_front_door_kv_prompt_blocks",
            "Full KV blocks of the prompts the door routed, by whether the chosen engine held them.",
            ["model", "cached"],
            registry=registry,
        )
        Gauge(
            "motor_front_door_kv_indexed_blocks",
            "Blocks the door knows cached, all engines together (from their KV events).",
            registry=registry,
        ).set_function(lambda: sum(e.index.blocks() for e in self.engines.values()))

    @classmethod
    def install(cls, door, table) -> KvRouting:
        """Routing by KV cache in `door` (a FrontDoor), its engines from `table`'s pushes (a PushedTable)."""
        kv = cls(door.served, door.metrics.registry)
        relay = door.relay
        relay.decide, relay.ended, relay.direct_failed = kv.deciding(relay.decide), kv.ending(relay.ended), kv.failed
        table.take_engines = kv.take
        return kv

    # The engines ---------------------------------------------------------------------------------

    def take(self, value: object) -> str | None:
        """The engines as pushed now; the reason the list is refused, or None."""
        engines = parse_engines(value)
        if isinstance(engines, str):
            return engines
        now = {e.engine_id: e for e in engines}
        for engine_id, old in list(self.engines.items()):
            new = now.get(engine_id)
            if new is None or not new.same_copy(old):
                self._drop(old, "left the table" if new is None else "replaced")
        for engine_id, new in now.items():
            old = self.engines.get(engine_id)
            if old is not None:
                old.models = new.models  # (adapters loaded or unloaded: the same copy, its index kept)
                continue
            if new.kv_events:
                if self._context is None:
                    self._context = zmq.asyncio.Context()
                new.feed = EventsFeed(self._context, new.kv_events, new.index, engine_id)
            self.engines[engine_id] = new
            logger.info("KV routing: engine %s (generation %d) at %s, events %s", engine_id, new.generation,
                        new.url, new.kv_events or "none")  # fmt: skip
        return None

    def _drop(self, engine: Engine, why: str) -> None:
        if engine.feed is not None:
            engine.feed.stop()
        engine.index.clear()
        del self.engines[engine.engine_id]
        logger.info("KV routing: engine %s %s: its index dropped", engine.engine_id, why)

    async def close(self) -> None:
        for engine in list(self.engines.values()):
            self._drop(engine, "closed")
        if self._context is not None:
            self._context.term()
        await self.tokenizer.close()

    # Choosing ------------------------------------------------------------------------------------

    def candidates(self, model: str) -> tuple[list[Engine], str | None] | None:
        """The engines that may take a request for `model` now, and its adapter (None: a base model)."""
        served = self.served()
        if model not in served:
            return None
        now = self.clock()
        candidates = [e for e in self.engines.values() if model in e.models and e.avoid_until <= now]
        return (candidates, model if served[model] is not None else None) if candidates else None

    def choose(self, model: str, path: str, body: bytes) -> tuple[Engine, int] | None:
        """The engine for this request and the prompt's blocks it lacks, or None: left to the router
        (also when only the engine can tokenize the prompt: see `deciding`)."""
        found, request = self.candidates(model), json_object(body)
        ids = prompt_ids(path, request, found[0][0].tokenizer) if found is not None and request is not None else None
        return self.pick(model, *found, ids) if found is not None and ids is not None else None

    def pick(self, model: str, candidates: list[Engine], adapter: str | None, ids: list[int]) -> tuple[Engine, int]:
        """The cheapest of `candidates` for a prompt of `ids`, and what it lacks of the prompt, in
        blocks of BLOCK_SIZE tokens (each engine's blocks are cut at its own size: costs compare)."""
        cut: dict[int, list[bytes]] = {}  # block size -> the prompt's keys
        best, best_cost, best_keys, best_matched = None, (0.0, 0, 0.0), [], 0
        for engine in candidates:
            size = engine.index.block_size
            keys = cut[size] if size in cut else cut.setdefault(size, prefix_keys(ids, size))
            matched = engine.index.matched(adapter, keys)
            uncached = (len(keys) - matched) * size / BLOCK_SIZE
            cost = self.overlap_weight * uncached + engine.backlog + engine.in_flight
            ranked = (cost, engine.in_flight, random.random())
            if best is None or ranked < best_cost:
                best, best_cost, best_keys, best_matched = engine, ranked, keys, matched
        best.index.sent(adapter, best_keys)
        self.decisions.labels(model, "cached" if best_matched else "balanced").inc()
        self.blocks.labels(model, "yes").inc(best_matched)
        self.blocks.labels(model, "no").inc(len(best_keys) - best_matched)
        return best, round((len(best_keys) - best_matched) * best.index.block_size / BLOCK_SIZE)

    def deciding(self, decide: Callable[[Request], Answer | Forward]) -> Callable[[Request], Answer | Forward]:
        """`decide` (the door's stages) followed by the choice of engine, for a completion it forwards."""

        def decide_and_choose(request: Request) -> Answer | Forward:
            decision = decide(request)
            if not isinstance(decision, Forward) or request.method != "POST" or request.path not in ROUTED_PATHS:
                return decision
            found = self.candidates(request.label)
            parsed = json_object(decision.body or request.body) if found is not None else None
            if found is not None and parsed is not None:
                tokenizer = found[0][0].tokenizer
                ids = prompt_ids(request.path, parsed, tokenizer)
                if ids is not None:
                    return self._sent_to(request, decision, self.pick(request.label, *found, ids))
                asked = tokenize_request(request.path, parsed, request.label) if tokenizer not in ("", SIM) else None
                if asked is not None:  # a real engine's text: its ids asked of an engine (the relay waits)
                    return asyncio.ensure_future(self._tokenized(request, decision, asked))
            self.decisions.labels(request.label, "router").inc()
            return decision

        return decide_and_choose

    async def _tokenized(self, request: Request, decision: Forward, asked: dict) -> Forward:
        try:
            found = self.candidates(request.label)
            if found is not None:
                ids = await self.tokenizer.ids(min(found[0], key=lambda e: e.in_flight).url, asked)
                found = self.candidates(request.label)  # (the engines may have changed meanwhile)
                if ids is not None and found is not None:
                    return self._sent_to(request, decision, self.pick(request.label, *found, ids))
        except Exception:  # noqa: BLE001 - a bug in choosing must not lose the request: the router has it
            logger.exception("KV routing: choosing an engine failed")
        self.decisions.labels(request.label, "router").inc()
        return decision

    def _sent_to(self, request: Request, decision: Forward, chosen: tuple[Engine, int]) -> Forward:
        engine, uncached = chosen
        engine.in_flight += 1
        engine.backlog += uncached
        self._sent[id(request)] = (engine, uncached)
        return Forward(decision.body, engine=engine.url)

    def ending(self, ended: Callable[[Request | None, Passed], None]) -> Callable[[Request | None, Passed], None]:
        """`ended` (the door's), after the request's engine is given its place back."""

        def release_and_end(request: Request | None, passed: Passed) -> None:
            sent = self._sent.pop(id(request), None) if request is not None else None
            if sent is not None:
                engine, uncached = sent
                engine.in_flight -= 1
                engine.backlog -= uncached
            ended(request, passed)

        return release_and_end

    def failed(self, url: str, request: Request, why: str) -> None:
        """The engine at `url` refused or failed a request the door sent it (now the router's): the
        engine is avoided a while (the sync's next push says whether it is still serving)."""
        logger.info("KV routing: %s did not take a request (%s): sent to the router", url, why)
        self.decisions.labels(request.label, "fallback").inc()
        sent = self._sent.pop(id(request), None)
        if sent is not None:
            sent[0].in_flight -= 1
            sent[0].backlog -= sent[1]
        for engine in self.engines.values():
            if engine.url == url:
                engine.avoid_until = self.clock() + AVOID_S
