"""The Go and JavaScript example clients, built from proto/ and run against a live cluster.

For each client: build it (protoc + Go offline; npm packages from the lockfile), start a real
controller and two node managers (subprocesses, as `make run` starts them), then with the client
alone: apply the example deployment, list nodes and instances until every engine is NORMAL,
follow WatchEvents and see the failure of an engine that the test kills with SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from motor.ports import free_port
from motorctl.local_cluster import LocalCluster
from tests.support import wait_for
from tests.support.client_builds import BUILDERS, DEPLOYMENT_JSON

EXPECTED_ENGINES = {"prefill-0/rank0", "prefill-0/rank1", "decode-0/rank0"}


class Client:
    """Runs one example client against the cluster's controller, as a user would."""

    def __init__(self, argv: list[str], address: str):
        self.argv = argv
        self.address = address

    def flag(self, name: str) -> str:
        """Go's flag package spells flags -name, Node's parseArgs --name."""
        return f"-{name}" if self.argv[0].endswith("motor-go-client") else f"--{name}"

    def command(self, *args: str) -> list[str]:
        return [*self.argv, self.flag("addr"), self.address, *args]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(self.command(*args), capture_output=True, text=True, timeout=60)
        if check:
            assert result.returncode == 0, (
                f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
            )
        return result

    def json(self, *args: str) -> dict:
        return json.loads(self.run(self.flag("json"), *args).stdout)


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def client(request, tmp_path_factory):
    argv = BUILDERS[request.param]()
    cluster = LocalCluster(
        str(tmp_path_factory.mktemp(f"cluster-{request.param}")),
        nodes=2,
        controller_port=free_port(),
        heartbeat_interval=0.5,
    )
    try:
        cluster.start(timeout=90)
        yield Client(argv, cluster.controller_address)
    finally:
        problems = cluster.stop()
        assert not problems, problems


def _engines(instances: dict) -> dict[str, dict]:
    return {e["engine_id"]: e for i in instances.get("instances", []) for e in i.get("engines", [])}


def test_lists_the_registered_nodes(client):
    nodes = client.json("nodes")["nodes"]
    assert [n["info"]["node_id"] for n in nodes] == ["node-a", "node-b"]
    assert all(n["state"] == "NODE_STATE_READY" for n in nodes)
    table = client.run("nodes").stdout.splitlines()
    assert table[0].split() == ["NODE", "STATE", "ADDRESS", "ENGINES", "REASON"]
    assert [row.split()[:2] for row in table[1:]] == [["node-a", "READY"], ["node-b", "READY"]]


def _wait_all_normal(client) -> None:
    def all_normal():
        engines = _engines(client.json("instances"))
        return set(engines) == EXPECTED_ENGINES and all(
            e.get("health") == "HEALTH_STATUS_NORMAL" for e in engines.values()
        )

    wait_for(all_normal, timeout=120, interval=1.0, what="the three engines NORMAL, seen by the client")


@pytest.fixture
def deployed(client):
    """The example deployment applied with the client (idempotent) and all its engines NORMAL."""
    client.run("apply", DEPLOYMENT_JSON)
    _wait_all_normal(client)
    return client


def test_applies_a_deployment_and_lists_its_instances(client):
    result = client.run("apply", DEPLOYMENT_JSON)
    assert 'applied deployment "local-sim", revision' in result.stdout, result.stdout
    _wait_all_normal(client)
    instances = {i["instance_id"]: i for i in client.json("instances")["instances"]}
    assert instances["prefill-0"]["role"] == "ROLE_PREFILL" and instances["decode-0"]["role"] == "ROLE_DECODE"
    table = client.run("instances").stdout
    assert "prefill-0" in table and "decode-0/rank0" in table and "NORMAL" in table, table

    # Applying the same deployment again changes nothing (same revision).
    again = client.run("apply", DEPLOYMENT_JSON).stdout
    assert again.split("revision")[-1] == result.stdout.split("revision")[-1], (result.stdout, again)


def test_watch_events_shows_an_engine_killed_with_sigkill(deployed):
    client = deployed
    engines = {e["engine_id"]: e for n in client.json("nodes")["nodes"] for e in n.get("engines", [])}
    victim = engines.get("decode-0/rank0")
    assert victim and victim.get("pid"), f"decode-0/rank0 has no pid in ListNodes: {engines}"

    process = subprocess.Popen(
        client.command(client.flag("json"), "watch", client.flag("until"), "EVENT_TYPE_ENGINE_FAILED"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        first = json.loads(process.stdout.readline())  # the snapshot comes first, at once
        assert "snapshot" in first, first
        assert {n["info"]["node_id"] for n in first["snapshot"]["nodes"]} == {"node-a", "node-b"}
        os.kill(int(victim["pid"]), signal.SIGKILL)
        out, err = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, err
    events = [json.loads(line)["event"] for line in out.splitlines() if line.strip()]
    failure = events[-1]
    assert failure["type"] == "EVENT_TYPE_ENGINE_FAILED", events
    assert failure["engine_id"] == "decode-0/rank0", failure
    assert "signal 9" in failure["message"] or "SIGKILL" in failure["message"], failure["message"]

    # The text form of the same stream, as a person reads it: the snapshot line comes first.
    process = subprocess.Popen(
        client.command("watch"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    try:
        line = process.stdout.readline()
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert line.startswith("snapshot: 2 nodes, 2 instances"), line


def test_bad_input_gets_an_error_naming_what_to_fix(deployed, tmp_path):
    client = deployed
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "instance_groups": [{"name": "p", "role": "ROLE_PREFIL"}]}))
    result = client.run("apply", str(bad), check=False)
    assert result.returncode == 1
    assert "ROLE_PREFIL" in result.stderr, result.stderr

    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"name": "x", "instance_group": []}))
    result = client.run("apply", str(unknown), check=False)
    assert result.returncode == 1 and "instance_group" in result.stderr, result.stderr

    # Valid JSON the controller refuses: its INVALID_ARGUMENT message reaches the user.
    invalid = tmp_path / "invalid.json"
    invalid.write_text(
        json.dumps({"name": "x", "instance_groups": [{"name": "p", "role": "ROLE_PREFILL", "pair_with": "nowhere"}]})
    )
    result = client.run("apply", str(invalid), check=False)
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr.upper().replace("INVALIDARGUMENT", "INVALID_ARGUMENT"), result.stderr
    assert "nowhere" in result.stderr, result.stderr

    # Nothing running was disturbed: the deployment is still the example one, its engines up.
    engines = _engines(client.json("instances"))
    assert set(engines) == EXPECTED_ENGINES
