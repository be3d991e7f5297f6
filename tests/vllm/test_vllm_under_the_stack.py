"""The whole stack with the real vLLM engine: a controller and a node manager (`motorctl up`'s
LocalCluster) running one vLLM engine server that ApplyDeployment asked for. End to end,
as an operator sees it through `motorctl` and the node manager's records:

- kill -9 of the engine core: ENGINE_FAILED whose reason gives the engine server's own cause of
  exit first (its termination message), the exit second, the log tail last; the engine server
  left no process of its tree for the node manager to kill; the controller restarts the engine;
- `motorctl delete` of the idle replacement: the controller's StopEngine deadline is the stop
  grace the engine stated (its drain_timeout plus vLLM's shutdown), and the engine ends by
  SIGTERM with exit code 0, never SIGKILL, leaving no process behind.

One cluster and two vLLM start-ups (the first engine and its replacement) for the module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import grpc
import psutil
import pytest

from motor.contract import pbtime
from motor.v1 import controller_pb2, node_manager_pb2, node_manager_pb2_grpc, types_pb2
from motorctl.local_cluster import LocalCluster
from tests.support import wait_for
from tests.support.vllm_engines import ENGINE, engine_core_of, vllm_cluster, vllm_config, wait_listed

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NODE = "vllm-a"
DRAIN_TIMEOUT = 10.0  # vllm_config's drain_timeout


@pytest.fixture(scope="module")
def stack(tiny_model, vllm_env, tmp_path_factory):
    """The cluster (engines inherit the node manager's environment: vLLM's offline settings),
    with the vLLM deployment applied and its engine listed for routers."""
    section = vllm_config(tiny_model)["motor_engine_prefill_config"]
    assert section["drain_timeout"] == DRAIN_TIMEOUT
    with vllm_cluster(
        tiny_model,
        vllm_env,
        str(tmp_path_factory.mktemp("vllm-stack")),
        section,
        lambda local, stub: wait_listed(stub),
        node_id_prefix="vllm",
        engine_port_base=37000,
    ) as (local, stub):
        yield local, stub


def engine_on_node(stub) -> types_pb2.Engine:
    nodes = stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes
    return next(e for n in nodes for e in n.engines if e.engine_id == ENGINE)


def motorctl(local: LocalCluster, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "motorctl.cli", "--controller", local.controller_address, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def engine_failed_events(local: LocalCluster) -> list[dict]:
    lines = motorctl(local, "--output", "json", "events").splitlines()
    events = [json.loads(line) for line in lines if line.strip()]
    return [e for e in events if e.get("type") == "EVENT_TYPE_ENGINE_FAILED" and e.get("engine_id") == ENGINE]


def test_engine_core_kill_fails_the_engine_with_its_own_cause_first_then_it_is_restarted(stack):
    local, stub = stack
    engine = engine_on_node(stub)
    core = engine_core_of(engine.pid)
    os.kill(core.pid, signal.SIGKILL)

    events = wait_for(
        lambda: engine_failed_events(local), timeout=60, interval=0.5, what="ENGINE_FAILED in motorctl events"
    )
    message = events[-1]["message"]
    # "engine prefill-0/rank0 on vllm-a the engine died: engine-core process ... SIGKILL ...;
    #  exited with code 1 without being asked to stop (while RUNNING); log: ..."
    assert message.startswith(f"engine {ENGINE} on {NODE} the engine died: "), message
    cause = message.index("the engine died")
    assert "SIGKILL" in message[cause : message.index("without being asked to stop")], message
    assert cause < message.index("exited with code 1 without being asked to stop") < message.index("; log: "), message
    # The engine server waited for (or killed) its whole tree before exiting: the node manager
    # found nothing left to kill. The controller starts a new copy (first restart at once).
    assert not psutil.pid_exists(engine.pid) or psutil.Process(engine.pid).status() == psutil.STATUS_ZOMBIE
    assert "leftover process(es)" not in open(local.process(NODE).log_path, encoding="utf-8", errors="replace").read()
    wait_listed(stub)
    assert engine_on_node(stub).pid != engine.pid


def test_delete_of_an_idle_vllm_engine_ends_by_sigterm_with_code_0_within_the_stated_grace(stack):
    local, stub = stack
    engine = engine_on_node(stub)
    stop_grace = pbtime.seconds(engine.stop_grace)
    # What the engine server asks for: its drain_timeout plus vLLM's shutdown (more than the
    # controller's default --stop-deadline of 5 s, which used to end every stop in SIGKILL).
    assert stop_grace > DRAIN_TIMEOUT, engine
    tree = [psutil.Process(engine.pid)] + psutil.Process(engine.pid).children(recursive=True)

    assert "deployment deleted" in motorctl(local, "delete")

    with grpc.insecure_channel(f"127.0.0.1:{local.node_ports[NODE]}") as channel:
        node = node_manager_pb2_grpc.NodeManagerServiceStub(channel)

        def stopped():
            engines = node.ListEngines(node_manager_pb2.ListEnginesRequest(), timeout=5).engines
            found = [e for e in engines if e.engine_id == ENGINE and e.spec.generation == engine.spec.generation]
            return found[0] if found and found[0].state == types_pb2.ENGINE_STATE_STOPPED else None

        record = wait_for(stopped, timeout=stop_grace + 60, interval=0.5, what=f"{ENGINE} STOPPED on the node")
    assert record.HasField("exit_code") and record.exit_code == 0 and not record.HasField("exit_signal"), record
    assert "exited with code 0" in record.state_reason and "after SIGTERM" in record.state_reason, record.state_reason
    log = open(local.process(NODE).log_path, encoding="utf-8", errors="replace").read()
    # The deadline came from the controller already covering the grace (the node manager did not
    # have to raise it), and nothing needed SIGKILL.
    assert f"SIGTERM, {stop_grace:g}s deadline" in log
    assert "raised to the engine's stop grace" not in log
    assert "SIGKILL after" not in log
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "left behind"
