"""motorctl and motor-controller as a user runs them: real processes, real gRPC."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import urllib.request

import pytest

from controller.limits import NR_OPEN_DEFAULT
from motor.ports import free_port
from motorctl.cluster_processes import script_path
from tests.support.controller_harness import EXAMPLE
from tests.support.controller_process import AT_ONCE, ControllerProcess, motorctl

pytestmark = pytest.mark.processes


def test_tables_and_json_against_a_live_controller(controller):
    address = controller.address
    table = motorctl(address, "instances").stdout
    assert table.splitlines()[0].split()[:3] == ["INSTANCE", "ROLE", "STATE"]
    assert "prefill-0" in table and "PENDING" in table and "no READY node is registered" in table
    assert "prefill-0/rank1" in table  # the engines table
    data = json.loads(motorctl(address, "--output", "json", "instances").stdout)
    states = {i["instance_id"]: i["state"] for i in data["instances"]}
    assert states == {"decode-0": "INSTANCE_STATE_PENDING", "prefill-0": "INSTANCE_STATE_PENDING"}
    assert json.loads(motorctl(address, "-o", "json", "nodes").stdout) == {}
    assert motorctl(address, "nodes").stdout.split()[:2] == ["NODE", "STATE"]
    assert json.loads(motorctl(address, "-o", "json", "endpoints", "--role", "prefill").stdout) == {}
    deployment = motorctl(address, "deployment").stdout
    assert "# revision 1" in deployment and "name: local-sim" in deployment
    events = motorctl(address, "events").stdout
    assert "DEPLOYMENT_CHANGED" in events and "deployment 'local-sim' applied (revision 1" in events
    assert motorctl(address, "events", "--deployment", "local-sim").stdout == events  # every event is its
    assert motorctl(address, "events", "--deployment", "other").stdout == ""
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{controller.metrics_port}/metrics", timeout=10).read().decode()
    assert 'motor_controller_instances{state="PENDING"} 2.0' in metrics
    assert "motor_controller_heartbeat_ingest_seconds_bucket" in metrics


def test_apply_and_delete(controller, tmp_path):
    address = controller.address
    assert "revision 1" in motorctl(address, "apply", "-f", EXAMPLE).stdout  # same spec, same revision
    changed = tmp_path / "changed.yaml"
    changed.write_text(
        open(EXAMPLE).read().replace("model: sim-tiny\n", "model: sim-other\n")
    )  # the deployment and its engines alike
    assert "revision 2" in motorctl(address, "apply", "-f", str(changed)).stdout
    follow = subprocess.Popen(
        [script_path("motorctl"), "--controller", address, "events", "--follow"], stdout=subprocess.PIPE, text=True
    )
    try:
        motorctl(address, "delete")
        lines = []
        while "deleted" not in "".join(lines):
            lines.append(follow.stdout.readline())
    finally:
        follow.terminate()
        follow.wait(timeout=10)
    result = motorctl(address, "deployment", check=False)
    assert result.returncode == 1 and "NOT_FOUND" in result.stderr and "motorctl apply -f" in result.stderr


def test_malformed_files_get_a_clear_error_and_change_nothing(controller, tmp_path):
    address = controller.address
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: x\ninstance_groups: [\n")
    result = motorctl(address, "apply", "-f", str(bad_yaml), check=False)
    assert result.returncode == 2 and "not valid YAML" in result.stderr
    bad_role = tmp_path / "role.yaml"
    bad_role.write_text(open(EXAMPLE).read().replace("role: decode", "role: decoder"))
    result = motorctl(address, "apply", "-f", str(bad_role), check=False)
    assert result.returncode == 2 and "decoder" in result.stderr.lower() and "instance_groups[1].role" in result.stderr
    bad_pair = tmp_path / "pair.yaml"
    bad_pair.write_text(open(EXAMPLE).read().replace("pair_with: decode", "pair_with: decod"))
    result = motorctl(address, "apply", "-f", str(bad_pair), check=False)
    assert result.returncode == 1 and "INVALID_ARGUMENT" in result.stderr
    assert "instance_groups[0].pair_with: 'decod' is not a group" in result.stderr
    missing = motorctl(address, "apply", "-f", str(tmp_path / "nope.yaml"), check=False)
    assert missing.returncode == 2 and "file not found" in missing.stderr
    # engine_config is free-form, but JSON: YAML's other keys and values were a traceback or
    # "Unexpected type" naming nothing (found by a hostile tester).
    where = "engine_config.motor_engine_prefill_config.engine_args"
    for odd, says in [
        ("      1: one\n", f"{where}: the key 1 is not a string; quote it"),
        ("      null: x\n", f"{where}: the key None is not a string; quote it"),
        ("      when: 2026-11-26\n", f"{where}.when: a date value (2026-11-26) is not JSON; quote it"),
        ("      huge: " + "9" * 400 + "\n", f"{where}.huge: a number too large to hold"),
        ("      s: !!set {a}\n", f"{where}.s: a set value"),
    ]:
        odd_file = tmp_path / "odd.yaml"
        odd_file.write_text(open(EXAMPLE).read().replace("      latency_ms: 5\n", odd + "      latency_ms: 5\n", 1))
        result = motorctl(address, "apply", "-f", str(odd_file), check=False)
        assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr, (
            odd,
            result.stderr,
        )
    assert "# revision 1" in motorctl(address, "deployment").stdout  # nothing changed


def test_restart_with_the_same_deployment_file_keeps_the_revision(tmp_path):
    proc = ControllerProcess(tmp_path, *AT_ONCE)
    try:
        proc.start()
        proc.stop()
        address = proc.start()
        assert "# revision 1" in motorctl(address, "deployment").stdout
    finally:
        proc.stop()
        proc.log.close()
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: m\ninstance_groups: [{name: u, role: union}]\n")
    result = subprocess.run(
        [
            script_path("motor-controller"),
            "--listen",
            "127.0.0.1:0",
            "--db",
            str(tmp_path / "o.db"),
            "--metrics-port",
            "0",
            "--deployment",
            str(bad),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "engine_config.motor_engine_union_config: required" in result.stderr


def test_unreachable_controller_is_said_plainly():
    result = motorctl(f"127.0.0.1:{free_port()}", "--timeout", "2", "nodes", check=False)
    assert result.returncode == 1 and "not reachable" in result.stderr


def test_render_status_shows_nodes_instances_and_engines(controller):
    import grpc as grpc_sync

    from motor.v1 import controller_pb2, controller_pb2_grpc
    from motorctl.render import render_status

    with grpc_sync.insecure_channel(controller.address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        screen = render_status(
            stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=10),
            stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=10),
        )
    sections = [line for line in screen.splitlines() if line in ("NODES", "INSTANCES", "ENGINES")]
    assert sections == ["NODES", "INSTANCES", "ENGINES"]
    assert "prefill-0/rank1" in screen and "PENDING" in screen


def test_the_controller_raises_its_open_file_limit_to_the_hard_one(tmp_path):
    """A socket per node: under the usual soft limit (1,024) a controller stopped accepting nodes
    past about a thousand, and gRPC only logged 'File descriptor limit reached. Retrying.'."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    proc = ControllerProcess(tmp_path, *AT_ONCE)
    proc.argv = ["bash", "-c", 'ulimit -Sn 256 && exec "$@"', "bash", *proc.argv]
    try:
        proc.start()
        limits = open(f"/proc/{proc.process.pid}/limits").read()
        soft_now, hard_now = re.search(r"Max open files\s+(\S+)\s+(\S+)", limits).groups()
        expected = str(NR_OPEN_DEFAULT if hard == resource.RLIM_INFINITY else hard)
        assert soft_now == expected and hard_now in (str(hard), "unlimited"), limits
        log = open(tmp_path / "controller.log").read()
        assert f"open files: soft limit raised from 256 to {expected}" in log and f"open-file limit {expected}" in log
    finally:
        proc.stop()
        proc.log.close()


def test_several_deployments_applied_listed_and_deleted_by_name(controller, tmp_path):
    """`apply -f A -f B` applies both in order; `deployments` lists every one; `delete NAME`
    deletes one and leaves the other; a bad name or a group another deployment has is refused,
    naming the field."""
    import yaml

    address = controller.address
    example = yaml.safe_load(open(EXAMPLE))
    files = []
    for name, group in (("chat", "chat"), ("embed", "embed")):
        spec = dict(
            example,
            name=name,
            model=f"sim-{name}",
            instance_groups=[{"name": group, "role": "union", "accelerators_per_engine": 0}],
            engine_config={"motor_engine_union_config": {"engine_type": "sim"}},
        )
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec))
        files.append(str(path))
    applied = motorctl(address, "apply", "-f", files[0], "-f", files[1]).stdout
    assert applied.splitlines() == ["deployment 'chat' applied (revision 1)", "deployment 'embed' applied (revision 1)"]
    rows = [line.split() for line in motorctl(address, "deployments").stdout.splitlines()]
    assert rows[0] == ["NAME", "MODEL", "REVISION", "INSTANCES", "READY", "PENDING", "SPARES", "ROLLOUT"]
    assert [r[:4] for r in rows[1:]] == [
        ["chat", "sim-chat", "1", "1"],
        ["embed", "sim-embed", "1", "1"],
        ["local-sim", "sim-tiny", "1", "2"],
    ]
    assert "name: chat" in motorctl(address, "deployment", "chat").stdout
    refused = motorctl(address, "deployment", check=False)
    assert refused.returncode == 1 and "name: required: 3 deployments exist" in refused.stderr
    thief = tmp_path / "thief.yaml"
    thief.write_text(yaml.safe_dump(dict(yaml.safe_load(open(files[1])), name="thief")))
    refused = motorctl(address, "apply", "-f", str(thief), check=False)
    assert (
        refused.returncode == 1
        and "instance_groups[0].name: 'embed' is a group of deployment 'embed'" in refused.stderr
    )
    assert (
        motorctl(address, "delete", "chat").stdout.strip() == "deployment chat deleted; its engines are being stopped"
    )
    refused = motorctl(address, "delete", "chat", check=False)
    assert (
        refused.returncode == 1 and "NOT_FOUND" in refused.stderr and "no deployment is named 'chat'" in refused.stderr
    )
    names = [line.split()[0] for line in motorctl(address, "deployments").stdout.splitlines()[1:]]
    assert names == ["embed", "local-sim"]
