"""How long one /metrics scrape holds the controller's event loop, in-process, at fleet scale.

A real `controller.core.Controller` is built as bench/controller_memory.py builds it (--nodes
nodes, --instances x --dp engines placed, started and heartbeating NORMAL), its /metrics is
served on a free loopback port by the controller's own `ServiceTelemetry` (its registry, then
its fleet series), and `curl` in a child process scrapes it (as Prometheus does, asking for
gzip unless --identity), --scrapes times. Meanwhile a ticker coroutine stands in for the
heartbeats: it asks to run every --tick seconds and records how late the loop ran it.

Per scrape it prints: the scrape's duration and size (as curl saw them), the longest the loop
made the ticker wait (the longest stall a heartbeat would have seen), the ticker's p99 lateness
during the scrape, and the CPU the loop's thread spent in that time (what the scrape took away
from heartbeats, whether in one stall or spread over many loop turns).

    .venv/bin/python bench/metrics_scrape.py --nodes 10000 --instances 10000 --dp 8   # 10,000 x 8
    .venv/bin/python bench/metrics_scrape.py --nodes 1000 --instances 1000 --dp 8 --scrapes 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.controller_memory import build  # noqa: E402
from motor.metrics_http import ServiceTelemetry  # noqa: E402
from motor.ports import free_port  # noqa: E402


class Ticker:
    """Asks the loop to run it every `tick` seconds and records how late it ran (seconds)."""

    def __init__(self, tick: float):
        self.tick, self.lateness = tick, []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.tick
            await asyncio.sleep(self.tick)
            self.lateness.append(max(0.0, loop.time() - due))


async def scrape_once(port: int, identity: bool, ticker: Ticker) -> dict:
    """One curl scrape, the ticker's lateness and the loop thread's CPU over it."""
    ticker.lateness.clear()
    cpu_before = time.thread_time()  # this coroutine runs on the loop's thread
    command = ["curl", "-sS", "-o", "/dev/null", "-w", "%{time_total} %{size_download}",
               f"http://127.0.0.1:{port}/metrics"] + ([] if identity else ["--compressed"])
    curl = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    out, _ = await curl.communicate()
    loop_cpu = time.thread_time() - cpu_before
    seconds, size = out.split()
    late = sorted(ticker.lateness) or [0.0]
    return {"seconds": float(seconds), "bytes": int(size), "max_stall": late[-1],
            "p99_stall": late[min(len(late) - 1, int(0.99 * len(late)))], "loop_cpu": loop_cpu}


async def measure(args) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="motor-scrape-") as work:
        began = time.monotonic()
        controller = await build(args, work)
        print(f"{args.nodes} nodes, {args.instances} instances x dp {args.dp} = {args.instances * args.dp} engines "
              f"(built in {time.monotonic() - began:.1f} s, Python {sys.version.split()[0]})", flush=True)
        telemetry = ServiceTelemetry(controller.metrics.registry, controller.fleet_series.render)
        port = await telemetry.serve("127.0.0.1", free_port())
        ticker = Ticker(args.tick)
        ticking = asyncio.create_task(ticker.run())
        results = []
        try:
            await asyncio.sleep(0.5)
            for _ in range(args.scrapes):
                results.append(await scrape_once(port, args.identity, ticker))
                r = results[-1]
                print(f"scrape {r['seconds']:.3f} s, {r['bytes'] / 2**20:.1f} MiB on the wire | loop stalled at most "
                      f"{r['max_stall'] * 1e3:.1f} ms (p99 {r['p99_stall'] * 1e3:.1f} ms, ticker every "
                      f"{args.tick * 1e3:g} ms) | loop thread CPU {r['loop_cpu'] * 1e3:.0f} ms", flush=True)
                await asyncio.sleep(args.pause)
        finally:
            ticking.cancel()
            await telemetry.close()
        return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10000)
    parser.add_argument("--accelerators", type=int, default=8, help="per node")
    parser.add_argument("--instances", type=int, default=10000)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--scrapes", type=int, default=5)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between scrapes")
    parser.add_argument("--tick", type=float, default=0.002, help="the ticker's period (seconds)")
    parser.add_argument("--identity", action="store_true", help="scrape without asking for gzip")
    parser.add_argument("--config-bytes", type=int, default=0, help=argparse.SUPPRESS)  # build() reads it
    parser.add_argument("--beats", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instances * args.dp > args.nodes * args.accelerators:
        parser.error("the fleet has no room for every engine: more --nodes or --accelerators")
    results = asyncio.run(measure(args))
    median = {key: statistics.median(r[key] for r in results) for key in results[0]}
    print(f"median of {len(results)}: scrape {median['seconds']:.3f} s, loop stalled at most "
          f"{median['max_stall'] * 1e3:.1f} ms, loop thread CPU {median['loop_cpu'] * 1e3:.0f} ms per scrape")
    return 0


if __name__ == "__main__":
    sys.exit(main())
