"""One row of the chaos table: wait for a whole cluster, inject a fault, wait for the cluster to
be whole again, measure, record the row, then assert it (goal: all zeros, recovered within a
generous hang bound). Waits are conditions polled, never fixed sleeps; the recovery time is
measured and recorded, never asserted."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from motor.v1 import controller_pb2 as C
from tests.support.background import EveryInterval
from tests.support.chaos_cluster import BASELINE_ENGINES, BASELINE_INSTANCES, ChaosCluster, deployment
from tests.support.chaos_table import Row, record
from tests.support.process_cluster import apply

# Hang bounds (2 shared cores): a cluster not whole again within this is a failed row.
RECOVERY_BOUND = 120.0
SETTLE_BOUND = 90.0
# Whole counts once it is still whole this much later (a few heartbeats).
STAYS_WHOLE_FOR = 1.5


class DuplicateWatch(EveryInterval):
    """Samples the machine's engine processes in the background while a row runs, keeping when
    each (instance, rank) was seen with more than one live process."""

    def __init__(self, cluster: ChaosCluster, interval: float = 0.2):
        super().__init__(interval, name="duplicate-watch")
        self.cluster = cluster
        self.seen: list[tuple[float, set[tuple[str, int]]]] = []

    def step(self) -> None:
        sampled_at = time.monotonic()
        twice = {key for key, pids in self.cluster.engine_processes().items() if len(pids) > 1}
        if twice:
            self.seen.append((sampled_at, twice))

    def twice(self, since: float = 0.0, until: float = float("inf")) -> set[tuple[str, int]]:
        return set().union(*(keys for at, keys in self.seen if since <= at < until))


@dataclass
class Fault:
    """What a row does. `inject` returns the monotonic time the fault ended (the kill, the
    SIGCONT, the space freed) and may add to `notes`; `justified` names the instances whose
    engines the fault may replace (the victim's instance, those of a node declared lost)."""

    name: str
    inject: Callable[[Fault], float]
    justified: set[str] = field(default_factory=set)
    # Copies running twice while the fault lasts are by design (a paused node's engines moved
    # elsewhere); only copies seen twice after the fault ended count.
    stale_copies_expected: bool = False
    # Set by inject when it needs the replacement of a justified instance (SIGKILL, hang).
    must_replace: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)


def problems_now(cluster: ChaosCluster, fault: Fault | None, before: dict | None) -> list[str]:
    """Why the cluster is not whole (and which engine the fault must replace was not replaced)."""
    try:
        problems = cluster.problems()
        if fault is not None and before is not None:
            running = cluster.engine_processes()
            problems += [
                f"{i}/rank{r} not replaced yet"
                for i, r in BASELINE_ENGINES
                if i in fault.must_replace and running.get((i, r)) == [before.get((i, r))]
            ]
        return problems
    except Exception as exc:  # a controller paused or restarting does not answer yet
        return [f"{type(exc).__name__}: {str(exc)[:200]}"]


def wait_whole(
    cluster: ChaosCluster, timeout: float, fault: Fault | None = None, before: dict | None = None
) -> tuple[float | None, list[str]]:
    """Polls until the cluster is whole (and every engine the fault must replace was replaced),
    and still is, with the same engine processes, STAYS_WHOLE_FOR later (a few heartbeats: what
    one look saw was not a moment between two reports). Returns (the monotonic time the lasting
    whole state began, []) or (None, the problems). A whole state that did not last is noted."""
    deadline = time.monotonic() + timeout
    problems: list[str] = ["not checked yet"]
    while time.monotonic() < deadline:
        problems = problems_now(cluster, fault, before)
        if not problems:
            whole_at, processes = time.monotonic(), cluster.engine_processes()
            time.sleep(STAYS_WHOLE_FOR)
            problems = problems_now(cluster, fault, before)
            if not problems and cluster.engine_processes() == processes:
                return whole_at, []
            if fault is not None:
                fault.notes.append(f"looked whole, then not {STAYS_WHOLE_FOR:g}s later: {'; '.join(problems)[:200]}")
            continue
        time.sleep(0.2)
    return None, problems


def repair(cluster: ChaosCluster) -> None:
    """After a failed row: everything resumed, every process restarted, the baseline applied again."""
    for managed in cluster.processes:
        try:
            os.killpg(managed.process.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    if cluster.process("controller").process.poll() is not None:
        cluster.start_controller()
    for index, node_id in enumerate(cluster.node_ids()):
        if cluster.process(node_id).process.poll() is not None:
            cluster.start_node(node_id, index)
    try:
        apply(cluster, deployment())
    except Exception:  # noqa: BLE001 (a best effort; the next row's own wait says what is wrong)
        pass


def run_row(cluster: ChaosCluster, fault: Fault) -> Row:
    """Runs `fault` on a whole cluster, records its row and asserts it."""
    settled, problems = wait_whole(cluster, SETTLE_BOUND)
    assert settled, f"{fault.name}: the cluster was not whole before the fault: {problems}"
    before = {k: pids[0] for k, pids in cluster.engine_processes().items()}
    row = Row(fault.name, 0, 0, 0, 0, None)
    try:
        with DuplicateWatch(cluster) as watch:
            ended_at = fault.inject(fault)
            recovered_at, problems = wait_whole(cluster, RECOVERY_BOUND, fault, before)
        after = {k: pids for k, pids in cluster.engine_processes().items()}
        replaced = {k for k in BASELINE_ENGINES if after.get(k) != [before.get(k)]}
        row.false_kills = len({k for k in replaced if k[0] not in fault.justified})
        unreplaced = {i for i in fault.must_replace if not any(k[0] == i for k in replaced)}
        instances = cluster.instances()
        row.instances_lost = sum(
            1 for i in BASELINE_INSTANCES if i not in instances or instances[i].state != C.INSTANCE_STATE_READY
        )
        # Stale copies of a paused node moved elsewhere run twice until it is back and fenced.
        counted_from = recovered_at if fault.stale_copies_expected and recovered_at else 0.0
        row.running_twice = len(watch.twice(since=counted_from))
        row.orphans = len(cluster.orphans())
        row.recovery_s = None if recovered_at is None else max(0.0, recovered_at - ended_at)
        if fault.stale_copies_expected:
            fault.notes.append(f"{len(watch.twice(until=counted_from))} ran twice while paused (stale copies, fenced)")
        if replaced:
            fault.notes.append("replaced: " + ", ".join(f"{i}/rank{r}" for i, r in sorted(replaced)))
        row.note = "; ".join(fault.notes)
    except BaseException as exc:
        row.note = "; ".join(fault.notes + [f"failed: {type(exc).__name__}: {str(exc)[:160]}"])
        record(row)
        repair(cluster)
        raise
    record(row)
    if not row.zeros() or recovered_at is None or unreplaced:
        repair(cluster)
    assert recovered_at is not None, f"{fault.name}: not whole again within {RECOVERY_BOUND:.0f}s: {problems}"
    assert row.zeros(), f"{fault.name}: {row}"
    assert not unreplaced, f"{fault.name}: the fault needed {sorted(unreplaced)} replaced; it was not"
    return row
