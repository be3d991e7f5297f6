"""What the controller holds per engine: tracked GC objects, bytes, and the time of one complete
garbage walk, in-process (no gRPC, no node manager processes).

A real `controller.core.Controller` on a temporary SQLite file: --nodes nodes of --accelerators
accelerators register (as node managers do, reporting no engine), the deployment of
tests/support/big_fleet.py is applied (--instances x --dp), the reconcile pass places and starts
everything through a node client that answers StartEngine the way the simulated fleet
(bench/fleet/nodemanager.go) does (the spec it was sent, ports filled in, RUNNING, NORMAL), and
every node then sends --beats full heartbeats listing its engines, each parsed from the bytes a
HeartbeatRequest is on the wire (as the servicer receives them). One scrape of the fleet series
(/metrics) and one ListNodes are rendered, as a running controller serves them.

It prints, against a baseline taken before the controller was made: tracked GC objects per
engine (len(gc.get_objects())), the types that grew most, bytes per engine (RSS after glibc's
malloc_trim, so that it counts what is held rather than the peak; with --tracemalloc also the
Python allocator's share: slow), the time Controller.heartbeat takes per engine in a full
heartbeat of engines reported unchanged (the steady state of unary heartbeats), and one
complete collection (gc.collect() after gc.unfreeze(), as controller/gc_tuning.py's complete walk:
every tracked object of the process), median of --walks. --config-bytes grows the deployment's
engine config (a real one is often kilobytes; every engine's spec carries it).

    .venv/bin/python bench/controller_memory.py --nodes 10000 --instances 10000 --dp 8   # 10,000 x 8
    .venv/bin/python bench/controller_memory.py --nodes 5000 --instances 10000 --dp 4    # 10,000 x dp 4
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import gc
import itertools
import os
import statistics
import sys
import tempfile
import time
import tracemalloc

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from controller.config import ControllerConfig  # noqa: E402
from controller.core import Controller  # noqa: E402
from controller.engines.node_client import NodeClient  # noqa: E402
from controller.store.sqlite import SqliteStore  # noqa: E402
from motor.contract import names  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402
from motor.v1 import types_pb2 as T  # noqa: E402
from tests.support.big_fleet import deployment  # noqa: E402

try:
    LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    LIBC = None


class SimulatedNodes(NodeClient):
    """StartEngine as bench/fleet/nodemanager.go answers it; the engines each node runs."""

    def __init__(self) -> None:
        # node id -> engine id -> the engine as it crosses the wire: bytes, neither tracked by
        # the garbage collector nor counted among the controller's objects.
        self.engines: dict[str, dict[str, bytes]] = collections.defaultdict(dict)
        self._ports = itertools.count(0)
        self._pids = itertools.count(100_001)

    async def start_engine(self, node, spec):
        spec = T.EngineSpec.FromString(spec.SerializeToString())  # what crossed the wire
        spec.port = 20000 + 2 * (next(self._ports) % 4000)
        spec.mgmt_port = spec.port + 1
        engine = T.Engine(
            engine_id=names.engine_id(spec.instance_id, spec.dp_rank),
            spec=spec,
            state=T.ENGINE_STATE_RUNNING,
            health=T.HEALTH_STATUS_NORMAL,
            health_reason="sim",
            pid=next(self._pids),
            node_id=node.node_id,
        )
        self.engines[node.node_id][engine.engine_id] = wire = engine.SerializeToString()
        return T.Engine.FromString(wire)

    async def stop_engine(self, node, engine_id, generation, deadline):
        pass

    async def list_engines(self, node, timeout):
        raise AssertionError("no node is re-checked here")

    async def close(self):
        pass


def snapshot() -> tuple[int, collections.Counter, int]:
    gc.collect()
    if LIBC is not None:  # freed memory back to the system: RSS then counts what is held, not the peak
        LIBC.malloc_trim(0)
    objects = gc.get_objects()
    kinds = collections.Counter(type(o).__name__ for o in objects)
    count = len(objects)
    del objects
    return count, kinds, psutil.Process().memory_info().rss


async def build(args, work: str) -> Controller:
    config = ControllerConfig(
        db=os.path.join(work, "controller.db"), heartbeat_interval=1.0, node_grace=30.0, startup_grace=0.0
    )
    nodes = SimulatedNodes()
    controller = Controller(config, SqliteStore(config.db), nodes)
    controller.load()
    for n in range(args.nodes):
        info = C.NodeInfo(
            node_id=f"node-{n:05d}",
            address=f"10.1.{n // 250}.{n % 250 + 1}:50051",
            host=f"10.1.{n // 250}.{n % 250 + 1}",
            accelerator_ids=range(args.accelerators),
            accelerator_type="sim",
        )
        await controller.register_node(info, [])
    wanted = deployment(args.instances, args.dp)
    if args.config_bytes:  # a bigger engine config, as a real deployment's (every engine's spec carries it)
        wanted.engine_config["motor_engine_union_config"]["served_model_name"] = "m" * args.config_bytes
    controller.apply_deployment(wanted)
    engines = args.instances * args.dp
    while sum(map(len, nodes.engines.values())) < engines or controller._tasks:
        controller.reconcile_once()
        await asyncio.sleep(0.01)
    wires = {
        node_id: C.HeartbeatRequest(
            node_id=node_id,
            generation=controller.nodes[node_id].generation,
            engines=map(T.Engine.FromString, running.values()),
        ).SerializeToString()
        for node_id, running in nodes.engines.items()
    }
    for _ in range(args.beats):
        held = 0.0  # in Controller.heartbeat
        for wire in wires.values():
            request = C.HeartbeatRequest.FromString(wire)
            began = time.perf_counter()
            controller.heartbeat(request.node_id, request.generation, request.engines)
            held += time.perf_counter() - began
        await asyncio.sleep(0)  # the endpoint feed's refresh
    controller.beat_seconds = held  # the last round: every engine reported unchanged
    del wires
    nodes.engines.clear()  # the fleet's side: not the controller's
    not_ready = [i for i in controller.instances.values() if i.state != C.INSTANCE_STATE_READY]
    if not_ready:
        raise SystemExit(f"{len(not_ready)} instances not READY, e.g. {not_ready[0]}")
    async for _ in controller.fleet_series.render():
        pass
    controller.list_nodes()
    controller.store.close()
    return controller


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--accelerators", type=int, default=8, help="per node")
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--config-bytes", type=int, default=0, help="grow the deployment's engine config by this much")
    parser.add_argument("--beats", type=int, default=2, help="full heartbeats per node")
    parser.add_argument("--walks", type=int, default=3, help="complete collections timed")
    parser.add_argument("--top", type=int, default=12, help="object types shown")
    parser.add_argument("--tracemalloc", action="store_true", help="also the Python allocator's bytes (slow)")
    args = parser.parse_args()
    engines = args.instances * args.dp
    if engines > args.nodes * args.accelerators:
        parser.error("the fleet has no room for every engine: more --nodes or --accelerators")
    with tempfile.TemporaryDirectory(prefix="motor-memory-") as work:
        base_objects, base_kinds, base_rss = snapshot()
        if args.tracemalloc:
            tracemalloc.start()
        began = time.monotonic()
        controller = asyncio.run(build(args, work))
        built = time.monotonic() - began
        traced = tracemalloc.get_traced_memory()[0] if args.tracemalloc else 0
        tracemalloc.stop()
        objects, kinds, rss = snapshot()
        walks = []
        for _ in range(args.walks):
            gc.unfreeze()
            t0 = time.perf_counter()
            gc.collect()
            walks.append(time.perf_counter() - t0)
        print(
            f"{args.nodes} nodes x {args.accelerators} accelerators, {args.instances} instances x dp {args.dp} "
            f"= {engines} engines (built in {built:.1f} s, Python {sys.version.split()[0]})"
        )
        print(
            f"tracked GC objects: {objects - base_objects} ({(objects - base_objects) / engines:.1f} per engine), "
            f"{objects} in the process"
        )
        print(
            f"RSS: +{(rss - base_rss) / 2**20:.0f} MiB ({(rss - base_rss) / engines:.0f} bytes per engine), "
            f"{rss / 2**20:.0f} MiB in the process"
        )
        if args.tracemalloc:
            print(f"Python allocator (tracemalloc): {traced / 2**20:.0f} MiB ({traced / engines:.0f} bytes per engine)")
        print(
            f"a full heartbeat of unchanged engines: {controller.beat_seconds / engines * 1e6:.2f} us per engine "
            f"in Controller.heartbeat"
        )
        print(
            f"complete collection: median {statistics.median(walks) * 1000:.0f} ms of {args.walks} "
            f"({', '.join(f'{w * 1000:.0f}' for w in walks)} ms)"
        )
        print("tracked objects that grew most (type: count, per engine):")
        grown = kinds - base_kinds
        for name, count in grown.most_common(args.top):
            print(f"  {name}: {count} ({count / engines:.2f})")
        del controller
    return 0


if __name__ == "__main__":
    sys.exit(main())
