"""How long one /metrics scrape holds the controller's event loop, in-process, at fleet scale.

A real `controller.core.Controller` is built as bench/controller_memory.py builds it (--nodes
nodes, --instances x --dp engines placed, started and heartbeating NORMAL), its /metrics is
served on a free loopback port by the controller's own `ServiceTelemetry` (its registry, then
its fleet series), with the controller's garbage collection policy (controller/gc_tuning.py), and
`curl` in a child process scrapes it (as Prometheus does, asking for gzip unless --identity),
--scrapes times. Meanwhile a ticker coroutine stands in for the heartbeats: it asks to run
every --tick seconds and records how late the loop ran it.

Per scrape it prints: the scrape's duration and size on the wire (as curl saw them), the longest
the loop held the ticker (how late it ran, less the time the loop's thread waited for a CPU
meanwhile, as motor_event_loop_blocked_seconds counts: the longest stall a heartbeat would have
seen from the scrape, not from the machine's other load), the longest lateness itself, and the
CPU the loop's thread spent during the scrape (what the scrape took away from heartbeats, in one
stall or spread over many loop turns). --compare REV runs the same measurement first on the
code of git revision REV (`git archive` into a temporary directory, this script copied in) and
prints the two side by side.

    .venv/bin/python bench/metrics_scrape.py                      # 10,000 nodes x 8 engines
    .venv/bin/python bench/metrics_scrape.py --compare main       # main's code, then this tree's
    .venv/bin/python bench/metrics_scrape.py --nodes 1000 --instances 1000 --dp 8 --scrapes 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.controller_memory import build  # noqa: E402
from controller.gc_tuning import TenuredCollections  # noqa: E402
from motor.ports import free_port  # noqa: E402
from motor.service.loop_lag import timer_lags  # noqa: E402
from motor.service.metrics_http import ServiceTelemetry  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIGURES = {
    "seconds": "scrape (s)",
    "wire_mib": "on the wire (MiB)",
    "max_held_ms": "loop held at most (ms)",
    "max_late_ms": "ticker late at most (ms)",
    "loop_cpu_ms": "loop thread CPU (ms)",
}


class Ticker:
    """Asks the loop to run it every `tick` seconds and records how late it ran and, of that, how
    long the loop held it (less the time the thread waited for a CPU), in seconds."""

    def __init__(self, tick: float):
        self.tick, self.lateness, self.held = tick, [], []

    async def run(self) -> None:
        async for late, held in timer_lags(self.tick):
            self.lateness.append(late)
            self.held.append(held)


async def scrape_once(port: int, identity: bool, ticker: Ticker) -> dict:
    """One curl scrape, the ticker's lateness and the loop thread's CPU over it."""
    ticker.lateness.clear()
    ticker.held.clear()
    cpu_before = time.thread_time()  # this coroutine runs on the loop's thread
    command = [
        "curl",
        "-sS",
        "-o",
        "/dev/null",
        "-w",
        "%{time_total} %{size_download}",
        f"http://127.0.0.1:{port}/metrics",
    ] + ([] if identity else ["--compressed"])
    curl = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    out, _ = await curl.communicate()
    loop_cpu = time.thread_time() - cpu_before
    seconds, size = out.split()
    return {
        "seconds": float(seconds),
        "wire_mib": int(size) / 2**20,
        "max_held_ms": max(ticker.held, default=0) * 1e3,
        "max_late_ms": max(ticker.lateness, default=0) * 1e3,
        "loop_cpu_ms": loop_cpu * 1e3,
    }


async def measure(args) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="motor-scrape-") as work:
        began = time.monotonic()
        controller = await build(args, work)
        print(
            f"{args.nodes} nodes, {args.instances} instances x dp {args.dp} = {args.instances * args.dp} engines "
            f"(built in {time.monotonic() - began:.1f} s, Python {sys.version.split()[0]})",
            flush=True,
        )
        collections = TenuredCollections().install()  # as the controller runs (controller/cli.py)
        pacing = asyncio.create_task(collections.pace())
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
                print(
                    f"scrape {r['seconds']:.3f} s, {r['wire_mib']:.1f} MiB on the wire | loop held the ticker "
                    f"(every {args.tick * 1e3:g} ms) at most {r['max_held_ms']:.1f} ms (late at most "
                    f"{r['max_late_ms']:.1f} ms) | loop thread CPU {r['loop_cpu_ms']:.0f} ms",
                    flush=True,
                )
                await asyncio.sleep(args.pause)
        finally:
            ticking.cancel()
            pacing.cancel()
            collections.uninstall()
            await telemetry.close()
        return results


def compare(args) -> dict[str, float]:
    """The medians of this measurement on git revision `args.compare`'s code."""
    with tempfile.TemporaryDirectory(prefix="motor-compare-") as tree:
        root = os.path.dirname(HERE)  # (git archive in a subdirectory archives only that)
        archive = subprocess.run(["git", "-C", root, "archive", args.compare], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
        script = os.path.join(tree, "bench", os.path.basename(__file__))
        with open(__file__, "rb") as mine, open(script, "wb") as copy:
            copy.write(mine.read())
        command = [sys.executable, script, "--json"] + [a for a in sys.argv[1:] if a not in ("--compare", args.compare)]
        done = subprocess.run(
            command, stdout=subprocess.PIPE, text=True, check=True, env=dict(os.environ, PYTHONPATH=tree), cwd=tree
        )
        *lines, medians = done.stdout.splitlines()
        print("\n".join(lines), flush=True)
        return json.loads(medians)


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
    parser.add_argument("--compare", metavar="REV", help="first measure git revision REV's code, then print both")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the medians, last line (--compare)
    parser.add_argument("--config-bytes", type=int, default=0, help=argparse.SUPPRESS)  # build() reads it
    parser.add_argument("--beats", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instances * args.dp > args.nodes * args.accelerators:
        parser.error("the fleet has no room for every engine: more --nodes or --accelerators")
    before = None
    if args.compare:
        print(f"== {args.compare} ({rev(args.compare)})", flush=True)
        before = compare(args)
        print(f"== this tree ({rev('HEAD')}{', with changes not committed' if dirty() else ''})", flush=True)
    results = asyncio.run(measure(args))
    median = {key: statistics.median(r[key] for r in results) for key in FIGURES}
    print(f"median of {len(results)}: " + ", ".join(f"{FIGURES[k]} {v:.3g}" for k, v in median.items()), flush=True)
    if args.json:
        print(json.dumps(median))
    if before is not None:
        print(f"\n{'median of ' + str(args.scrapes) + ' scrapes':<28}{args.compare:>14}{'this tree':>14}")
        for key, name in FIGURES.items():
            print(f"{name:<28}{before[key]:>14.3g}{median[key]:>14.3g}")
    return 0


def rev(name: str) -> str:
    found = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", name], capture_output=True, text=True)
    return found.stdout.strip()


def dirty() -> bool:
    return bool(
        subprocess.run(
            ["git", "-C", HERE, "status", "--porcelain", "--", ".."], capture_output=True, text=True
        ).stdout.strip()
    )


if __name__ == "__main__":
    sys.exit(main())
