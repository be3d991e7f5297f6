"""The compose simulation, run for real: a real docker engine, the real compose CLI, containers
killed with `docker kill` and partitioned with `docker network disconnect`.

The tests run in file order on one stack (module fixture): up -> node killed -> node partitioned
and healed -> down. Each leaves the cluster with three nodes and the deployment ready.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time

import grpc
import psutil
import pytest
import yaml

from motor.v1 import controller_pb2
from tests.support import REPO_ROOT, wait_for
from tests.support.chaos_table import Row, record
from tests.support.compose_stack import (
    CONTROLLER_SERVICES,
    NODE_SERVICES,
    SERVICES,
    TIMINGS,
    ComposeStack,
    deployment_ready,
    describe,
    placement,
    ready_nodes,
    run,
    wait,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

# docker/controller.yaml: heartbeats every 1 s, a node silent for 5 s is re-checked, then lost.
NODE_GRACE = 5.0
EXPECTED_ENGINES = {"prefill-0/rank0", "prefill-0/rank1", "decode-0/rank0"}
# Hang bounds only (the machine has 2 shared cores); measured figures are in TIMINGS.
START_TIMEOUT = 180
MOVE_TIMEOUT = NODE_GRACE + 60
with open(os.path.join(REPO_ROOT, "deploy", "prometheus", "alerts.yaml")) as _f:
    ALERT_RULES = {r["alert"]: r for g in yaml.safe_load(_f)["groups"] for r in g["rules"]}
# MotorNodeLost's `for:` (30s), plus the scrape and evaluation intervals of docker/prometheus.yml.
NODE_LOST_FOR = float(ALERT_RULES["MotorNodeLost"]["for"].removesuffix("s"))


def _bin(name: str) -> str:
    path = shutil.which(name, path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert path, f"{name} not found: run `make setup`"
    return path


def _wait_cluster_ready(stack: ComposeStack, timeout: float, what: str):
    def ready():
        nodes, instances = stack.snapshot()
        return (nodes, instances) if ready_nodes(nodes) == set(NODE_SERVICES) and deployment_ready(instances) else None

    return wait(ready, timeout, what, stack)


def _engines_once(stack: ComposeStack) -> dict[str, list[str]]:
    """Engine processes across every container; fails unless each engine runs exactly once."""
    found = stack.engine_processes()
    twice = {engine: where for engine, where in found.items() if len(where) > 1}
    assert not twice, f"engines running more than once: {twice}"
    assert set(found) == EXPECTED_ENGINES, f"engine processes {found}, expected one each of {sorted(EXPECTED_ENGINES)}"
    return found


def _busiest_node(instances) -> str:
    by_node: dict[str, int] = {}
    for node in placement(instances).values():
        by_node[node] = by_node.get(node, 0) + 1
    return max(sorted(by_node), key=by_node.get)


def test_stack_comes_up_with_three_nodes_and_the_deployment_ready(stack: ComposeStack):
    started = time.monotonic()
    nodes, instances = _wait_cluster_ready(stack, START_TIMEOUT, "three READY nodes and every instance READY")
    TIMINGS["up -> 3 nodes + deployment ready"] = time.monotonic() - started

    assert {i.instance_id for i in instances} == {"prefill-0", "decode-0"}
    assert set(placement(instances)) == EXPECTED_ENGINES
    # Each node is its own host: engines advertise their container's data-network address.
    hosts = {n.info.node_id: n.info.host for n in nodes}
    assert len(set(hosts.values())) == 3, hosts
    for engine in (e for i in instances for e in i.engines):
        assert engine.host == hosts[engine.node_id], describe(nodes, instances)
    # The engine processes really run inside the containers the controller placed them on.
    found = _engines_once(stack)
    assert {engine: where[0] for engine, where in found.items()} == placement(instances)

    # Docker's health checks (grpc.health.v1 inside each container) report healthy.
    wait(lambda: all(stack.health(s) == "healthy" for s in SERVICES), 90, "every container healthy", stack)

    # From the host, through the published port: the real grpcurl and motorctl, over mutual TLS
    # with the operator certificate copied out of the stack's pki volume.
    grpcurl = [_bin("grpcurl"), *stack.tls_flags(dash="-")]
    listed = run([*grpcurl, stack.controller_address, "list"]).stdout.split()
    assert "motor.v1.ControllerService" in listed and "grpc.health.v1.Health" in listed
    reply = json.loads(
        run([*grpcurl, "-d", "{}", stack.controller_address, "motor.v1.ControllerService/ListNodes"]).stdout
    )
    assert sorted(n["info"]["node_id"] for n in reply["nodes"]) == list(NODE_SERVICES)
    shown = run(
        [
            _bin("motorctl"),
            "--controller",
            stack.controller_address,
            *stack.tls_flags(),
            "--output",
            "json",
            "instances",
        ]
    ).stdout
    assert "prefill-0" in shown and "decode-0" in shown, shown


def test_the_router_serves_every_engine_on_one_published_address(stack: ComposeStack):
    """The router service, kept by the router-sync service over mutual TLS with its read-only
    identity: every engine is its worker (by its address on the data network), and a completion
    sent to the front door's published port (TLS, the development key) is answered."""
    _, instances = _wait_cluster_ready(stack, START_TIMEOUT, "three READY nodes and every instance READY")
    engines = {f"http://{e.host}:{e.port}" for i in instances for e in i.engines}
    wait(
        lambda: stack.router_workers() == engines,
        60,
        f"the router's workers equal to the engines {sorted(engines)}",
        stack,
    )
    assert complete(stack, "sim-tiny")["choices"][0]["text"]


def complete(stack: ComposeStack, model: str) -> dict:
    """A completion through the front door (the router's multi-model mode: the request names its model)."""
    status, answer = stack.door("/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 4})
    assert status == 200, answer
    return answer


# Run in a container on the `clients` network (the motor image's python): what a client's
# container reaches. argv: the door's CA file, then host:port pairs that must not connect.
_FROM_CLIENTS = r"""
import json, os, socket, ssl, sys, urllib.error, urllib.request
unreached = {}
for target in sys.argv[2:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        unreached[target] = "connected"
    except OSError as exc:
        unreached[target] = type(exc).__name__
context = ssl.create_default_context(cafile=sys.argv[1])
def door(path, body=None, key=None):
    headers = {"Content-Type": "application/json"} | ({"Authorization": "Bearer " + key} if key else {})
    data = json.dumps(body).encode() if body else None
    request = urllib.request.Request("https://front-door:8080" + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as reply:
            return [reply.status, json.loads(reply.read())]
    except urllib.error.HTTPError as refused:
        return [refused.code, None]
key = os.environ["DOOR_KEY"]
completion = {"model": "sim-tiny", "prompt": "hello", "max_tokens": 4}
print(json.dumps({
    "unreached": unreached,
    "models_without_key": door("/v1/models")[0],
    "completion_without_key": door("/v1/completions", completion)[0],
    "models": door("/v1/models", key=key),
    "completion": door("/v1/completions", completion, key=key),
}))
"""


def test_from_the_clients_network_only_the_keyed_door_answers(stack: ComposeStack):
    """compose.yaml's `clients` network holds the front door alone: a container on it reaches
    neither the router nor any engine (by name or by any of their addresses) nor the door's table
    port; the door answers over TLS (the pki volume's CA), 401 without a key, 200 with the
    development key. An engine reached on the data network without the engines' key answers 401,
    and the router's API (its unguarded admin routes) is not reached from a node either."""
    _, instances = _wait_cluster_ready(stack, START_TIMEOUT, "three READY nodes and every instance READY")
    engines = [(e.host, e.port) for i in instances for e in i.engines]
    wait(lambda: len(stack.router_workers()) == len(engines), 60, "the router's workers", stack)
    control, data, router = stack.control_net, stack.data_net, stack.router_net
    router_api = ["router:8081", f"{control}.21:8081", f"{data}.21:8081", f"{router}.21:8081"]
    targets = [*router_api, "front-door:8079", f"{control}.23:8079"]
    by_address = {address: node for node, address in stack.node_addresses.items()}
    for host, port in engines:
        targets += [f"{host}:{port}", f"{by_address[int(host.rsplit('.', 1)[1])]}:{port}"]
    reply = run(
        [
            "docker", "run", "--rm", "--network", stack.network("clients"),
            "-v", f"{stack.pki('ca.crt')}:/door-ca.crt:ro", "-e", f"DOOR_KEY={stack.development_key()}",
            "--entrypoint", "python", stack.image, "-c", _FROM_CLIENTS, "/door-ca.crt", *targets,
        ],
        timeout=180,
    )  # fmt: skip
    seen = json.loads(reply.stdout.strip().splitlines()[-1])
    assert not [t for t, how in seen["unreached"].items() if how == "connected"], seen["unreached"]
    assert seen["models_without_key"] == 401 and seen["completion_without_key"] == 401, seen
    assert seen["models"][0] == 200 and [m["id"] for m in seen["models"][1]["data"]] == ["sim-tiny"], seen
    assert seen["completion"][0] == 200 and seen["completion"][1]["choices"][0]["text"], seen

    # On the data network (inside a node's container), an engine wants the engines' key.
    ask = (
        "import sys, urllib.error, urllib.request\n"
        "def get(url, headers):\n"
        "    try:\n"
        "        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10).status\n"
        "    except urllib.error.HTTPError as refused:\n"
        "        return refused.code\n"
        "key = open('/pki/engine.key').read().strip()\n"
        "url = sys.argv[1] + '/v1/models'\n"
        "print(get(url, {}), get(url, {'Authorization': 'Bearer wrong'}), get(url, {'Authorization': 'Bearer ' + key}))"
    )
    host, port = engines[0]
    statuses = run(["docker", "exec", stack.container("node-a"), "python", "-c", ask, f"http://{host}:{port}"]).stdout
    assert statuses.split() == ["401", "401", "200"], statuses
    # vllm-router holds the same key as OPENAI_API_KEY (what it sends on prefill/decode legs).
    held = (
        "import os\n"
        "key = open('/pki/engine.key').read().strip().encode()\n"
        "envs = [open(f'/proc/{p}/environ', 'rb').read().split(b'\\0') for p in os.listdir('/proc') if p.isdigit()]\n"
        "print(any(b'OPENAI_API_KEY=' + key in env for env in envs))"
    )
    assert run(["docker", "exec", stack.container("router"), "python", "-c", held]).stdout.split() == ["True"]

    # Nor does the router's API answer a node (on `control` and `data`, where engines and node
    # managers are): it listens on its `router` address, which only the door and the sync reach.
    connects = (
        "import socket, sys\n"
        "for target in sys.argv[1:]:\n"
        "    host, port = target.rsplit(':', 1)\n"
        "    try:\n"
        "        socket.create_connection((host, int(port)), timeout=3).close()\n"
        "        print(target, 'connected')\n"
        "    except OSError as exc:\n"
        "        print(target, type(exc).__name__)"
    )
    seen_from_node = run(["docker", "exec", stack.container("node-a"), "python", "-c", connects, *router_api]).stdout
    assert "connected" not in seen_from_node and len(seen_from_node.splitlines()) == len(router_api), seen_from_node


def test_a_second_model_runs_beside_the_first_and_its_delete_leaves_the_first_alone(stack: ComposeStack):
    """examples/second-model.yaml applied beside the stack's deployment, on the same nodes'
    accelerators: its engines serve (ListEndpoints by model, the router's workers), and deleting
    it stops only its engines: the first deployment's keep their pids."""
    _wait_cluster_ready(stack, START_TIMEOUT, "three READY nodes and every instance READY")
    first = stack.engine_pids()
    both = f"{stack.published('controller')},{stack.published('controller-b')}"
    motorctl = [_bin("motorctl"), "--controller", both, *stack.tls_flags()]
    applied = run([*motorctl, "apply", "-f", os.path.join(REPO_ROOT, "examples", "second-model.yaml")])
    assert "applied" in applied.stdout, applied.stdout

    def small_endpoints():
        with stack.channel(address=stack.leader()) as channel:
            request = controller_pb2.ListEndpointsRequest(model="sim-small")
            return {e.url for e in stack.stub(channel).ListEndpoints(request, timeout=10).endpoints}

    wait(lambda: len(small_endpoints()) == 2, START_TIMEOUT, "the second model's two engines serving", stack)
    workers = stack.router_workers
    wait(lambda: small_endpoints() <= workers() and len(workers()) == 5, 60, "five workers in the router", stack)
    for model in ("sim-small", "sim-tiny") * 5:  # each request reaches an engine of its model (others 404)
        assert complete(stack, model)["model"] == model
    status, listed = stack.door("/v1/models")  # the front door: OpenAI's list
    assert status == 200 and [m["id"] for m in listed["data"]] == ["sim-small", "sim-tiny"], listed
    shown = run([*motorctl, "deployments"]).stdout
    assert "small-sim" in shown and "sim-small" in shown, shown

    run([*motorctl, "delete", "small-sim"])
    wait(lambda: not any(e.startswith("small-") for e, _ in stack.engine_pids()), 60, "small-sim's engines gone", stack)
    assert stack.engine_pids() == first
    wait(lambda: len(workers()) == 3, 30, "the router back to the first deployment's three workers", stack)


def test_published_controller_port_refuses_plaintext_and_callers_without_a_certificate(stack: ComposeStack):
    """mTLS by default: the port the host reaches answers neither plaintext nor TLS without a
    client certificate, while the same call with the viewer's certificate succeeds."""
    call = [stack.controller_address, "motor.v1.ControllerService/ListNodes"]
    plaintext = run([_bin("grpcurl"), "-plaintext", "-d", "{}", *call], check=False)
    assert plaintext.returncode != 0, plaintext.stdout
    no_client_cert = run([_bin("grpcurl"), "-cacert", stack.pki("ca.crt"), "-d", "{}", *call], check=False)
    assert no_client_cert.returncode != 0, no_client_cert.stdout
    with grpc.insecure_channel(stack.controller_address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            stack.stub(channel).ListNodes(controller_pb2.ListNodesRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    viewer = run([_bin("grpcurl"), *stack.tls_flags("viewer", dash="-"), "-d", "{}", *call])
    assert sorted(n["info"]["node_id"] for n in json.loads(viewer.stdout)["nodes"]) == list(NODE_SERVICES)


def _targets(stack: ComposeStack) -> str:
    """Prometheus' view of its targets, for failure messages."""
    active = stack.prometheus("/api/v1/targets")["activeTargets"]
    return "\n".join(f"{t['labels'].get('job')} {t['scrapeUrl']}: {t['health']} {t['lastError']}" for t in active)


def test_prometheus_scrapes_every_service_with_the_alert_rules_loaded(stack: ComposeStack):
    _wait_cluster_ready(stack, START_TIMEOUT, "the cluster ready")

    def every_target_up():
        samples = stack.prometheus("/api/v1/query", query="up")["result"]
        by_job: dict[str, list[dict]] = {}
        for sample in samples:
            by_job.setdefault(sample["metric"]["job"], []).append(sample["metric"])
        complete = (
            len(by_job.get("motor-controller", [])) == 2  # the leader and the standby
            and {m.get("node_id") for m in by_job.get("motor-node-manager", [])} == set(NODE_SERVICES)
            # Engines are discovered from the controller (/discovery/engines), with their ids.
            and {m.get("engine_id") for m in by_job.get("motor-engine", [])} == EXPECTED_ENGINES
        )
        return complete and all(sample["value"][1] == "1" for sample in samples)

    started = time.monotonic()
    wait_for(every_target_up, 120, 1, "every Prometheus target up == 1", detail=lambda: _targets(stack))
    TIMINGS["ready -> every Prometheus target up"] = time.monotonic() - started

    loaded = {rule["name"] for group in stack.prometheus("/api/v1/rules")["groups"] for rule in group["rules"]}
    assert set(ALERT_RULES) <= loaded, f"alert rules not loaded: {set(ALERT_RULES) - loaded}"
    # Each service's own series arrive, labelled by job.
    for query, job in (
        ('motor_controller_nodes{state="READY"} > 0', "motor-controller"),
        ("motor_node_manager_engines", "motor-node-manager"),
        ("motor_engine_server_health_status", "motor-engine"),
        ("motor_event_loop_lag_seconds_count", "motor-node-manager"),
        # Node managers heartbeat on one long-lived StreamHeartbeats stream (unary Heartbeat with an
        # older controller): counted when it starts, handled only when it ends.
        ('grpc_server_started_total{grpc_method=~"StreamHeartbeats|Heartbeat"}', "motor-controller"),
    ):
        result = stack.prometheus("/api/v1/query", query=query)["result"]
        assert any(r["metric"]["job"] == job for r in result), f"{query}: {result}"
    assert stack.firing_alerts("MotorNodeLost") == []


def test_killed_node_manager_container_engines_move_to_the_other_nodes(stack: ComposeStack):
    nodes, before = _wait_cluster_ready(stack, START_TIMEOUT, "the cluster ready before the kill")
    victim = _busiest_node(before)
    moved = {engine for engine, node in placement(before).items() if node == victim}

    killed_at = time.monotonic()
    run(["docker", "kill", stack.container(victim)])

    def replaced():
        nodes, instances = stack.snapshot()
        where = placement(instances)
        return (
            {i.instance_id for i in instances} == {i.instance_id for i in before}  # no instance lost
            and set(where) == EXPECTED_ENGINES
            and victim not in where.values()
            and deployment_ready(instances)
        )

    wait(replaced, MOVE_TIMEOUT, f"the engines of killed {victim} ({sorted(moved)}) READY on the other nodes", stack)
    TIMINGS[f"docker kill {victim} -> its {len(moved)} engines NORMAL elsewhere (grace {NODE_GRACE:.0f} s)"] = (
        time.monotonic() - killed_at
    )
    # Prometheus fires MotorNodeLost for it: detection (grace + re-check), then the rule's `for:`.
    wait_for(
        lambda: [a for a in stack.firing_alerts("MotorNodeLost") if a["node_id"] == victim],
        NODE_GRACE + NODE_LOST_FOR + 60,
        1,
        f"MotorNodeLost firing for {victim}",
        detail=lambda: _targets(stack),
    )
    TIMINGS[f"docker kill {victim} -> MotorNodeLost firing (for: {NODE_LOST_FOR:.0f} s)"] = time.monotonic() - killed_at
    nodes, _ = stack.snapshot()
    assert victim not in ready_nodes(nodes)
    assert not stack.running(victim)
    _engines_once(stack)

    # The node comes back empty-handed: it re-registers, and nothing moves back twice.
    run(["docker", "start", stack.container(victim)])
    _wait_cluster_ready(stack, START_TIMEOUT, f"{victim} READY again after docker start")
    _engines_once(stack)
    wait_for(lambda: stack.firing_alerts("MotorNodeLost") == [], 60, 1, "MotorNodeLost resolved once the node is back")


def test_partitioned_node_is_fenced_when_healed_so_no_engine_runs_twice(stack: ComposeStack):
    nodes, before = _wait_cluster_ready(stack, START_TIMEOUT, "the cluster ready before the partition")
    victim = _busiest_node(before)
    moved = {engine for engine, node in placement(before).items() if node == victim}
    network = stack.network("control")
    container = stack.container(victim)
    address = f"{stack.control_net}.{stack.node_addresses[victim]}"
    seen_before = max((e.sequence for e in stack.events()), default=0)

    cut_at = time.monotonic()
    run(["docker", "network", "disconnect", network, container])
    try:

        def moved_elsewhere():
            nodes, instances = stack.snapshot()
            where = placement(instances)
            return set(where) == EXPECTED_ENGINES and victim not in where.values() and deployment_ready(instances)

        wait(moved_elsewhere, MOVE_TIMEOUT, f"the engines of partitioned {victim} READY elsewhere", stack)
        TIMINGS[f"partition {victim} -> its {len(moved)} engines NORMAL elsewhere"] = time.monotonic() - cut_at
        # The partitioned node cannot hear the controller, and its node manager keeps supervising
        # its engines: each engine moved off it still runs there, as a stale copy.
        stale = {e for e, where in stack.engine_processes().items() if victim in where}
        assert stale == moved, f"stale copies on partitioned {victim}: {sorted(stale)}, expected {sorted(moved)}"
    finally:
        healed_at = time.monotonic()
        run(["docker", "network", "connect", "--ip", address, "--alias", victim, network, container])

    _wait_cluster_ready(stack, START_TIMEOUT, f"{victim} READY again after the partition healed")
    TIMINGS[f"heal {victim} -> READY again, deployment ready"] = time.monotonic() - healed_at

    # Within a few heartbeats every stale copy is stopped; from then on each engine runs once.
    def fenced():
        found = stack.engine_processes()
        return all(len(where) == 1 for where in found.values()) and set(found) == EXPECTED_ENGINES

    wait(fenced, 120, "each engine running exactly once after the heal", stack, interval=1)
    TIMINGS[f"heal {victim} -> no engine running twice"] = time.monotonic() - healed_at
    _record_partition_row(stack, victim, before, moved, stale, seen_before, time.monotonic() - healed_at)
    # The controller said so: ENGINE_FENCED naming each stale copy it stopped on the node (one event
    # per copy, or one per node report naming them all: "N engines on node-x stopped: stale copies (a, b)").
    fenced_events = [
        e for e in stack.events() if e.sequence > seen_before and e.type == controller_pb2.EVENT_TYPE_ENGINE_FENCED
    ]
    named = {e.engine_id for e in fenced_events if e.node_id == victim and e.engine_id}
    for e in fenced_events:
        if e.node_id == victim and not e.engine_id:
            named |= set(re.findall(r"[\w.-]+/rank\d+", e.message.split(";")[0]))
    assert named == stale, [e.message for e in fenced_events]
    for _ in range(5):  # and it stays so: the healed node does not restart its stale engines
        nodes, instances = stack.snapshot()
        found = _engines_once(stack)
        assert {engine: where[0] for engine, where in found.items()} == placement(instances), describe(nodes, instances)
        time.sleep(1)


def _record_partition_row(
    stack: ComposeStack, victim: str, before, moved: set[str], stale: set[str], seen_before: int, recovery_s: float
) -> None:
    """The partition row of the chaos table (tests/chaos, docs/chaos.md), measured on this stack."""
    nodes, after = stack.snapshot()
    # An instance with an engine on the partitioned node is restarted whole (restart scope: group).
    touched = {engine.split("/rank")[0] for engine in moved}
    untouched = {e: n for e, n in placement(before).items() if e.split("/rank")[0] not in touched}
    failed = {
        e.engine_id
        for e in stack.events()
        if e.sequence > seen_before and e.type == controller_pb2.EVENT_TYPE_ENGINE_FAILED
    }
    false_kills = sorted(e for e, n in untouched.items() if placement(after).get(e) != n or e in failed)
    found = stack.engine_processes()
    row = record(
        Row(
            "partition and heal (compose)",
            false_kills=len(false_kills),
            instances_lost=sum(1 for i in after if i.state != controller_pb2.INSTANCE_STATE_READY),
            running_twice=sum(1 for where in found.values() if len(where) > 1),
            orphans=len(set(found) - EXPECTED_ENGINES),
            recovery_s=recovery_s,
            note=f"{victim} cut off the control network; {len(moved)} engines moved, "
            f"{len(stale)} stale copies fenced on heal" + (f"; false kills: {false_kills}" if false_kills else ""),
        )
    )
    assert row.zeros(), row


def test_killed_leader_container_the_standby_leads_and_no_engine_restarts(stack: ComposeStack):
    """Two controllers on three etcd members (mutual TLS): docker kill of the leading one's
    container; the other leads with the next epoch and has every node and the deployment ready
    with the very same engine processes; the killed one comes back as the standby, and motorctl
    given both published ports follows the leader."""
    _wait_cluster_ready(stack, START_TIMEOUT, "the cluster ready before the leader is killed")
    reply = stack.controllers()
    assert reply.store.startswith("etcds://"), reply.store
    assert sorted(c.address for c in reply.controllers) == sorted(f"{s}:50051" for s in CONTROLLER_SERVICES), reply
    leader = reply.leader_address.rsplit(":", 1)[0]
    standby = next(s for s in CONTROLLER_SERVICES if s != leader)
    pids = stack.engine_pids()
    _, before = stack.snapshot(stack.published(leader))
    restarts = {i.instance_id: i.restarts for i in before}

    killed_at = time.monotonic()
    run(["docker", "kill", stack.container(leader)])

    def leads():
        try:
            now = stack.controllers(stack.published(standby))
        except grpc.RpcError:
            return None
        return now if now.leader_address == f"{standby}:50051" else None

    now = wait(leads, 60, f"{standby} leading after {leader} was killed", stack)
    TIMINGS[f"docker kill {leader} (leader) -> {standby} leads"] = time.monotonic() - killed_at
    assert now.epoch == reply.epoch + 1

    def ready_at_the_new_leader():
        nodes, instances = stack.snapshot(stack.published(standby))
        return instances if ready_nodes(nodes) == set(NODE_SERVICES) and deployment_ready(instances) else None

    after = wait(ready_at_the_new_leader, 60, f"every node and instance ready under {standby}", stack)
    TIMINGS[f"docker kill {leader} (leader) -> every node READY, deployment ready under {standby}"] = (
        time.monotonic() - killed_at
    )
    assert placement(after) == placement(before)
    assert {i.instance_id: i.restarts for i in after} == restarts, "an instance restarted across the failover"
    assert stack.engine_pids() == pids, "an engine process was restarted or stopped across the failover"

    # The killed controller comes back as the standby; motorctl on the host, given both published
    # ports, follows the leader (the standby names it by its in-network name, which the host
    # cannot resolve: motorctl tries the other port).
    run(["docker", "start", stack.container(leader)])
    wait(
        lambda: (
            stack.health(leader) == "healthy"
            and stack.controllers(stack.published(leader)).leader_address == f"{standby}:50051"
        ),
        90,
        f"{leader} back as the standby",
        stack,
    )
    both = f"{stack.published(leader)},{stack.published(standby)}"
    applied = run(
        [
            _bin("motorctl"),
            "--controller",
            both,
            *stack.tls_flags(),
            "apply",
            "-f",
            os.path.join(REPO_ROOT, "docker", "deployment.yaml"),
        ]
    )
    assert "applied" in applied.stdout, applied.stdout
    assert stack.engine_pids() == pids


def test_compose_down_leaves_no_container_network_or_process(stack: ComposeStack):
    processes = stack.host_processes()
    assert any("engine_server" in args for _, args in processes), processes
    alive = []
    for pid, _ in processes:
        try:
            alive.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass

    started = time.monotonic()
    stack.compose_run("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300)
    TIMINGS["compose down"] = time.monotonic() - started

    assert stack.labelled("ps -a") == [], "containers left after down"
    assert stack.labelled("network ls") == [], "networks left after down"
    assert stack.labelled("volume ls") == [], "volumes (the pki volume holds private keys) left after down"
    # psutil compares the create time too, so a reused pid is not mistaken for a survivor.
    left = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [f"{p.pid} {' '.join(p.cmdline())}" for p in left]
