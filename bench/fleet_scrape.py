"""The size and render time of the controller's /metrics at fleet scale, in-process.

Fills a controller's tables (controller.state.ClusterState, no real nodes) with --nodes READY
nodes, each running one READY instance of --dp NORMAL engines, all heard from just now, and
renders what the controller's /metrics serves: its registry (controller.metrics.ControllerMetrics
with the counts the controller reads, prometheus_client's text) and its fleet aggregates
(controller.fleet_metrics). --unready nodes are made SUSPECT and as many instances DEGRADED, so
that their lines are there too. Prints, per render, its size and the time it took (the median and
the longest of --renders); the first render is counted apart.

    .venv/bin/python bench/fleet_scrape.py                      # 10,000 nodes x 8 engines
    .venv/bin/python bench/fleet_scrape.py --nodes 1000 --renders 20
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prometheus_client import generate_latest  # noqa: E402

from controller.core import revision_counts  # noqa: E402
from controller.fleet.series import FleetSeries  # noqa: E402
from controller.metrics import ControllerMetrics  # noqa: E402
from controller.model.cluster import ClusterState  # noqa: E402
from controller.model.events import EventBus  # noqa: E402
from controller.model.instances import READY, InstanceRecord  # noqa: E402
from controller.model.nodes import NODE_READY, NODE_SUSPECT, NodeRuntime  # noqa: E402
from controller.model.slots import EngineSlot  # noqa: E402
from motor.clock import SYSTEM_CLOCK  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402
from motor.v1 import types_pb2 as T  # noqa: E402


def fill(nodes: int, ranks: int, unready: int) -> ClusterState:
    state = ClusterState(None, EventBus(), SYSTEM_CLOCK)
    now = time.time()
    for n in range(nodes):
        node_id, instance_id = f"node-{n:05d}", f"u-{n:05d}"
        state.nodes.put(NodeRuntime(C.NodeInfo(node_id=node_id), 1, NODE_READY, "", time.monotonic(), now))
        state.instances[instance_id] = InstanceRecord(instance_id, "u", T.ROLE_UNION, ranks, 1, False, "", "", READY)
        for rank in range(ranks):
            state.slots.add(
                EngineSlot(
                    f"{instance_id}/rank{rank}",
                    instance_id,
                    rank,
                    node_id,
                    generation=1,
                    state=T.ENGINE_STATE_RUNNING,
                    health=T.HEALTH_STATUS_NORMAL,
                )
            )
    for n in range(unready):
        state.nodes.set_state(state.nodes[f"node-{n:05d}"], NODE_SUSPECT, "silent")
        inst = state.instances[f"u-{n:05d}"]
        inst.state, inst.state_changed_at = C.INSTANCE_STATE_DEGRADED, now
    return state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--dp", type=int, default=8, help="engines per node (one instance of this many ranks)")
    parser.add_argument("--unready", type=int, default=10, help="nodes SUSPECT and instances DEGRADED")
    parser.add_argument("--renders", type=int, default=10)
    args = parser.parse_args()
    began = time.monotonic()
    state = fill(args.nodes, args.dp, args.unready)
    print(
        f"{args.nodes} nodes x {args.dp} engines ({args.nodes * args.dp} engines), {args.unready} not ready: "
        f"tables filled in {time.monotonic() - began:.1f} s, Python {sys.version.split()[0]}",
        flush=True,
    )
    st = state
    metrics = ControllerMetrics(  # the counts controller.core.Controller passes
        st.nodes.counts,
        lambda: collections.Counter(i.state for i in st.instances.values()),
        (),
        lambda: revision_counts(st),
    )
    series = FleetSeries(state, lambda: "")

    def render() -> tuple[int, float, float]:
        """Size, wall time and CPU time of the thread (the wall time includes waits for a CPU)."""
        started, cpu = time.perf_counter(), time.thread_time()
        body = generate_latest(metrics.registry) + series.text().encode()
        return len(body), time.perf_counter() - started, time.thread_time() - cpu

    first_size, first_s, _ = render()
    runs = [render() for _ in range(args.renders)]
    sizes, times, cpus = [r[0] for r in runs], [r[1] for r in runs], [r[2] for r in runs]
    print(f"first render: {first_size / 1024:.1f} KiB in {first_s * 1e3:.1f} ms")
    print(
        f"/metrics: {max(sizes) / 1024:.1f} KiB of text, rendered in {statistics.median(times) * 1e3:.1f} ms "
        f"(median of {len(times)}, longest {max(times) * 1e3:.1f} ms; CPU median {statistics.median(cpus) * 1e3:.1f} "
        f"ms); goal under 1 MiB and 50 ms | load {os.getloadavg()[0]:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
