"""A hostile caller's attacks, replayed against a `motorctl up --tls` cluster (controller, two
node managers, the example deployment; mutual TLS on every plane, certificates from its dev
PKI): every attack is refused with the right status code, and afterwards the cluster is
unchanged: same engines, same pids, same ports, same endpoints, same deployment revision."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import grpc
import pytest
from google.protobuf import json_format

from motor.ports import free_port
from motor.v1 import (
    controller_pb2,
    controller_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    node_manager_pb2,
    node_manager_pb2_grpc,
    types_pb2,
)
from motorctl.connect import Credentials
from motorctl.local_cluster import LocalCluster
from motorctl.up_screen import try_commands
from tests.support import REPO_ROOT, require, wait_for
from tests.support.local_cluster import example_cluster

pytestmark = pytest.mark.processes

MARKER = "/tmp/motor-hostile-marker"
LAUNCHER = ["/bin/sh", "-c", f"id > {MARKER}"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = example_cluster(tmp_path_factory, "tls", controller_port=free_port(), engine_port_base=24000, tls=True)
    try:
        cluster.start(timeout=90)
        wait_for(
            lambda: _all_normal(cluster), timeout=120, interval=0.5, what="the example deployment NORMAL over mTLS"
        )
        yield cluster
    finally:
        problems = cluster.stop()
        assert not problems, problems


def _channel(cluster: LocalCluster, address: str, identity: str | None) -> grpc.Channel:
    pki = cluster.pki
    if identity is None:
        return Credentials(ca=pki.ca).channel(address)
    return Credentials(ca=pki.ca, cert=pki.cert(identity), key=pki.key(identity)).channel(address)


def _controller(cluster, identity="viewer"):
    return controller_pb2_grpc.ControllerServiceStub(_channel(cluster, cluster.controller_address, identity))


def _all_normal(cluster) -> bool:
    engines = [
        e for n in _controller(cluster).ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes for e in n.engines
    ]
    return len(engines) == 3 and all(e.health == types_pb2.HEALTH_STATUS_NORMAL for e in engines)


def snapshot(cluster) -> dict:
    """What must not change: every engine (node, pid, ports, generation, health), the endpoints,
    the instances' restart counts and the deployment revision."""
    stub = _controller(cluster)
    nodes = stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes
    engines = {
        e.engine_id: (n.info.node_id, e.pid, e.spec.port, e.spec.mgmt_port, e.spec.generation, e.health)
        for n in nodes
        for e in n.engines
    }
    endpoints = sorted(e.url for e in stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=5).endpoints)
    restarts = {
        i.instance_id: i.restarts
        for i in stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).instances
    }
    revision = stub.GetDeployment(controller_pb2.GetDeploymentRequest(), timeout=5).revision
    return {
        "engines": engines,
        "endpoints": endpoints,
        "restarts": restarts,
        "revision": revision,
        "nodes": {n.info.node_id: (n.info.address, n.generation) for n in nodes},
    }


@pytest.fixture
def unchanged(cluster):
    """Fails the test if the cluster differs after it (after two heartbeats, so that any effect lands)."""
    before = snapshot(cluster)
    yield before
    time.sleep(4 * cluster.heartbeat_interval)
    assert snapshot(cluster) == before
    assert not os.path.exists(MARKER), f"{MARKER} was written: a request ran a command"


def _refused(call, code: grpc.StatusCode, *needles: str) -> str:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    assert refused.value.code() == code, f"{refused.value.code().name}: {refused.value.details()}"
    for needle in needles:
        assert needle in refused.value.details(), refused.value.details()
    return refused.value.details()


def _engine_node(before: dict, engine_id: str = "decode-0/rank0") -> tuple[str, str]:
    node = before["engines"][engine_id][0]
    return node, next(other for other in before["nodes"] if other != node)


def _sglang_spec(launcher: list[str], generation: int = 0) -> types_pb2.EngineSpec:
    config = {
        "motor_engine_prefill_config": {
            "engine_type": "sglang",
            "engine_args": {"model_path": "m", "launcher": launcher},
        }
    }
    return types_pb2.EngineSpec(
        instance_id="evil-0",
        dp_rank=0,
        role=types_pb2.ROLE_PREFILL,
        config_json=json.dumps(config),
        generation=generation,
    )


def test_1_no_request_chooses_a_command_or_a_file(cluster, unchanged):
    node_a = f"127.0.0.1:{cluster.node_ports['node-a']}"
    as_operator = node_manager_pb2_grpc.NodeManagerServiceStub(_channel(cluster, node_a, "operator"))
    _refused(
        lambda: as_operator.StartEngine(node_manager_pb2.StartEngineRequest(spec=_sglang_spec(LAUNCHER)), timeout=10),
        grpc.StatusCode.PERMISSION_DENIED,
        "spiffe://motor/operator/operator",
        "needs role controller",
    )
    # Even the controller's own identity cannot make a node run a program or read any file.
    as_controller = node_manager_pb2_grpc.NodeManagerServiceStub(_channel(cluster, node_a, "controller"))
    _refused(
        lambda: as_controller.StartEngine(node_manager_pb2.StartEngineRequest(spec=_sglang_spec(LAUNCHER)), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        "engine_args.launcher",
    )
    passwd = types_pb2.EngineSpec(instance_id="evil-0", role=types_pb2.ROLE_PREFILL, config_path="/etc/passwd")
    _refused(
        lambda: as_controller.StartEngine(node_manager_pb2.StartEngineRequest(spec=passwd), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        "spec.config_path '/etc/passwd'",
    )
    # The same engine_config inside a deployment.
    deployment = _controller(cluster).GetDeployment(controller_pb2.GetDeploymentRequest(), timeout=5).deployment
    section = deployment.engine_config.fields["motor_engine_prefill_config"].struct_value
    section.fields["engine_args"].struct_value.fields["launcher"].list_value.values.add().string_value = "/bin/sh"
    operator = _controller(cluster, "operator")
    _refused(
        lambda: operator.ApplyDeployment(controller_pb2.ApplyDeploymentRequest(deployment=deployment), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        "engine_config.motor_engine_prefill_config.engine_args.launcher",
    )


@pytest.mark.parametrize(
    "engine_args, key",
    [
        ({"trust-remote-code": True}, "trust-remote-code"),  # the hostile report's F1: other spellings of refused keys
        ({"worker-cls": "os.Evil"}, "worker-cls"),
        ({"scheduler_cls": "os.Evil"}, "scheduler_cls"),
        (
            {"kv_transfer_config": {"kv_connector": "Evil", "kv_connector_module_path": "evil"}},
            "kv_transfer_config.kv_connector_module_path",
        ),
        (
            {"speculative_config": '{"model": "/etc", "method": "eagle"}'},
            "speculative_config.model",
        ),  # F2: JSON in a string
    ],
)
def test_1b_code_keys_in_any_spelling_and_paths_in_json_strings_are_refused(cluster, unchanged, engine_args, key):
    deployment = _controller(cluster).GetDeployment(controller_pb2.GetDeploymentRequest(), timeout=5).deployment
    deployment.engine_config.Clear()
    deployment.engine_config.update(
        {"motor_engine_union_config": {"engine_type": "vllm", "engine_args": {"model": "m", **engine_args}}}
    )
    node_a = f"127.0.0.1:{cluster.node_ports['node-a']}"
    as_controller = node_manager_pb2_grpc.NodeManagerServiceStub(_channel(cluster, node_a, "controller"))
    spec = types_pb2.EngineSpec(
        instance_id="evil-0",
        role=types_pb2.ROLE_UNION,
        config_json=json.dumps(json_format.MessageToDict(deployment.engine_config)),
    )
    _refused(
        lambda: as_controller.StartEngine(node_manager_pb2.StartEngineRequest(spec=spec), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        f"spec.config_json.motor_engine_union_config.engine_args.{key}:",
    )
    if key.startswith("speculative_config"):
        return  # the controller leaves paths to the node managers (it cannot know their model roots)
    operator = _controller(cluster, "operator")
    _refused(
        lambda: operator.ApplyDeployment(controller_pb2.ApplyDeploymentRequest(deployment=deployment), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        f"engine_config.motor_engine_union_config.engine_args.{key}:",
    )


def test_1c_numbers_that_are_not_finite_are_refused(cluster, unchanged):
    """A protobuf Struct and Python's JSON carry NaN; vLLM's range check on
    gpu_memory_utilization lets NaN through."""
    engine_config = {
        "motor_engine_union_config": {
            "engine_type": "vllm",
            "engine_args": {"model": "m", "gpu_memory_utilization": float("nan")},
        }
    }
    node_a = f"127.0.0.1:{cluster.node_ports['node-a']}"
    as_controller = node_manager_pb2_grpc.NodeManagerServiceStub(_channel(cluster, node_a, "controller"))
    spec = types_pb2.EngineSpec(instance_id="evil-0", role=types_pb2.ROLE_UNION, config_json=json.dumps(engine_config))
    _refused(
        lambda: as_controller.StartEngine(node_manager_pb2.StartEngineRequest(spec=spec), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        "spec.config_json is not a JSON object: NaN is not JSON",
    )
    deployment = _controller(cluster).GetDeployment(controller_pb2.GetDeploymentRequest(), timeout=5).deployment
    deployment.engine_config.Clear()
    deployment.engine_config.update(engine_config)
    _refused(
        lambda: _controller(cluster, "operator").ApplyDeployment(
            controller_pb2.ApplyDeploymentRequest(deployment=deployment), timeout=10
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "engine_config.motor_engine_union_config.engine_args.gpu_memory_utilization: nan is not a finite number",
    )


def test_2_a_made_up_node_cannot_register(cluster, unchanged):
    fake = controller_pb2.RegisterNodeRequest(
        node=controller_pb2.NodeInfo(
            node_id="node-x", address="127.0.0.1:1", host="6.6.6.6", accelerator_ids=[0, 1], accelerator_type="sim"
        )
    )
    for identity in ("operator", "controller", "node-b"):
        _refused(
            lambda: _controller(cluster, identity).RegisterNode(fake, timeout=10),
            grpc.StatusCode.PERMISSION_DENIED,
            "node:node-x",
        )
    with pytest.raises(grpc.RpcError) as anonymous:  # no certificate: the handshake fails
        _controller(cluster, None).RegisterNode(fake, timeout=10)
    assert anonymous.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(cluster.controller_address) as plaintext:
        with pytest.raises(grpc.RpcError) as clear:
            controller_pb2_grpc.ControllerServiceStub(plaintext).RegisterNode(fake, timeout=10)
    assert clear.value.code() == grpc.StatusCode.UNAVAILABLE


def test_3_4_a_node_cannot_heartbeat_or_report_as_another(cluster, unchanged):
    victim, attacker = _engine_node(unchanged)
    generation = unchanged["nodes"][victim][1]  # read from ListNodes, as the attacker did
    engine = next(
        e
        for n in _controller(cluster).ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes
        for e in n.engines
        if e.engine_id == "decode-0/rank0"
    )
    moved = types_pb2.Engine()
    moved.CopyFrom(engine)
    moved.spec.host = "6.6.6.6"
    as_attacker = _controller(cluster, attacker)
    _refused(
        lambda: as_attacker.Heartbeat(
            controller_pb2.HeartbeatRequest(node_id=victim, generation=generation, engines=[moved]), timeout=10
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        f"spiffe://motor/node/{attacker}",
        f"node:{victim}",
    )
    failed = types_pb2.Engine()
    failed.CopyFrom(engine)
    failed.state = types_pb2.ENGINE_STATE_FAILED
    for _ in range(4):
        _refused(
            lambda: as_attacker.ReportEngineEvent(
                controller_pb2.ReportEngineEventRequest(
                    node_id=victim, generation=generation, engine=failed, reason="spoofed"
                ),
                timeout=10,
            ),
            grpc.StatusCode.PERMISSION_DENIED,
            f"node:{victim}",
        )


def test_5_only_the_engines_own_node_manager_may_drain_or_sleep_it(cluster, unchanged):
    node, other = _engine_node(unchanged)
    mgmt = unchanged["engines"]["decode-0/rank0"][3]
    for identity in ("operator", "controller", other):
        stub = engine_pb2_grpc.EngineServiceStub(_channel(cluster, f"127.0.0.1:{mgmt}", identity))
        _refused(
            lambda: stub.Drain(engine_pb2.DrainRequest(), timeout=10),
            grpc.StatusCode.PERMISSION_DENIED,
            "needs role node-manager",
        )
        _refused(
            lambda: stub.Sleep(engine_pb2.SleepRequest(), timeout=10),
            grpc.StatusCode.PERMISSION_DENIED,
            "needs role node-manager",
        )
    viewer = engine_pb2_grpc.EngineServiceStub(_channel(cluster, f"127.0.0.1:{mgmt}", "viewer"))
    status = viewer.GetStatus(engine_pb2.GetStatusRequest(), timeout=10).status
    assert (
        status.status == types_pb2.HEALTH_STATUS_NORMAL
        and not status.draining
        and not status.sleeping
        and status.probing
    )


def test_6_no_one_but_the_controller_sends_a_generation(cluster, unchanged):
    node, _ = _engine_node(unchanged)
    address = f"127.0.0.1:{cluster.node_ports[node]}"
    huge = types_pb2.EngineSpec(
        instance_id="decode-0",
        dp_rank=0,
        role=types_pb2.ROLE_DECODE,
        generation=2**63,
        config_json=json.dumps({"motor_engine_decode_config": {"engine_type": "sim"}}),
    )
    for identity in ("operator", node, "viewer"):
        stub = node_manager_pb2_grpc.NodeManagerServiceStub(_channel(cluster, address, identity))
        _refused(
            lambda: stub.StartEngine(node_manager_pb2.StartEngineRequest(spec=huge), timeout=10),
            grpc.StatusCode.PERMISSION_DENIED,
            "needs role controller",
        )
        _refused(
            lambda: stub.StopEngine(
                node_manager_pb2.StopEngineRequest(engine_id="decode-0/rank0", generation=2**63), timeout=10
            ),
            grpc.StatusCode.PERMISSION_DENIED,
            "needs role controller",
        )


def test_a_node_registered_at_another_nodes_address_gets_nothing_done_there(cluster):
    """Hostile F9: node-c's (stolen) certificate registers node-c with node-a's node-manager
    address. Commands meant for node-c are refused by node-a's node manager, node-c's re-check
    there fails so it is declared lost, and node-a's engines are never fenced as node-c's."""
    from motor.security.identity import Identity
    from motor.security.pki import CertificateAuthority

    before = snapshot(cluster)
    victim = next(n for n in before["nodes"] if any(e[0] == n for e in before["engines"].values()))
    victim_address = f"127.0.0.1:{cluster.node_ports[victim]}"
    CertificateAuthority.load(cluster.pki.directory).issue(Identity("node", "node-c"), []).save(
        cluster.pki.directory, "node-c"
    )
    as_node_c = _controller(cluster, "node-c")
    registered = as_node_c.RegisterNode(
        controller_pb2.RegisterNodeRequest(
            node=controller_pb2.NodeInfo(
                node_id="node-c",
                address=victim_address,
                host="127.0.0.1",
                accelerator_ids=[3],
                accelerator_type="sim",
                port_range_start=47000,
                port_range_end=47099,
            )
        ),
        timeout=10,
    )
    for _ in range(3):
        as_node_c.Heartbeat(
            controller_pb2.HeartbeatRequest(node_id="node-c", generation=registered.generation), timeout=10
        )
        time.sleep(cluster.heartbeat_interval)

    # What the controller sends to "node-c" reaches node-a's node manager, which refuses it.
    as_controller = node_manager_pb2_grpc.NodeManagerServiceStub(_channel(cluster, victim_address, "controller"))
    for call in (
        lambda: as_controller.ListEngines(node_manager_pb2.ListEnginesRequest(node_id="node-c"), timeout=10),
        lambda: as_controller.StopEngine(
            node_manager_pb2.StopEngineRequest(engine_id=next(iter(before["engines"])), node_id="node-c"), timeout=10
        ),
    ):
        _refused(
            call,
            grpc.StatusCode.FAILED_PRECONDITION,
            "node_id 'node-c'",
            f"node {victim}'s node manager",
            "--advertise-address",
        )

    # node-c falls silent: its direct re-check at node-a's address fails, so it is lost, not "back".
    def node_c_lost():
        nodes = _controller(cluster).ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes
        node_c = next(n for n in nodes if n.info.node_id == "node-c")
        return node_c if node_c.state == controller_pb2.NODE_STATE_LOST else None

    lost = wait_for(node_c_lost, timeout=90, interval=0.5, what="node-c declared LOST")
    assert "node_id 'node-c'" in lost.state_reason, lost.state_reason
    after = snapshot(cluster)
    assert {k: after[k] for k in ("engines", "endpoints", "restarts", "revision")} == {
        k: before[k] for k in ("engines", "endpoints", "restarts", "revision")
    }


def test_the_screens_grpcurl_commands_work(cluster):
    grpcurl = shutil.which("grpcurl", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    require(grpcurl is not None, "grpcurl")
    lines = [line.split("grpcurl ", 1)[1] for line in try_commands(cluster).splitlines() if "grpcurl " in line]
    assert len(lines) == 3
    for line in lines:
        result = subprocess.run(f"{grpcurl} {line}", shell=True, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"{line}: {result.stderr}"
    assert (
        "motor.v1.ControllerService"
        in subprocess.run(f"{grpcurl} {lines[0]}", shell=True, capture_output=True, text=True).stdout
    )


def test_motorctl_with_a_certificate_or_a_token(cluster):
    pki = cluster.pki
    motorctl = [sys.executable, "-m", "motorctl.cli", "--controller", cluster.controller_address, "--cacert", pki.ca]
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}

    def run(*args):
        return subprocess.run([*motorctl, *args], capture_output=True, text=True, env=env, timeout=60)

    nodes = run("--cert", pki.cert("viewer"), "--key", pki.key("viewer"), "-o", "json", "nodes")
    assert nodes.returncode == 0, nodes.stderr
    # (node-c, when listed, is the lost impostor of the address-hijack test above)
    assert {n["info"]["node_id"] for n in json.loads(nodes.stdout)["nodes"]} - {"node-c"} == {"node-a", "node-b"}
    deleted = run("--cert", pki.cert("viewer"), "--key", pki.key("viewer"), "delete")
    assert deleted.returncode == 1 and "PERMISSION_DENIED" in deleted.stderr and "needs role operator" in deleted.stderr
    token = subprocess.run(
        [
            *motorctl[:4],
            f"127.0.0.1:{cluster.token_port}",
            "--cacert",
            pki.ca,
            "--token-file",
            pki.token_file("viewer"),
            "deployment",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert token.returncode == 0 and "name: local-sim" in token.stdout, token.stderr
