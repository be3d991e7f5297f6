"""How fast a router learns that an engine died: SIGKILL of an engine server -> its endpoint
removed on the controller's WatchEndpoints stream, against polling ListEndpoints every second
(what a router had to do before the stream), in one run.

A real local cluster (`motorctl up`'s LocalCluster: a controller, one node manager, sim engine
servers). Each round SIGKILLs the engine server of one listed endpoint, times the removal as the
stream reports it and as a 1 s ListEndpoints poller sees it, then waits until the controller has
restarted the engine and the stream lists it again. Prints median, p99 and max of both, their
ratio, and how many outages the poller never saw (an engine's first restart is immediate: a sim
engine can be back before the next poll). Goal: stream p99 < 50 ms.

    .venv/bin/python bench/endpoint_removal.py [--kills 30] [--engines 4]
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

import grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from motor.contract.deployment_file import deployment_from_dict  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402
from motor.v1 import controller_pb2_grpc  # noqa: E402
from motorctl.local_cluster import LocalCluster  # noqa: E402

POLL_INTERVAL = 1.0
RESTART_BACKOFF = 1.5 * POLL_INTERVAL


def pct(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with q% of the values at or below it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


class StreamRecorder:
    """Reads WatchEndpoints in a thread: when each engine was last removed and added."""

    def __init__(self, stub):
        self.removed: dict[str, float] = {}
        self.added: dict[str, float] = {}
        self.listed: set[str] = set()
        self.lock = threading.Lock()
        self._call = stub.WatchEndpoints(C.WatchEndpointsRequest())
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for message in self._call:
                now = time.monotonic()
                with self.lock:
                    for e in message.removed:
                        self.removed[e.engine_id] = now
                        self.listed.discard(e.engine_id)
                    for e in message.added:
                        self.added[e.engine_id] = now
                        self.listed.add(e.engine_id)
        except grpc.RpcError:
            pass

    def cancel(self) -> None:
        self._call.cancel()


class Poller:
    """ListEndpoints every POLL_INTERVAL: when each engine was first seen missing."""

    def __init__(self, stub, watched: set[str]):
        self.stub, self.watched = stub, set(watched)
        self.missing_since: dict[str, float] = {}
        self.polls_done = 0  # polls whose answer has been taken in
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop.wait(POLL_INTERVAL):
            listed = {e.engine_id for e in self.stub.ListEndpoints(C.ListEndpointsRequest(), timeout=5).endpoints}
            now = time.monotonic()
            for engine_id in list(self.missing_since):
                if engine_id in listed:
                    del self.missing_since[engine_id]
            for engine_id in self.watched - listed:
                self.missing_since.setdefault(engine_id, now)
            self.polls_done += 1


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    raise TimeoutError(f"{what} within {timeout:g}s")


def engine_pids(stub) -> dict[str, int]:
    nodes = stub.ListNodes(C.ListNodesRequest(), timeout=5).nodes
    return {e.engine_id: e.pid for n in nodes for e in n.engines if e.pid}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--engines", type=int, default=4)
    args = parser.parse_args()
    run_dir = tempfile.mkdtemp(prefix="motor-endpoint-bench-")
    cluster = LocalCluster(run_dir, nodes=1, heartbeat_interval=0.5, node_grace=5.0, engine_port_base=23000)
    cluster.start()
    channel = grpc.insecure_channel(cluster.controller_address)
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    section = {
        "engine_type": "sim",
        "engine_args": {"model": "sim-tiny"},
        "health_check_config": {"enable_virtual_inference": False},
    }
    deployment = deployment_from_dict({
        "name": "bench", "model": "sim-tiny", "engine_config": {"motor_engine_union_config": section},
        "instance_groups": [{"name": "u", "role": "union", "count": args.engines}],
        # Restarted after a pause longer than the poll interval: a sim engine is back within a
        # second, and a shorter outage would slip between two polls unseen.
        "restart_policy": {"initial_backoff": f"{RESTART_BACKOFF}s", "max_backoff": f"{RESTART_BACKOFF}s",
                           "max_failures": 100000},
    })  # fmt: skip
    stream_ms: list[float] = []
    poll_ms: list[float] = []
    killed_pids: set[int | None] = {None}
    poll_missed = 0
    try:
        stub.ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment), timeout=10)
        stream = StreamRecorder(stub)
        wait(lambda: len(stream.listed) == args.engines, 120, f"{args.engines} endpoints listed")
        poller = Poller(stub, stream.listed)
        for round_ in range(args.kills):
            engine_id = sorted(stream.listed)[round_ % args.engines]
            # The node's report may still carry the copy killed before: wait for the new one.
            pid = wait(
                lambda: (p := engine_pids(stub).get(engine_id)) not in killed_pids and p, 30, "the new copy's pid"
            )
            killed_pids.add(pid)
            time.sleep(POLL_INTERVAL * (round_ % 7) / 7)  # kills at every phase of the poller
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            removed = wait(lambda: (t := stream.removed.get(engine_id, 0)) > killed and t, 10, f"{engine_id} removed")
            stream_ms.append((removed - killed) * 1000)
            seen = lambda: (t := poller.missing_since.get(engine_id, 0)) > killed and t  # noqa: E731
            back = lambda: (t := stream.added.get(engine_id, 0)) > removed and t  # noqa: E731
            wait(lambda: seen() or back(), 60, "the poller to see it or the engine to be listed again")
            if not seen():
                # Listed again before the poller saw it gone? Let a poll begun after that answer.
                polls = poller.polls_done
                wait(lambda: poller.polls_done >= polls + 2 or seen(), 10, "two more polls")
            if seen():
                poll_ms.append((seen() - killed) * 1000)
            else:
                poll_missed += 1  # the outage fell between two polls: a polling router never knew
            wait(back, 60, f"{engine_id} listed again")
            wait(lambda: engine_id not in poller.missing_since, 10, "the poller to list it again")
        stream.cancel()
        poller.stop.set()
    finally:
        channel.close()
        cluster.stop()
    print(
        f"SIGKILL of an engine server -> endpoint removed, {args.kills} kills, {args.engines} sim engines, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'':28}{'median ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for name, values in (("WatchEndpoints stream", stream_ms), (f"ListEndpoints every {POLL_INTERVAL:g}s", poll_ms)):
        print(
            f"{name:28}{statistics.median(values):10.1f}{pct(values, 90):10.1f}{pct(values, 99):10.1f}"
            f"{max(values):10.1f}"
        )
    print(f"outages the poller never saw (restarted between two polls): {poll_missed} of {args.kills}")
    print(
        f"ratio poll/stream (median): {statistics.median(poll_ms) / statistics.median(stream_ms):.1f}x; "
        f"goal stream p99 < 50 ms: {'met' if pct(stream_ms, 99) < 50 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
