"""A cluster of real processes for the controller's tests: a controller, node managers and simulated
engine servers as `motorctl up` starts them, with short intervals, and the deployments they run."""

from __future__ import annotations

import os
import signal

import grpc
import pytest

from motor.contract.deployment_file import deployment_from_dict
from motor.v1 import controller_pb2 as C
from motor.v1 import controller_pb2_grpc
from motor.v1 import types_pb2 as T
from motorctl.cluster_processes import script_path
from motorctl.local_cluster import LocalCluster
from tests.support import require

HEARTBEAT = 0.5


GRACE = 2.0


def sim_deployment(
    count: int = 1,
    dp: int = 1,
    faults: dict | None = None,
    utilization: float = 10,
    health: dict | None = None,
    **policy,
) -> C.Deployment:
    args = {"model": "sim-tiny", "latency_ms": 1, "utilization": utilization}
    if faults:
        args["faults"] = faults
    section = {
        "engine_type": "sim",
        "engine_args": args,
        "health_check_config": health or {"enable_virtual_inference": False},
    }
    return deployment_from_dict(
        {
            "name": "test",
            "model": "sim-tiny",
            "engine_config": {"motor_engine_union_config": section},
            "instance_groups": [{"name": "u", "role": "union", "count": count, "data_parallel_size": dp}],
            "restart_policy": {"initial_backoff": "1s", "max_backoff": "4s", **policy},
        }
    )


class Cluster(LocalCluster):
    """LocalCluster plus what these tests do to the controller: kill -9 and start it again."""

    def controller_argv(self) -> list[str]:
        return [
            script_path("motor-controller"),
            "--listen",
            self.controller_address,
            "--db",
            os.path.join(self.run_dir, "controller.db"),
            "--heartbeat-interval",
            str(self.heartbeat_interval),
            "--node-grace",
            str(self.node_grace),
            *self._metrics_args("controller", 0),  # the same /metrics port as before the restart
            *self.extra_controller_args,
        ]

    def kill_controller(self) -> None:
        process = self.process("controller").process
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def start_controller(self) -> None:
        self._launch("controller", self.controller_argv())
        self.wait_serving(self.controller_address, 30)

    def stub(self) -> controller_pb2_grpc.ControllerServiceStub:
        if not hasattr(self, "_channel"):
            self._channel = grpc.insecure_channel(self.controller_address)
        return controller_pb2_grpc.ControllerServiceStub(self._channel)

    def instances(self) -> dict[str, C.Instance]:
        return {i.instance_id: i for i in self.stub().ListInstances(C.ListInstancesRequest(), timeout=5).instances}

    def node_list(self) -> C.ListNodesResponse:
        return self.stub().ListNodes(C.ListNodesRequest(), timeout=5)

    def engine_copies(self) -> dict[tuple[str, str], T.Engine]:
        """(node, engine id) -> engine, as each node reports it, live copies only."""
        return {
            (n.info.node_id, e.engine_id): e
            for n in self.node_list().nodes
            for e in n.engines
            if e.state in (T.ENGINE_STATE_STARTING, T.ENGINE_STATE_RUNNING)
        }

    def all_ready(self, count: int) -> bool:
        instances = self.instances()
        return len(instances) == count and all(i.state == C.INSTANCE_STATE_READY for i in instances.values())

    def describe(self) -> str:
        """Instances, nodes and recent events: what a failed wait shows."""
        lines = [
            f"instance {i.instance_id} {C.InstanceState.Name(i.state)} restarts={i.restarts}: {i.state_reason}"
            for i in self.instances().values()
        ]
        lines += [
            f"node {n.info.node_id} {C.NodeState.Name(n.state)}: {n.state_reason}" for n in self.node_list().nodes
        ]
        lines += [f"event {C.EventType.Name(e.type)}: {e.message[:300]}" for e in self.events()[-30:]]
        return "\n".join(lines)

    def events(self) -> list[C.Event]:
        stream = self.stub().WatchEvents(C.WatchEventsRequest(), timeout=5)
        first = next(stream)
        stream.cancel()
        return list(first.snapshot.recent_events)


@pytest.fixture
def make_cluster(tmp_path):
    require(
        os.path.exists(script_path("motor-node-manager")) and os.path.exists(script_path("engine_server")),
        "the motor-node-manager and engine_server commands",
    )
    made: list[Cluster] = []

    def make(
        nodes: int = 2,
        accelerators: int = 4,
        extra: list[str] | None = None,
        kind: type[Cluster] = Cluster,
        tls: bool = False,
    ) -> Cluster:
        cluster = kind(
            str(tmp_path / f"c{len(made)}"),
            nodes=nodes,
            accelerators_per_node=accelerators,
            heartbeat_interval=HEARTBEAT,
            node_grace=GRACE,
            abnormal_threshold=3,
            extra_controller_args=["--recheck-timeout", "0.5", *(extra or [])],
            tls=tls,
        )
        made.append(cluster)
        cluster.start(timeout=60)
        return cluster

    yield make
    for cluster in made:
        if hasattr(cluster, "_channel"):
            cluster._channel.close()
        for managed in cluster.processes:  # SIGSTOPped processes cannot stop
            try:
                os.killpg(managed.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        problems = [p for p in cluster.stop() if "could not stop its engines" not in p]
        assert not [p for p in problems if "left-over" in p], problems


def apply(cluster: Cluster, deployment: C.Deployment) -> None:
    cluster.stub().ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment), timeout=10)


def model_deployment(name: str, model: str, count: int) -> C.Deployment:
    section = {
        "engine_type": "sim",
        "engine_args": {"model": model, "latency_ms": 1},
        "health_check_config": {"enable_virtual_inference": False},
    }
    return deployment_from_dict(
        {
            "name": name,
            "model": model,
            "engine_config": {"motor_engine_union_config": section},
            "instance_groups": [{"name": name, "role": "union", "count": count}],
        }
    )
