"""Which engine a request should reach, measured: vllm-router's power_of_two (Motor's router
policy), its cache_aware, and the front door's KV-event routing (--kv-routing), side by side in one
run on the same simulated engines, where prefill dominates (front_door/kv_routing.py,
docs/router.md "Which engine a request goes to").

Each engine is a real engine_server process of the simulated engine with a prefix cache of
`--blocks` blocks of 16 tokens (LRU) and a prefill cost per uncached token (`--prefill-ms`), its
KV events on ZMQ; in front, the real vllm-router (--enable-igw, as Motor runs it) and the front
door in its own process, given the table (and, for KV routing, the engines) as the sync pushes it.
All requests go through the door. Workloads:

  shared  (a) system prompts shared by many multi-turn chats, each turn's prompt the last one's
          and a new message; the caches cannot hold all the system prompts
  unique  (b) no reuse at all: every prompt new
  step    (c) the shared chats with a load step: a quarter of the clients, then all of them

Figures: the fleet's prefix-cache hit rate (the engines' vllm:prefix_cache_hits / _queries) and
against the oracle's (one LRU cache as large as the whole fleet's, seeing every prompt in the
order sent: what a perfect placement could keep at best), time to first token p50/p90 (streamed),
requests/s, and the busiest engine's load over the idlest's: in requests, and in prefill (the
tokens it had to compute, not cached), the work a hot spot would pile on one engine; for the load
step also in its second phase alone (at the peak).

    .venv/bin/python bench/kv_routing.py [--engines 4] [--blocks 120] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine_server.engines.sim_prefix_cache import SimPrefixCache  # noqa: E402
from motor.contract.sim_tokenizer import tokenize  # noqa: E402
from motor.ports import free_port  # noqa: E402
from motorctl.router import TYPED_WORKER_FLAGS  # noqa: E402
from tests.support.door_process import DoorProcess  # noqa: E402
from tests.support.engine_server_process import EngineServerProcess, sim_config  # noqa: E402
from tests.support.open_load import http  # noqa: E402
from tests.support.router_process import RouterProcess  # noqa: E402

MODEL = "sim-tiny"
POLICIES = ("power_of_two", "cache_aware", "kv")
DOOR_FLAGS = {"kv": ["--kv-routing"]}  # the door's policies: the router behind it on power_of_two


def words(prefix: str, count: int) -> str:
    return " ".join(f"{prefix}{n}" for n in range(count))


def chats(systems: int, conversations: int, turns: int, system_words: int, seed: int) -> list[list[str]]:
    """Each chat's prompts in order: its system prompt, then each turn's message appended."""
    rng = random.Random(seed)
    prompts = [words(f"sys{s}w", system_words) for s in range(systems)]
    out = []
    for c in range(conversations):
        prompt, turns_of = prompts[rng.randrange(systems)], []
        for t in range(turns):
            prompt = f"{prompt} {words(f'c{c}t{t}u', 40)}"
            turns_of.append(prompt)
            prompt = f"{prompt} {words(f'c{c}t{t}a', 16)}"  # (the answer, as the next turn sends it)
        out.append(turns_of)
    return out


def unique(count: int, length: int) -> list[list[str]]:
    return [[words(f"u{n}w", length)] for n in range(count)]


class Fleet:
    def __init__(self, work: Path, engines: int, blocks: int, prefill_ms: float):
        self.blocks, self.engines = blocks, []
        for i in range(engines):
            events = free_port()
            args = {"model": MODEL, "kv_cache_blocks": blocks, "kv_events_port": events, "max_num_seqs": 16,
                    "prefill_ms_per_token": prefill_ms, "decode_ms_per_token": 1}  # fmt: skip
            engine = EngineServerProcess(work, sim_config("union", args, {"enable_virtual_inference": False}),
                                         role="union", instance_id=f"u-{i}")  # fmt: skip
            engine.events_port = events
            self.engines.append(engine)
        for engine in self.engines:
            deadline = time.monotonic() + 60
            while not self._up(engine):
                assert time.monotonic() < deadline, engine.output
                time.sleep(0.2)

    @staticmethod
    def _up(engine: EngineServerProcess) -> bool:
        try:
            return engine.http("GET", "/health")[0] == 200
        except OSError:
            return False

    def counters(self) -> list[tuple[float, float, float]]:
        """(requests, prefix-cache queries, hits) of each engine."""
        out = []
        for engine in self.engines:
            text = engine.http("GET", "/metrics")[1]

            def total(name: str, text: str = text) -> float:
                return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))

            out.append((total("vllm:request_success_total"), total("vllm:prefix_cache_queries_total"),
                        total("vllm:prefix_cache_hits_total")))  # fmt: skip
        return out

    def reset(self) -> None:
        for engine in self.engines:
            assert engine.http("POST", "/reset_prefix_cache")[0] == 200

    def table(self) -> dict:
        return {"served": {MODEL: None}, "engines": [
            {"engine_id": f"u-{i}", "generation": 1, "url": f"http://127.0.0.1:{e.port}", "models": [MODEL],
             "kv_events": f"tcp://127.0.0.1:{e.events_port}", "tokenizer": "sim"}
            for i, e in enumerate(self.engines)]}  # fmt: skip

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()


def push(door: DoorProcess, body: dict) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{door.table_port}/served", data=json.dumps(body).encode(), method="PUT"
    )
    with urllib.request.urlopen(request, timeout=2) as reply:
        assert reply.status == 204


async def drive(
    url: str, work: list[list[str]], phases: list[tuple[int, int]], phase_began: Callable[[], None]
) -> tuple[list[float], list[str], int]:
    """Chats sent by closed-loop clients, each chat's turns in order: `phases` (clients, chats) one
    after the other, `phase_began` called as each begins. (TTFTs, prompts in the order sent, failures)."""
    ttfts, sent, failures = [], [], 0
    queue = list(work)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client(share: list[list[str]]):
            nonlocal failures
            while share:
                for prompt in share.pop(0):
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True}
                    began = time.monotonic()
                    sent.append(prompt)
                    async with session.post(url + "/v1/completions", json=body) as reply:
                        first = None
                        async for line in reply.content:
                            if first is None and line.startswith(b"data:"):
                                first = time.monotonic() - began
                        if reply.status != 200 or first is None:
                            failures += 1
                        else:
                            ttfts.append(first)

        for clients, count in phases:
            phase_began()
            batch, queue = queue[:count], queue[count:]
            shares = [batch[i::clients] for i in range(clients)]
            await asyncio.gather(*(client(share) for share in shares))
    return ttfts, sent, failures


def oracle(sent: list[str], blocks: int) -> float:
    cache = SimPrefixCache(blocks, lambda events: None, ("oracle", "0"))
    for prompt in sent:
        ids = tokenize(prompt)
        cache.lookup(ids)
        cache.store(ids)
    return cache.hit / cache.queried


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run(policy: str, fleet: Fleet, work_dir: Path, workloads: dict) -> list[dict]:
    # (the last --policy wins: after RouterProcess's own, Motor's power_of_two)
    extra = [*TYPED_WORKER_FLAGS, "--policy", "power_of_two" if policy in DOOR_FLAGS else policy]
    router = RouterProcess(str(work_dir), extra=extra)
    door = None
    rows = []
    try:
        for engine in fleet.engines:
            url = f"http://127.0.0.1:{engine.port}"
            status, text = http("POST", router.url + "/workers", {"url": url, "model_id": MODEL})
            assert status < 300, text
        deadline = time.monotonic() + 15
        while len(router.workers()) < len(fleet.engines):
            assert time.monotonic() < deadline, "workers not listed"
            time.sleep(0.1)
        log = str(work_dir / f"door-{policy}.log")
        door = DoorProcess(router.url, log, served={MODEL: None}, extra=DOOR_FLAGS.get(policy, []))
        if policy in DOOR_FLAGS:
            push(door, fleet.table())
            time.sleep(0.5)  # (the door's ZMQ subscriptions join)
        for name, (work, phases) in workloads.items():
            fleet.reset()
            time.sleep(0.3)
            marks: list = []  # the engines' counters as each phase began
            began = time.monotonic()
            ttfts, sent, failures = asyncio.run(
                drive(door.url, [list(c) for c in work], phases, lambda: marks.append(fleet.counters()))
            )
            seconds = time.monotonic() - began
            after = fleet.counters()
            before = marks[0]
            served = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
            # Prefill work each engine did: the tokens it had to compute (queried, not hit).
            work = [(a[1] - a[2]) - (b[1] - b[2]) for a, b in zip(after, before, strict=True)]
            # ... and in the last phase alone: a load step's peak, where a hot spot would hurt.
            peak = [(a[1] - a[2]) - (b[1] - b[2]) for a, b in zip(after, marks[-1], strict=True)]
            queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
            hits = sum(a[2] - b[2] for a, b in zip(after, before, strict=True))
            best = oracle(sent, fleet.blocks * len(fleet.engines))
            rows.append({"policy": policy, "workload": name, "hit": hits / queries if queries else 0.0,
                         "oracle": best, "p50": pct(ttfts, 0.5), "p90": pct(ttfts, 0.9),
                         "rps": len(sent) / seconds, "balance": max(served) / max(min(served), 1),
                         "work": max(work) / max(min(work), 1), "peak": max(peak) / max(min(peak), 1),
                         "failures": failures, "requests": len(sent)})  # fmt: skip
    finally:
        if door is not None:
            door.stop()
        router.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=120, help="each engine's prefix cache, blocks of 16 tokens")
    parser.add_argument("--prefill-ms", type=float, default=0.5, help="prefill per uncached token, ms")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--systems", type=int, default=8, help="shared system prompts (400 tokens each)")
    parser.add_argument("--chats", type=int, default=48)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workloads", default="shared,unique,step", help="which of shared, unique, step to run")
    args = parser.parse_args()
    shared = chats(args.systems, args.chats, args.turns, 400, args.seed)
    step_low = max(1, args.concurrency // 4)
    workloads = {
        "shared": (shared, [(args.concurrency, len(shared))]),
        "unique": (unique(args.chats * 2, 450), [(args.concurrency, args.chats * 2)]),
        "step": (shared, [(step_low, len(shared) // 3), (args.concurrency, len(shared))]),
    }
    workloads = {name: workloads[name] for name in args.workloads.split(",")}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kv-routing-") as work:
        fleet = Fleet(Path(work), args.engines, args.blocks, args.prefill_ms)
        rows = []
        try:
            for policy in args.policies.split(","):
                rows += run(policy, fleet, Path(work), workloads)
        finally:
            fleet.stop()
    print(f"{args.engines} sim engines, {args.blocks} blocks each, prefill {args.prefill_ms} ms/token, "
          f"{args.concurrency} clients; {time.monotonic() - began:.0f} s, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
    print("| workload | policy | hit rate | of oracle's | TTFT p50 ms | TTFT p90 ms | req/s | busiest/idlest "
          "requests | busiest/idlest prefill (at the peak) | requests | failed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (list(workloads).index(r["workload"]), POLICIES.index(r["policy"]))):
        of = f"{r['hit'] / r['oracle']:.0%}" if r["oracle"] else "-"
        print(f"| {r['workload']} | {r['policy']} | {r['hit']:.0%} | {of} | {r['p50'] * 1000:.0f} | "
              f"{r['p90'] * 1000:.0f} | {r['rps']:.1f} | {r['balance']:.2f} | {r['work']:.2f} ({r['peak']:.2f}) | "
              f"{r['requests']} | {r['failures']} |")  # fmt: skip


if __name__ == "__main__":
    main()
