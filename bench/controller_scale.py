"""How many nodes can one controller process keep up with, with mutual TLS and without?

Starts a real `motor-controller` process and a simulated fleet in a separate process
(bench/fleet, Go; built on first use with bench/fleet/build.sh): every simulated node manager
registers, gets one 8-rank instance placed on it (the fleet answers StartEngine), and heartbeats
at the interval the controller announces (1 s until the fleet would exceed the controller's
--max-heartbeats-per-second, then nodes / that rate: docs/controller-decisions.md#heartbeat-rate-budget)
on its own StreamHeartbeats stream with deltas (a full list every 30 beats), or with unary
Heartbeat calls (--transport unary). Every node has its own connection, as real node
managers do (--conns N shares N instead, plaintext only). Meanwhile the fleet fails random
engines (ReportEngineEvent, --reports-per-s), which the controller restarts. The fleet is stepped
up; per step the script prints:

  - the announced heartbeat interval and grace, heartbeats/s answered against the rate asked for
    (nodes / interval), and the round trip the simulated nodes saw (p50, p99);
  - engine failure reports: how many, round trip p50 and p99 (handled before the answer), and the
    figure their verdict rests on (see below);
  - the controller process's CPU (percent of one core), its resident memory, and the fleet's CPU;
  - where the controller's CPU goes, per heartbeat (all of its CPU over the beats answered: an
    upper bound, reports and scrapes included): its event-loop thread (of it, Motor's own handling,
    motor_controller_handling_cpu_seconds_total{call="heartbeat"}, the garbage collections, and
    the rest: gRPC's reads and writes and the asyncio loop) and its other threads (gRPC's
    pollers, /metrics); and Motor's handling of one failure report ({call="report"});
  - the controller's event-loop lag p99 (its motor_event_loop_lag_seconds histogram over the
    window) and, of it, the part not spent waiting for a CPU (motor_event_loop_blocked_seconds:
    what the controller itself held the loop for; the rest is the machine's load), the share of
    the window its loop thread ran and the share it waited, runnable, for a CPU (Linux schedstat:
    the machine's load, measured), and its largest lag in the window; the controller's garbage
    collections in the window (motor_gc_pause_seconds: p50 and longest, bucket bounds);
  - the /metrics scrapes of the step: the script scrapes as Prometheus does, from the controller's
    start to the step's end, every --scrape-interval (15 s) with gzip asked and a 10 s timeout
    (bench/prometheus_scraper.py), its phase set so that one falls in the middle of the window:
    how many since the fleet was set up (and during its set-up), their duration (p50, max), their
    size, and any that failed;
  - whether the step was sustained: heartbeat p99 under --p99-ms, at least 95% of the expected
    heartbeats answered, none failed, controller CPU at most one core, the memory rule below,
    every scrape since the set-up answered within its timeout, failure reports under
    --report-p99-ms (10) with none failed, what the controller owns (below); and, for a step that
    misses only the CPU or memory bound, that its heartbeats alone were sustained.

    What the controller owns: its CPU per heartbeat at most --cpu-at-budget (0.8) of a core at
    the heartbeat budget (0.4 ms at 2,000 beats/s: the most beats any fleet sends, whatever its
    size), Motor's handling of a failure report at most --report-cpu-ms (2), and the event loop
    held by its own work (motor_event_loop_blocked_seconds, not the waits for a CPU) p99 at most
    --blocked-p99-ms (25): figures of the controller's own work, not of the queue for a CPU.

    Cores: --cores own,shared (the default) runs each step twice. First, judged: the controller
    pinned to a core of its own (the last CPU) and every other task on the machine (the fleet,
    this script, anything else running) moved off it for the step, then put back (the machine line
    says so). Then the same step with every process on every CPU, as before, printed as a second
    line marked "printed, not judged": on two cores, a shared machine's verdict is the machine's
    load as much as the controller's.

    Failure reports: the fleet reports --reports-per-s (20) a second, a few hundred per window
    (200 in a 10 s window). A quantile is judged only where at least two reports lie at or above
    it, so that one slow call does not decide: the p99 from 200 reports, the p95 from 40, below
    that the longest; the line names the figure judged and n.

    Memory: what the fleet adds to the controller is judged, not its fixed part (the interpreter,
    the modules, the store: about 100 MiB, which dominates a small step). The controller's RSS
    is read once it serves, before any node connects (its idle RSS); the step's RSS less that is
    held to --floor-ratio (1.3) times what the step's connections add to a bare grpc.aio server
    (the bare-grpcio floor less that server's own idle RSS). The floor is measured first, in the
    same run, by bench/grpc_connection_memory.py's own code: a bare server's RSS idle and what one
    connection costs it, measured with --floor-connections of them; a step of either mode is held
    to the mutual-TLS floor (--floor-mode same: each mode to its own).

A ladder stops when a step collapses (under half the heartbeats asked for answered).

Every step runs on a fresh controller and fleet. --tls both (the default) runs each size twice,
plaintext then with mutual TLS on every connection, one right after the other (the machine's load
drifts: neighbours in time compare best): the script makes a CA (motor/security/pki.py), the controller
serves with its own certificate and verifies callers, and each simulated node presents a
certificate of its own (ECDSA P-256, URI SAN spiffe://motor/node/<id>, minted by the fleet from
that CA). The summary compares the largest fleet sustained with and without, by each rule: all of
the above (the scale goal), and the heartbeats alone (what TLS costs in time,
apart from its memory, ~50 KiB per connection). A ladder's steps
are coarse where the two modes part; --search LO,HI bisects instead, for each mode, the largest
size sustained in [LO, HI) until the bounds are within --precision (10%) of each other, the modes
taking turns at each round, holding each step to --rule (full, or latency: the heartbeats alone).

The fleet stands in for other hosts but shares this machine's CPUs (with mutual TLS it also does
every node's client side of TLS); --fleet-nice 10 runs it at a lower priority, so that it takes
the CPU the controller leaves.

After each step, --victims nodes stop (heartbeats and node manager) and the script times until
the controller declares each LOST, against the announced grace + 2 announced intervals +
re-check timeout.
Everything talks to 127.0.0.1.

    .venv/bin/python bench/controller_scale.py                           # 1000 .. 15000 nodes, both
    .venv/bin/python bench/controller_scale.py --steps 100,200 --window 5 --tls on
    .venv/bin/python bench/controller_scale.py --search 2000,10000 --victims 0   # mTLS vs plaintext, 10%
    .venv/bin/python bench/controller_scale.py --steps 1000 --tls off --deployments 100  # 100 x 10 instances vs 1 x
    1000
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time

import grpc
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import grpc_connection_memory  # noqa: E402
from bench.prometheus_scraper import PrometheusScraper  # noqa: E402
from bench.scale_cluster import Cluster  # noqa: E402
from bench.scale_cores import CORES, CpuSplit, ThreadCpu, handling_cpu  # noqa: E402
from bench.scale_fleet import (  # noqa: E402
    ENGINES_PER_NODE,
    FLEET,
    Fleet,
    deployments,
    gauge,
    histogram_quantile,
    loop_thread_schedstat,
    paged_nodes,
    scrape,
    time_node_loss,
)
from motor.v1 import controller_pb2 as C  # noqa: E402

# What a sustained step is held to. "full": the scale goal; "latency": the heartbeats alone, the
# measure of mutual TLS's cost (the largest fleet sustained at heartbeat p99 < 50 ms with mutual TLS
# on shrinks by at most 10%): what TLS costs in time, apart from what it costs in memory.
RULES = {
    "full": "heartbeat p99 < {p99:g} ms, failure reports p99 < {report_p99:g} ms (p95 under 200 reports, the "
    "longest under 40), CPU <= 1 core, CPU per heartbeat <= {beat_ms:.3f} ms (its core {headroom:.0%} busy at the "
    "heartbeat budget), CPU per failure report <= {report_ms:g} ms, event loop blocked p99 <= {blocked:g} ms, "
    "RSS less the controller's idle RSS <= {ratio:g} x what the step's "
    "connections add to a bare grpc.aio server, every /metrics scrape within its timeout",
    "latency": "heartbeat p99 < {p99:g} ms, 95% of the beats answered, none failed; CPU and RSS not counted",
}


def rule_text(rule: str, args) -> str:
    return RULES[rule].format(
        p99=args.p99_ms,
        report_p99=args.report_p99_ms,
        ratio=args.floor_ratio,
        beat_ms=beat_limit_ms(args),
        headroom=args.cpu_at_budget,
        report_ms=args.report_cpu_ms,
        blocked=args.blocked_p99_ms,
    )


def beat_limit_ms(args) -> float:
    """The CPU a heartbeat may cost: at the heartbeat budget (--max-heartbeats-per-second, the most a
    fleet of any size sends) the controller's core is at most --cpu-at-budget busy, so that the
    rest (reports, applies, scrapes, a burst of registrations) finds it free."""
    budget = args.max_heartbeats_per_second or 1000.0
    return args.cpu_at_budget / budget * 1e3


def owns_enough(split: CpuSplit, blocked_p99_s: float, args) -> bool:
    """What the controller owns, judged: its CPU per heartbeat and per failure report, and how long
    its own work held the event loop (not the waits for a CPU: those are the machine's)."""
    return (
        split.per_beat_ms <= beat_limit_ms(args)
        and not split.per_report_ms > args.report_cpu_ms
        and blocked_p99_s * 1e3 <= args.blocked_p99_ms
    )


def judged_reports(seen: dict) -> tuple[str, float]:
    """The figure of the window's failure reports a verdict rests on, and its name: a quantile
    only where at least two reports lie at or above it (the p99 from 200 reports, the p95 from
    40), else the longest."""
    n = seen["reports"]
    if n >= 200:
        return "p99", seen["report_p99_ms"]
    if n >= 40:
        return "p95", seen["report_p95_ms"]
    return "max", seen["report_max_ms"]


def step(
    size: int,
    stub,
    fleet: Fleet,
    proc: psutil.Process,
    metrics_port: int,
    scraper: PrometheusScraper,
    floor: grpc_connection_memory.Floor,
    args,
) -> tuple[dict[str, bool], str, float, float, float]:
    """Grow the fleet to `size`, measure a window: (sustained by each rule of RULES, the printed
    line, the answered rate, the announced interval and grace). `floor`: a bare grpc.aio
    server's RSS idle and per connection."""
    idle = proc.memory_info().rss / 2**20  # the controller serving, no node yet: its fixed part
    began = time.monotonic()
    fleet.ask(f"grow {size}")
    applying = time.monotonic()
    applied = deployments(size, args.deployments)
    for d in applied:  # one after another, as `motorctl apply -f A -f B ...`
        stub.ApplyDeployment(C.ApplyDeploymentRequest(deployment=d), timeout=300)
    apply_s = time.monotonic() - applying
    while fleet.ask("starts")["starts"] < size * ENGINES_PER_NODE and time.monotonic() - began < args.setup_timeout:
        time.sleep(0.5)
    set_up = time.monotonic()
    setup = set_up - began
    interval = gauge(metrics_port, "motor_controller_heartbeat_interval_seconds")
    grace = gauge(metrics_port, "motor_controller_node_grace_seconds")
    time.sleep(max(args.warmup, 2 * interval))  # every node beats at the announced interval by then
    window = max(args.window, 3 * interval)
    ingest_before = scrape(metrics_port, "motor_controller_heartbeat_ingest_seconds")
    lag_before = scrape(metrics_port, "motor_event_loop_lag_seconds")
    blocked_before = scrape(metrics_port, "motor_event_loop_blocked_seconds")
    gc_before = scrape(metrics_port, "motor_gc_pause_seconds")
    time.sleep(1)
    handling_before, threads_before = handling_cpu(metrics_port), ThreadCpu.read(proc)
    proc.cpu_percent(None)
    fleet.ps.cpu_percent(None)
    ran_before, waited_before = loop_thread_schedstat(proc.pid)
    window_began = time.monotonic()
    scraper.next_at(window_began + window / 2)  # the scrapes' phase: one in the middle of the window
    seen = fleet.ask(f"measure {window}")
    cpu, fleet_cpu = proc.cpu_percent(None), fleet.ps.cpu_percent(None)
    threads = ThreadCpu.read(proc) - threads_before
    handling_after = handling_cpu(metrics_port)
    handled = {k: handling_after.get(k, 0.0) - handling_before.get(k, 0.0) for k in handling_after}
    ran_after, waited_after = loop_thread_schedstat(proc.pid)
    measured = time.monotonic() - window_began
    loop_ran, loop_waited = (ran_after - ran_before) / measured, (waited_after - waited_before) / measured
    rss = proc.memory_info().rss / 2**20
    window_ended = time.monotonic()
    while not scraper.within(window_began, window_ended) and scraper.is_alive():
        time.sleep(0.1)  # the window's own scrape has not answered yet
    ingest_p99 = histogram_quantile(
        ingest_before, scrape(metrics_port, "motor_controller_heartbeat_ingest_seconds"), 0.99
    )
    lag_after = scrape(metrics_port, "motor_event_loop_lag_seconds")
    lag_p99, lag_max = histogram_quantile(lag_before, lag_after, 0.99), histogram_quantile(lag_before, lag_after, 1.0)
    blocked_p99 = histogram_quantile(blocked_before, scrape(metrics_port, "motor_event_loop_blocked_seconds"), 0.99)
    gc_after = scrape(metrics_port, "motor_gc_pause_seconds")
    gc_p50, gc_max = histogram_quantile(gc_before, gc_after, 0.5), histogram_quantile(gc_before, gc_after, 1.0)
    ready = sum(1 for _ in paged_nodes(stub, "state=READY"))
    expected = size / interval
    heard = seen["p99_ms"] < args.p99_ms and seen["rate"] >= 0.95 * expected and seen["errors"] == 0
    scrapes = scraper.within(set_up, time.monotonic())
    scraped = bool(scrapes) and not any(s.error for s in scrapes)
    judged, report_ms = judged_reports(seen)
    reported = seen["report_errors"] == 0 and seen["reports"] > 0 and report_ms < args.report_p99_ms
    # What the fleet adds: to the controller, and to a bare grpc.aio server with as many connections.
    fleet_mib, connections_mib = rss - idle, floor.at(size) - floor.idle_mib
    split = CpuSplit.of(threads, seen["rate"] * measured, seen["reports"], handled, handled.get("gc", 0.0))
    owned = owns_enough(split, blocked_p99, args)
    ok = {
        "full": heard
        and reported
        and cpu <= 100
        and owned
        and fleet_mib <= args.floor_ratio * connections_mib
        and scraped,
        "latency": heard,
    }
    per_beat_ms = split.per_beat_ms
    line = (
        f"{size:>6} nodes {size * ENGINES_PER_NODE:>6} engines | {len(applied)} deployment(s) applied in {apply_s:.2f}s"
        f" | setup {setup:5.1f}s"
        f" | interval {interval:g}s grace {grace:g}s (fleet heard {seen['interval_s']:g}s) | window {window:g}s"
        f" | heartbeats {seen['rate']:7.1f}/s of {expected:.0f}/s ({seen['errors']} failed, {seen['delta_beats']} "
        "deltas"
        f" carrying {seen['delta_engines']} engines, {seen['full_beats']} full)"
        f" | round trip p50 {seen['p50_ms']:6.2f} ms p99 {seen['p99_ms']:7.2f} ms"
        f" | failure reports n={seen['reports']} ({seen['report_errors']} failed) p50 {seen['report_p50_ms']:5.2f} ms"
        f" p99 {seen['report_p99_ms']:6.2f} ms max {seen['report_max_ms']:6.2f} ms (judged: the {judged} of "
        f"{seen['reports']} against {args.report_p99_ms:g} ms)"
        f" | controller CPU {cpu:5.1f}% ({per_beat_ms:.3f} ms per beat) RSS {rss:6.1f} MiB = idle {idle:.1f} + "
        f"{fleet_mib:.1f} for the fleet ({fleet_mib / connections_mib:.2f} x the {connections_mib:.0f} MiB "
        f"{size} connections add to a bare grpc.aio server; judged <= {args.floor_ratio:g} x)"
        f" handling p99 <= {ingest_p99 * 1e3:g} ms loop lag p99 <= "
        f"{lag_p99 * 1e3:g} ms max <= {lag_max * 1e3:g} ms"
        f" (blocked <= {blocked_p99 * 1e3:g} ms; garbage collections p50 <= {gc_p50 * 1e3:g} ms max <= "
        f"{gc_max * 1e3:g} ms)"
        f" loop thread ran {loop_ran:.0%} waited for a CPU {loop_waited:.0%}"
        f" | {scraper.summary(set_up, time.monotonic())}"
        f" (in the window: {', '.join(f'{s.seconds:.2f}s' for s in scraper.within(window_began, window_ended))};"
        f" during the set-up: {scraper.summary(0.0, set_up)})"
        f" | {split.text()} (judged: per beat <= {beat_limit_ms(args):.3f} ms, per report <= "
        f"{args.report_cpu_ms:g} ms, loop blocked p99 <= {args.blocked_p99_ms:g} ms: {'yes' if owned else 'NO'})"
        f" | fleet CPU {fleet_cpu:5.1f}% | READY {ready}/{size} | load {os.getloadavg()[0]:.1f}"
        f" | {'sustained' if ok['full'] else 'NOT sustained' + (' (heartbeats alone: sustained)' if heard else '')}"
    )
    return ok, line, seen["rate"], interval, grace


def trial(args, size: int, tls: bool) -> tuple[dict[str, bool], float]:
    """One step on a fresh cluster for each of --cores (the first judged, the others printed), then
    its node loss timed: (sustained by each rule, share of the heartbeats asked for answered)."""
    judged = None
    for cores in args.cores:
        # The other loops of --event-loops: on the judged placement only, to compare like with like.
        for loop in args.event_loops if judged is None else args.event_loops[:1]:
            outcome = placed_trial(args, size, tls, cores, judged is None, loop)
            judged = judged or outcome
    return judged


def placed_trial(args, size: int, tls: bool, cores: str, judging: bool, loop: str) -> tuple[dict[str, bool], float]:
    with Cluster(args, tls, cores, loop) as cluster:
        if size == args.steps[0]:
            print(f"{'mutual TLS' if tls else 'plaintext'}: controller", " ".join(cluster.command[1:]), flush=True)
        try:
            floor = args.floor[tls if args.floor_mode == "same" else True]
            ok, line, rate, interval, grace = step(
                size, cluster.stub, cluster.fleet, cluster.proc, cluster.metrics_port, cluster.scraper, floor, args
            )
            mode = ("mTLS  " if tls else "plain ") + ("own core  " if cores == "own" else "shared    ")
            mode += f"{loop:<8}"
            why_not = "shared cores" if cores != args.cores[0] else f"--event-loop {loop}"
            print(mode + line + ("" if judging else f" ({why_not}: printed, not judged)"), flush=True)
            if args.victims and judging:
                print(
                    f"{mode}{size:>6} nodes | " + time_node_loss(cluster.stub, cluster.fleet, grace, interval, 1.0),
                    flush=True,
                )
            return ok, rate * interval / size
        except grpc.RpcError as exc:
            state = "alive" if cluster.controller.poll() is None else f"exited with {cluster.controller.returncode}"
            print(f"a controller call failed ({exc.code().name}: {exc.details()}); controller {state}", flush=True)
            return dict.fromkeys(RULES, False), 0.0


def search(args, modes: list[bool]) -> dict[bool, int]:
    """The largest size each mode sustains in [LO, HI), by bisection (geometric, two digits)
    until the bounds are within --precision of each other; the modes take turns at each round, so
    that both see the machine of the same minutes. 0: LO itself was not sustained."""
    low, high = args.search
    bounds = {tls: [low, high] for tls in modes}
    best = {tls: 0 for tls in modes}
    size = {tls: low for tls in modes}
    while size:
        for tls in list(size):
            if trial(args, size[tls], tls)[0][args.rule]:
                best[tls] = bounds[tls][0] = size[tls]
            elif size[tls] == low:
                del size[tls]  # LO not sustained: nothing to search
                continue
            else:
                bounds[tls][1] = size[tls]
            below, above = bounds[tls]
            unit = 10 ** max(0, len(str(below)) - 2)  # two significant digits: 2,400, not 2,449
            middle = round(math.sqrt(below * above) / unit) * unit
            if above / below <= 1 + args.precision or middle in (below, above):
                del size[tls]
            else:
                size[tls] = middle
    return best


def run(args) -> int:
    started_at = time.monotonic()
    print(f"the bare-grpcio floor, {args.floor_connections} connections (bench/grpc_connection_memory.py):", flush=True)
    args.floor = grpc_connection_memory.both_modes(args.floor_connections, args.floor_settle)
    held_to = "its own mode's" if args.floor_mode == "same" else "mutual TLS's"
    plain, tls = args.floor[False], args.floor[True]
    print(
        f"RSS bound of a step: the controller's RSS less its own idle RSS (read before any node connects) <= "
        f"{args.floor_ratio:g} x what the step's connections add to a bare grpc.aio server, at {held_to} cost "
        f"(plaintext {plain.per_connection_kib:.1f} KiB per connection over {plain.idle_mib:.1f} MiB idle, "
        f"mutual TLS {tls.per_connection_kib:.1f} KiB over {tls.idle_mib:.1f} MiB)",
        flush=True,
    )
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.tls]
    connections = f"{args.conns} shared connections" if args.conns else "one connection per node"
    print(
        f"fleet: {FLEET} (separate process), transport {args.transport}, {connections} (mutual TLS: always one per "
        f"node), {args.reports_per_s:g} engine failures reported/s; every step on a fresh controller and fleet, "
        "plaintext then mutual TLS at each size",
        flush=True,
    )
    best = {rule: {tls: 0 for tls in modes} for rule in RULES}
    going = list(modes) if not args.search else []
    for size in args.steps if not args.search else []:
        for tls in list(going):
            ok, share = trial(args, size, tls)
            for rule in RULES:
                if ok[rule]:
                    best[rule][tls] = size
            if share < 0.5:
                going.remove(tls)  # collapsed (under half the beats asked for): larger fleets cannot do better
    rules = [args.rule] if args.search else RULES
    if args.search:
        best[args.rule] = search(args, modes)
    print()
    for rule in rules:
        for tls in modes:
            what = "mutual TLS" if tls else "plaintext "
            text = rule_text(rule, args)
            print(
                f"{what}: largest fleet sustained ({text}): "
                f"{best[rule][tls]} nodes x {ENGINES_PER_NODE} engines ({best[rule][tls] * ENGINES_PER_NODE} engines); "
                "goal 10000 x 8"
            )
    if len(modes) == 2:
        how = (
            f"searched in [{args.search[0]}, {args.search[1]}) to within {args.precision:.0%}"
            if args.search
            else f"steps {args.steps}"
        )
        for rule in rules:
            plain, tls = best[rule][False], best[rule][True]
            ratio = f"{tls / plain:.2f}" if plain else "undefined (no plaintext step sustained)"
            text = rule_text(rule, args)
            print(f"mutual TLS / plaintext, largest fleet sustained ({text}): {ratio} (goal: at least 0.90; {how})")
    print(f"heartbeat budget: --max-heartbeats-per-second {args.max_heartbeats_per_second:g}")
    placed = (
        "the controller on a core of its own, the fleet and this script on the others"
        if args.cores[0] == "own"
        else "controller and fleet share them"
    )
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; judged: {placed}")
    print(f"run time {time.monotonic() - started_at:.0f}s")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="1000,2500,5000,7500,10000,12500,15000", help="fleet sizes to try, in order")
    parser.add_argument(
        "--window", type=float, default=10.0, help="seconds measured per step (at least 3 announced intervals)"
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=3.0,
        help="seconds between a step's set-up and its window (at least 2 announced intervals)",
    )
    parser.add_argument(
        "--max-heartbeats-per-second",
        type=float,
        default=2000.0,
        help="the controller's heartbeat rate budget (its default); 0: 1 Hz at every size",
    )
    parser.add_argument("--p99-ms", type=float, default=50.0, help="heartbeat p99 a sustained step stays under")
    parser.add_argument(
        "--report-p99-ms",
        type=float,
        default=10.0,
        help="failure reports' p99 a sustained step stays under (their p95 under 200 reports, the longest under 40)",
    )
    parser.add_argument(
        "--tls",
        choices=["off", "on", "both"],
        default="both",
        help="plaintext, mutual TLS (a certificate per node), or both ladders one after the other",
    )
    parser.add_argument("--transport", choices=["stream", "unary"], default="stream", help="how the fleet heartbeats")
    parser.add_argument(
        "--reports-per-s",
        type=float,
        default=20.0,
        help="engine failures the fleet reports per second (20: 200 in a 10 s window, enough for a p99)",
    )
    parser.add_argument("--victims", type=int, default=3, help="nodes silenced at the end to time their loss (0: none)")
    parser.add_argument(
        "--fleet-nice",
        type=int,
        default=0,
        help="run the fleet at this niceness (it stands in for other hosts; 10: it yields the CPU)",
    )
    parser.add_argument(
        "--conns",
        type=int,
        default=0,
        help="plaintext: connections the fleet shares between its nodes (0: one per node, as with TLS)",
    )
    parser.add_argument(
        "--setup-timeout", type=float, default=600.0, help="seconds a step may take to start its engines"
    )
    parser.add_argument(
        "--deployments",
        type=int,
        default=1,
        help="split each step's instances over this many named deployments, applied one after another "
        "(the per-deployment cost: compare with 1 at the same size)",
    )
    parser.add_argument(
        "--cores",
        default="own,shared",
        help="where each step runs, in turn: own (the controller on a core of its own, all else on the others; "
        "judged) and shared (every process on every CPU; printed as a second line, not judged): the first listed "
        "is judged",
    )
    parser.add_argument(
        "--event-loops",
        default="uvloop",
        help="the controller's --event-loop at each step, in turn: the first is judged, the others (e.g. "
        "uvloop,asyncio) run on the judged placement and are printed beside it",
    )
    parser.add_argument(
        "--cpu-at-budget",
        type=float,
        default=0.8,
        help="a sustained step's CPU per heartbeat keeps the controller's core at most this busy at the heartbeat "
        "budget (0.8 at 2000/s: 0.4 ms a beat)",
    )
    parser.add_argument(
        "--report-cpu-ms",
        type=float,
        default=2.0,
        help="Motor's handling of one failure report, at most (CPU): a rack of 40 nodes failing at once (320 "
        "engine reports) then holds the loop under 0.7 s",
    )
    parser.add_argument(
        "--blocked-p99-ms",
        type=float,
        default=25.0,
        help="the event loop held by the controller's own work (not waiting for a CPU), p99 at most",
    )
    parser.add_argument("--keep", action="store_true", help="keep the controller's log and database")
    parser.add_argument("--node-grace", type=float, default=5.0, help="controller --node-grace")
    parser.add_argument(
        "--search",
        metavar="LO,HI",
        help="instead of --steps: bisect the largest size sustained in [LO, HI) for each mode, the modes taking turns",
    )
    parser.add_argument("--precision", type=float, default=0.1, help="--search stops when HI/LO is within this")
    parser.add_argument(
        "--rule",
        choices=list(RULES),
        default="full",
        help="what --search holds a sustained step to (--steps print both)",
    )
    parser.add_argument("--scrape-interval", type=float, default=15.0, help="seconds between /metrics scrapes")
    parser.add_argument(
        "--floor-ratio",
        type=float,
        default=1.3,
        help="a sustained step's RSS less the controller's idle RSS is at most this times what its connections "
        "add to a bare grpc.aio server",
    )
    parser.add_argument(
        "--floor-mode",
        choices=["tls", "same"],
        default="tls",
        help="hold both modes to the mutual-TLS floor, or each mode to its own",
    )
    parser.add_argument(
        "--floor-connections",
        type=int,
        default=2000,
        help="connections the floor is measured with (bench/grpc_connection_memory.py --connections)",
    )
    parser.add_argument("--floor-settle", type=float, default=10.0, help="bench/grpc_connection_memory.py --settle")
    args = parser.parse_args()
    args.steps = [int(s) for s in args.steps.split(",")]
    args.cores = args.cores.split(",")
    if not args.cores or any(c not in CORES for c in args.cores) or len(set(args.cores)) != len(args.cores):
        parser.error(f"--cores: a comma-separated list of {', '.join(CORES)}")
    args.event_loops = args.event_loops.split(",")
    if not args.event_loops or any(e not in ("uvloop", "asyncio") for e in args.event_loops):
        parser.error("--event-loops: a comma-separated list of uvloop, asyncio")
    if args.search:
        args.search = [int(s) for s in args.search.split(",")]
        if len(args.search) != 2 or not 0 < args.search[0] < args.search[1]:
            parser.error("--search: LO,HI with 0 < LO < HI")
        args.steps = args.search  # the first size prints the command line; the largest sizes the stream limit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the controller and the fleet on the way out
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
