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

`--engine vllm`: real vLLM CPU engines of the tiny model instead (VLLM_DEFAULTS: two engines, two
clients, caches of 16 blocks of 128 tokens, six system prompts of about 375 tokens), the door
asking an engine's /tokenize for each prompt's ids (docs/benchmarks.md says what it measures).

    .venv/bin/python bench/kv_routing.py [--engine sim|vllm] [--engines 4] [--blocks 120] [--concurrency 8]
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
from motorctl.tiny_model import LEAN_CPU_ARGS, corpus_words, ensure_tiny_model  # noqa: E402
from tests.support.door_process import DoorProcess  # noqa: E402
from tests.support.engine_server_process import EngineServerProcess, sim_config  # noqa: E402
from tests.support.open_load import http  # noqa: E402
from tests.support.router_process import RouterProcess  # noqa: E402

MODEL = "sim-tiny"
VOCABULARY = corpus_words()
SIM_DEFAULTS = {"engines": 4, "blocks": 120, "concurrency": 8, "systems": 8, "chats": 48, "turns": 4}
# The set-up on real engines: two of them, six shared system prompts (about 390 tokens),
# caches that hold about three of them each, two clients. The tiny model's 512 positions bound a
# chat at two turns.
VLLM_DEFAULTS = {"engines": 2, "blocks": 16, "concurrency": 2, "systems": 6, "chats": 42, "turns": 2}
POLICIES = ("power_of_two", "cache_aware", "kv")
DOOR_FLAGS = {"kv": ["--kv-routing"]}  # the door's policies: the router behind it on power_of_two


def sim_words(prefix: str, count: int) -> str:
    """Words the simulated engine reads as one token each, distinct for each prefix."""
    return " ".join(f"{prefix}{n}" for n in range(count))


def english_words(prefix: str, count: int) -> str:
    """Words of the tiny model's own corpus (one or two tokens each to its tokenizer), in an order
    drawn from `prefix`: distinct prompts that a real tokenizer does not blow up."""
    rng = random.Random(prefix)
    return " ".join(rng.choice(VOCABULARY) for _ in range(count))


def chats(words: Callable[[str, int], str], systems: int, conversations: int, turns: int, sizes: tuple[int, int, int],
          seed: int) -> list[list[str]]:  # fmt: skip
    """Each chat's prompts in order: its system prompt, then each turn's message appended.
    `sizes`: the words of a system prompt, of a turn's message, of an answer."""
    system_words, turn_words, answer_words = sizes
    rng = random.Random(seed)
    prompts = [words(f"sys{s}w", system_words) for s in range(systems)]
    out = []
    for c in range(conversations):
        prompt, turns_of = prompts[rng.randrange(systems)], []
        for t in range(turns):
            prompt = f"{prompt} {words(f'c{c}t{t}u', turn_words)}"
            turns_of.append(prompt)
            prompt = f"{prompt} {words(f'c{c}t{t}a', answer_words)}"  # (the answer, as the next turn sends it)
        out.append(turns_of)
    return out


def unique(words: Callable[[str, int], str], count: int, length: int) -> list[list[str]]:
    return [[words(f"u{n}w", length)] for n in range(count)]


class Fleet:
    """Simulated engines."""

    model, tokenizer, block_size, words = MODEL, "sim", 16, staticmethod(sim_words)
    sizes = (400, 40, 16)  # words (tokens) of a system prompt, a turn, an answer

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
        return {"served": {self.model: None}, "engines": [
            {"engine_id": f"u-{i}", "generation": 1, "url": f"http://127.0.0.1:{e.port}", "models": [self.model],
             "kv_events": f"tcp://127.0.0.1:{e.events_port}", "tokenizer": self.tokenizer}
            for i, e in enumerate(self.engines)]}  # fmt: skip

    def ids(self, prompt: str) -> list[int]:
        return tokenize(prompt)

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()


class VllmFleet(Fleet):
    """Real vLLM CPU engines of the tiny model (made here), with KV events and vLLM's prefix cache of
    `blocks` blocks of 128 tokens (its CPU backend's size) each."""

    model, tokenizer, block_size, words = "tiny-llama", "tiny-llama", 128, staticmethod(english_words)
    sizes = (360, 30, 8)  # words: a system prompt about 375 tokens, a chat of two turns within 512

    def __init__(self, work: Path, engines: int, blocks: int):
        from tokenizers import Tokenizer

        from tests.support.vllm_engines import offline_vllm_env, vllm_config

        path = ensure_tiny_model(str(work / "tiny-llama"))
        self._tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        # (dev mode: /reset_prefix_cache between workloads)
        os.environ.update(offline_vllm_env(str(work / "vllm-cache")), VLLM_SERVER_DEV_MODE="1")
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        # A block: K and V, 2 layers, 4 heads of 32 floats, 128 tokens.
        block_bytes = 2 * 2 * 4 * 32 * 4 * self.block_size
        args = {**LEAN_CPU_ARGS, "max_model_len": 512, "kv_cache_memory_bytes": blocks * block_bytes,
                "served_model_name": self.model, "max_num_seqs": 4}  # fmt: skip
        self.blocks, self.engines = blocks, []
        for i in range(engines):
            events = free_port()
            # stall_timeout 30 s (Motor's default is 2): two vLLM engines, the router, the door and the
            # clients on two cores, an engine here sometimes made no progress for 2 s, and the stall
            # watchdog's verdicts, right as they were, would measure this machine, not the routing.
            health = {"enable_virtual_inference": False, "stall_timeout": 30.0, "stall_kill_after": 60.0}
            config = vllm_config(path, health, role="union", **args)
            engine = EngineServerProcess(work, config, role="union", instance_id=f"u-{i}",
                                         extra_args=["--kv-events-port", str(events)])  # fmt: skip
            engine.events_port = events
            self.engines.append(engine)
        for engine in self.engines:
            deadline = time.monotonic() + 300
            while not self._up(engine):
                assert engine.process.poll() is None and time.monotonic() < deadline, engine.output[-3000:]
                time.sleep(0.5)
        # A cold engine's first long prompts took over 2 s here with the other engine starting
        # beside it (the stall watchdog's 2 s then took it out of traffic): warm each first.
        for engine in self.engines:
            for n in range(3):
                body = {"model": self.model, "prompt": english_words(f"warm{n}", sum(self.sizes)), "max_tokens": 8}
                status, text = engine.http("POST", "/v1/completions", body, timeout=120)
                assert status == 200, text

    def ids(self, prompt: str) -> list[int]:
        return self._tokenizer.encode(prompt).ids  # (its post-processor adds the BOS, as vLLM's completions do)


def push(door: DoorProcess, body: dict) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{door.table_port}/served", data=json.dumps(body).encode(), method="PUT"
    )
    with urllib.request.urlopen(request, timeout=2) as reply:
        assert reply.status == 204


async def drive(
    url: str, model: str, work: list[list[str]], phases: list[tuple[int, int]], phase_began: Callable[[], None]
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
                    body = {"model": model, "prompt": prompt, "max_tokens": 8, "stream": True}
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


def oracle(sent: list[str], blocks: int, fleet: Fleet) -> float:
    cache = SimPrefixCache(blocks, lambda events: None, ("oracle", "0"), block_size=fleet.block_size)
    for prompt in sent:
        ids = fleet.ids(prompt)
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
            status, text = http("POST", router.url + "/workers", {"url": url, "model_id": fleet.model})
            assert status < 300, text
        deadline = time.monotonic() + 15
        while len(router.workers()) < len(fleet.engines):
            assert time.monotonic() < deadline, "workers not listed"
            time.sleep(0.1)
        log = str(work_dir / f"door-{policy}.log")
        door = DoorProcess(router.url, log, served={fleet.model: None}, extra=DOOR_FLAGS.get(policy, []))
        if policy in DOOR_FLAGS:
            push(door, fleet.table())
            time.sleep(0.5)  # (the door's ZMQ subscriptions join)
        for name, (work, phases) in workloads.items():
            fleet.reset()
            time.sleep(0.3)
            marks: list = []  # the engines' counters as each phase began
            began = time.monotonic()
            ttfts, sent, failures = asyncio.run(
                drive(door.url, fleet.model, [list(c) for c in work], phases, lambda: marks.append(fleet.counters()))
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
            best = oracle(sent, fleet.blocks * len(fleet.engines), fleet)
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
    parser.add_argument("--engine", choices=["sim", "vllm"], default="sim",
                        help="vllm: real vLLM CPU engines of the tiny model (then VLLM_DEFAULTS)")  # fmt: skip
    parser.add_argument("--engines", type=int)
    parser.add_argument(
        "--blocks", type=int, help="each engine's prefix cache, in its blocks (sim: 16 tokens; vLLM CPU: 128)"
    )
    parser.add_argument("--prefill-ms", type=float, default=0.5, help="sim: prefill per uncached token, ms")
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--systems", type=int, help="shared system prompts")
    parser.add_argument("--chats", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workloads", default="shared,unique,step", help="which of shared, unique, step to run")
    args = parser.parse_args()
    for name, value in (VLLM_DEFAULTS if args.engine == "vllm" else SIM_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    kind = VllmFleet if args.engine == "vllm" else Fleet
    shared = chats(kind.words, args.systems, args.chats, args.turns, kind.sizes, args.seed)
    step_low = max(1, args.concurrency // 4)
    workloads = {
        "shared": (shared, [(args.concurrency, len(shared))]),
        "unique": (unique(kind.words, args.chats * 2, sum(kind.sizes)), [(args.concurrency, args.chats * 2)]),
        "step": (shared, [(step_low, len(shared) // 3), (args.concurrency, len(shared))]),
    }
    workloads = {name: workloads[name] for name in args.workloads.split(",")}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kv-routing-") as work:
        if args.engine == "vllm":
            fleet = VllmFleet(Path(work), args.engines, args.blocks)
        else:
            fleet = Fleet(Path(work), args.engines, args.blocks, args.prefill_ms)
        rows = []
        try:
            for policy in args.policies.split(","):
                rows += run(policy, fleet, Path(work), workloads)
        finally:
            fleet.stop()
    engines = "vLLM CPU engines (tiny model)" if args.engine == "vllm" else "sim engines"
    prefill = "" if args.engine == "vllm" else f", prefill {args.prefill_ms} ms/token"
    print(f"{args.engines} {engines}, {args.blocks} blocks of {fleet.block_size} tokens each{prefill}, "
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
