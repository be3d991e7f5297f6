"""Supervising real engine servers (the simulated engine) with real signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import aiohttp
import grpc
import psutil
import pytest

from motor.v1 import node_manager_pb2, types_pb2
from tests.support import async_wait_for
from tests.support.node_manager_harness import alive, sim_config, spec

RUNNING, FAILED, STOPPED = types_pb2.ENGINE_STATE_RUNNING, types_pb2.ENGINE_STATE_FAILED, types_pb2.ENGINE_STATE_STOPPED


def children_of(engine) -> list[int] | None:
    """The pids a test engine printed on its `children ...` line, once it has."""
    for line in open(engine.log_path, encoding="utf-8"):
        if line.startswith("children "):
            return [int(v) for v in line.split()[1:]]
    return None


def tree_of(engine: types_pb2.Engine) -> list[int]:
    return [engine.pid] + [c.pid for c in psutil.Process(engine.pid).children(recursive=True)]


def _environ(pid: int) -> dict[bytes, bytes]:
    with open(f"/proc/{pid}/environ", "rb") as handle:
        return dict(item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item)


@pytest.mark.processes
async def test_start_reaches_running_and_stop_leaves_no_process(make_node):
    node = await make_node()
    engine = await node.start(accelerator_ids=[1, 2])
    assert engine.state == types_pb2.ENGINE_STATE_STARTING and engine.pid > 0
    assert engine.spec.port and engine.spec.mgmt_port and engine.spec.config_path.endswith("user_config.json")
    env = _environ(engine.pid)
    assert env[b"CUDA_VISIBLE_DEVICES"] == b"1,2" and env[b"ASCEND_RT_VISIBLE_DEVICES"] == b"1,2"
    assert os.getpgid(engine.pid) == engine.pid  # its own process group
    running = await node.wait_state("prefill-0/rank0", RUNNING)
    assert running.health == types_pb2.HEALTH_STATUS_NORMAL
    probed = await async_wait_for(lambda: _with_probe(node), timeout=20, what="a probe result from WatchProbes")
    assert probed.last_probe.outcome == types_pb2.PROBE_OUTCOME_SUCCESS

    pids = tree_of(running)
    stopped = await node.stop("prefill-0/rank0")
    assert stopped.state == STOPPED and "after SIGTERM" in stopped.state_reason
    assert stopped.exit_code == 0 and stopped.pid == 0
    assert not any(alive(pid) for pid in pids)
    # Idempotent: stopping again succeeds and changes nothing.
    again = await node.stop("prefill-0/rank0")
    assert again.state == STOPPED and again.state_changed_at == stopped.state_changed_at


@pytest.mark.processes
async def test_on_a_cpu_node_an_engine_is_bound_to_its_own_cores(make_node):
    core = max(os.sched_getaffinity(0))  # the last core this test may use
    node = await make_node(accelerator_type="cpu", accelerators=sorted({0, core}))
    engine = await node.start(accelerator_ids=[core])
    env = _environ(engine.pid)
    # vLLM's CPU build binds its OpenMP threads to these cores; no GPU variable is set.
    assert env[b"VLLM_CPU_OMP_THREADS_BIND"] == str(core).encode()
    assert b"CUDA_VISIBLE_DEVICES" not in env and b"ASCEND_RT_VISIBLE_DEVICES" not in env
    # The engine server binds its whole process (every thread, every child) before it starts anything.
    await async_wait_for(lambda: _threads_bound_to(engine.pid, {core}), what="the engine server bound to its core")
    await node.stop("prefill-0/rank0")


def _threads_bound_to(pid: int, cores: set[int]) -> bool:
    threads = psutil.Process(pid).threads()
    return len(threads) > 1 and all(os.sched_getaffinity(thread.id) == cores for thread in threads)


async def _with_probe(node):
    engine = await node.get("prefill-0/rank0")
    return engine if engine.HasField("last_probe") else None


@pytest.mark.processes
async def test_start_is_idempotent_and_a_different_spec_is_refused(make_node):
    node = await make_node()
    first = await node.start(accelerator_ids=[0])
    again = await node.start(accelerator_ids=[0])
    assert again.pid == first.pid and again.spec == first.spec
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await node.start(accelerator_ids=[3])
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "stop it first" in refused.value.details()
    assert alive(first.pid)
    await node.stop("prefill-0/rank0")
    # After a stop, a new generation starts a new process.
    replaced = await node.start(accelerator_ids=[0], generation=2)
    assert replaced.pid != first.pid and replaced.spec.generation == 2
    with pytest.raises(grpc.aio.AioRpcError) as stale:
        await node.stop("prefill-0/rank0")  # (stop it so that a stale start can be tried)
        await node.start(accelerator_ids=[0], generation=1)
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale" in stale.value.details()


@pytest.mark.processes
async def test_sigkill_is_noticed_recorded_and_reported(make_node, fake_controller):
    node = await make_node(controller=fake_controller.address)
    await async_wait_for(lambda: fake_controller.registrations, timeout=10)
    engine = await node.start()
    await node.wait_state("prefill-0/rank0", RUNNING)
    os.kill(engine.pid, signal.SIGKILL)
    failed = await node.wait_state("prefill-0/rank0", FAILED, timeout=10)
    assert failed.exit_signal == signal.SIGKILL and not failed.HasField("exit_code")
    assert "killed by signal 9 (SIGKILL) without being asked to stop" in failed.state_reason
    reports = await async_wait_for(
        lambda: any(r.engine.state == FAILED for r in fake_controller.reports) and list(fake_controller.reports),
        timeout=10,
    )
    # Routers first: the controller hears at once that the engine no longer serves (its endpoint
    # is removed), while the engine is still RUNNING for restart purposes (its tree is being
    # cleaned up); FAILED, which allows a replacement, only once the tree is gone. (A health poll
    # that met the dying engine may report its abnormal heartbeat in between.)
    notices = [i for i, r in enumerate(reports) if r.reason.startswith("engine server killed")]
    failures = [i for i, r in enumerate(reports) if r.engine.state == FAILED]
    assert notices and notices[0] < failures[0], [(r.engine.state, r.reason) for r in reports]
    notice, failure = reports[notices[0]], reports[failures[0]]
    assert notice.engine.engine_id == "prefill-0/rank0" and notice.engine.state == RUNNING
    assert notice.engine.health == types_pb2.HEALTH_STATUS_ABNORMAL
    assert notice.reason == "engine server killed by signal 9 (SIGKILL); ending its process tree"
    assert failure.engine.state == FAILED and "SIGKILL" in failure.reason
    beat = await async_wait_for(
        lambda: [h for h in fake_controller.heartbeats if h.engines and h.engines[0].state == FAILED], timeout=10
    )
    assert beat[0].node_id == "node-a"


@pytest.mark.processes
async def test_exit_zero_not_asked_for_is_a_failure(make_node):
    # Status checks of 1 s: with the fixture's 0.3 s, a loaded machine slowed the engine's own
    # shutdown past three checks and the health rule killed it first (a different, also right, verdict).
    node = await make_node(heartbeat_interval=1.0, status_timeout=1.0)
    engine = await node.start()
    await node.wait_state("prefill-0/rank0", RUNNING)
    # SIGTERM sent by someone else: the engine server drains and exits 0, which nobody asked for.
    os.kill(engine.pid, signal.SIGTERM)
    failed = await node.wait_state("prefill-0/rank0", FAILED, timeout=20)
    assert failed.exit_code == 0
    assert "exited with code 0 without being asked to stop" in failed.state_reason


@pytest.mark.processes
async def test_crash_during_startup_reports_the_exit_code_and_log(make_node):
    node = await make_node()
    bad = json.dumps({"motor_engine_prefill_config": {"engine_type": "sim", "engine_args": {"no_such_arg": 1}}})
    await node.start(config_json=bad)
    failed = await node.wait_state("prefill-0/rank0", FAILED, timeout=20)
    assert failed.exit_code == 2
    assert "while STARTING" in failed.state_reason and "no_such_arg" in failed.state_reason


@pytest.mark.processes
async def test_child_outliving_its_parent_is_killed(make_node, tmp_path):
    script = tmp_path / "engine_with_children.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "stay = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "escape = subprocess.Popen([sys.executable, '-c', 'import os, time; os.setsid(); time.sleep(600)'])\n"
        "print('children', stay.pid, escape.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    node = await make_node(engine_command=f"{sys.executable} {script}")
    engine = await node.start()

    pids = await async_wait_for(lambda: children_of(engine), timeout=20, what="the test engine's children")
    os.kill(engine.pid, signal.SIGKILL)
    failed = await node.wait_state("prefill-0/rank0", FAILED, timeout=10)
    assert failed.exit_signal == signal.SIGKILL
    await async_wait_for(lambda: not any(alive(pid) for pid in pids), timeout=10, what="children killed")


@pytest.mark.processes
async def test_short_pause_is_tolerated_and_a_hang_is_killed(make_node, fake_controller):
    # Real SIGSTOP/SIGCONT; every step waits on the engine's state, not on the wall clock. The
    # policy itself (the exact threshold, the bound in heartbeats) is tested on a fake clock in
    # test_kill_decision.py.
    interval, threshold = 0.5, 8
    node = await make_node(
        controller=fake_controller.address,
        heartbeat_interval=interval,
        status_timeout=interval,
        abnormal_threshold=threshold,
    )
    engine = await node.start()
    await node.wait_state("prefill-0/rank0", RUNNING)
    # A short pause: stopped until two heartbeats went unanswered, then resumed. The margin to the
    # threshold (6 heartbeats) covers this test's reaction and the engine's first probe after
    # SIGCONT, which may still fail.
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        paused = await async_wait_for(
            lambda: _consecutive_at_least(node, 2), timeout=30, what="two unanswered heartbeats"
        )
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    assert paused.state == RUNNING and paused.health_reason.startswith("no answer: GetStatus timed out")
    await async_wait_for(lambda: _consecutive_is_zero(node), timeout=30, what="health recovered after SIGCONT")
    engine = await node.get("prefill-0/rank0")
    assert engine.state == RUNNING and alive(engine.pid)

    # A hang: killed once `threshold` heartbeats in a row went unanswered (60 s only catches a hang).
    os.kill(engine.pid, signal.SIGSTOP)
    failed = await node.wait_state("prefill-0/rank0", FAILED, timeout=60)
    assert failed.state_reason.startswith(
        f"killed after {threshold} abnormal heartbeats: no answer: GetStatus timed out"
    )
    assert failed.exit_signal == signal.SIGKILL and not alive(engine.pid)
    report = await async_wait_for(lambda: _failure_reports(fake_controller), timeout=10)
    assert report[0].reason == failed.state_reason


def _failure_reports(fake_controller):
    return [r for r in fake_controller.reports if r.engine.state == FAILED]


async def _consecutive_at_least(node, count):
    engine = await node.get("prefill-0/rank0")
    return engine if engine.consecutive_abnormal >= count else None


async def _consecutive_is_zero(node):
    engine = await node.get("prefill-0/rank0")
    return engine.consecutive_abnormal == 0 and engine.health == types_pb2.HEALTH_STATUS_NORMAL


@pytest.mark.processes
async def test_failing_inference_with_green_health_is_killed_and_reported(make_node, fake_controller):
    node = await make_node(controller=fake_controller.address)
    engine = await node.start(config_json=sim_config(probe_interval=0.2, max_failure_count=2))
    await node.wait_state("prefill-0/rank0", RUNNING)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{engine.spec.port}/sim/faults", json={"fail_inference": True}) as r:
            assert r.status == 200
        async with http.get(f"http://127.0.0.1:{engine.spec.port}/health") as r:
            assert r.status == 200  # /health stays green
    failed = await node.wait_state("prefill-0/rank0", FAILED, timeout=60)
    assert failed.state_reason.startswith("killed after 3 abnormal heartbeats: ABNORMAL")
    assert failed.exit_signal == signal.SIGKILL and not alive(engine.pid)
    report = await async_wait_for(lambda: _failure_reports(fake_controller), timeout=10)
    assert report[0].engine.recent_probes
    assert any(p.outcome == types_pb2.PROBE_OUTCOME_FAILURE for p in report[0].engine.recent_probes)


@pytest.mark.processes
async def test_watch_engines_sends_a_snapshot_then_every_change(make_node):
    node = await make_node()
    await node.start(instance_id="decode-0", role=types_pb2.ROLE_DECODE, config_json=sim_config("decode"))
    seen: list[node_manager_pb2.WatchEnginesResponse] = []

    async def follow():
        async for message in node.stub.WatchEngines(node_manager_pb2.WatchEnginesRequest()):
            seen.append(message)

    task = asyncio.create_task(follow())
    try:
        await async_wait_for(lambda: any(m.engine.state == RUNNING for m in seen), timeout=30)
        await node.stop("decode-0/rank0")
        await async_wait_for(lambda: any(m.engine.state == STOPPED for m in seen), timeout=10)
    finally:
        task.cancel()
    assert seen[0].snapshot and seen[0].engine.engine_id == "decode-0/rank0"
    states = [m.engine.state for m in seen if not m.snapshot]
    assert types_pb2.ENGINE_STATE_STOPPING in states and states[-1] == STOPPED


@pytest.mark.parametrize(
    "fields, code, words",
    [
        (dict(role=types_pb2.ROLE_UNSPECIFIED), grpc.StatusCode.INVALID_ARGUMENT, "spec.role"),
        (dict(instance_id="Bad Id!"), grpc.StatusCode.INVALID_ARGUMENT, "spec.instance_id"),
        (dict(dp_rank=100000), grpc.StatusCode.INVALID_ARGUMENT, "spec.dp_rank"),
        (dict(accelerator_ids=[7]), grpc.StatusCode.FAILED_PRECONDITION, "not on node node-a"),
        (dict(accelerator_ids=[0]), grpc.StatusCode.FAILED_PRECONDITION, "in use by ['prefill-0/rank0']"),
        (
            dict(config_json="", config_path="/etc/passwd"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "a request may name only files under the node's state directory",
        ),
        (
            dict(config_json="", config_path="{state_dir}/missing.json"),
            grpc.StatusCode.FAILED_PRECONDITION,
            "no such file",
        ),
        (dict(config_json="{not json"), grpc.StatusCode.INVALID_ARGUMENT, "spec.config_json"),
        (dict(port=70000), grpc.StatusCode.INVALID_ARGUMENT, "spec.port"),
        (dict(port="busy"), grpc.StatusCode.FAILED_PRECONDITION, "already in use"),
        (dict(port="running"), grpc.StatusCode.FAILED_PRECONDITION, "in use by engine prefill-0/rank0"),
    ],
)
@pytest.mark.processes
async def test_bad_start_requests_get_clear_errors_and_disturb_nothing(make_node, fields, code, words):
    node = await make_node()
    running = await node.start(accelerator_ids=[0])
    fields = dict(fields)
    if fields.get("port") == "busy":
        import socket

        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        fields["port"] = busy.getsockname()[1]
    elif fields.get("port") == "running":
        fields["port"] = running.spec.port
    if "config_path" in fields:
        fields["config_path"] = fields["config_path"].format(state_dir=node.server.config.state_dir)
    request = spec(instance_id=fields.pop("instance_id", "other-0"), **fields)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await node.stub.StartEngine(node_manager_pb2.StartEngineRequest(spec=request))
    assert error.value.code() == code and words in error.value.details()
    engine = await node.get("prefill-0/rank0")
    assert engine.pid == running.pid and alive(running.pid)
    assert [e.engine_id for e in (await node.stub.ListEngines(node_manager_pb2.ListEnginesRequest())).engines] == [
        "prefill-0/rank0"
    ]


@pytest.mark.parametrize(
    "content, words",
    [
        (
            json.dumps(
                {
                    "motor_engine_prefill_config": {
                        "engine_type": "sglang",
                        "engine_args": {"launcher": ["/bin/sh", "-c", "id"]},
                    }
                }
            ),
            "spec.config_path.motor_engine_prefill_config.engine_args.launcher: names",
        ),
        ("not json", "spec.config_path is not a JSON object"),
    ],
)
async def test_a_config_path_file_is_checked_like_config_json(make_node, content, words):
    """A file in the state directory (where engine logs and records live too) is held to the
    rules a request's config_json is: no key that chooses a program, JSON only."""
    node = await make_node()
    path = os.path.join(node.server.config.state_dir, "evil.json")
    with open(path, "w") as handle:
        handle.write(content)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await node.stub.StartEngine(node_manager_pb2.StartEngineRequest(spec=spec(config_json="", config_path=path)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details().startswith(words), (
        error.value.details()
    )
    assert not (await node.stub.ListEngines(node_manager_pb2.ListEnginesRequest())).engines


async def test_bad_stop_and_get_requests(make_node):
    node = await make_node()
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await node.stop("nothing-0/rank0")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "not known on node node-a" in unknown.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as malformed:
        await node.get("no-rank")
    assert (
        malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "<instance_id>/rank<dp_rank>" in malformed.value.details()
    )


@pytest.mark.processes
async def test_config_path_given_is_passed_and_the_engine_runs_in_its_own_directory(make_node, tmp_path, monkeypatch):
    node = await make_node()
    (tmp_path / "node-a" / "user_config.json").write_text(
        sim_config("decode")
    )  # a file the node's admin put in its state dir
    monkeypatch.chdir(tmp_path / "node-a")  # a relative path, as a user types it
    engine = await node.start(instance_id="decode-0", role=types_pb2.ROLE_DECODE, config_path="user_config.json")
    assert engine.spec.config_path == str(tmp_path / "node-a" / "user_config.json")
    assert "--config-path " + str(tmp_path / "node-a" / "user_config.json") in " ".join(
        psutil.Process(engine.pid).cmdline()
    )
    assert psutil.Process(engine.pid).cwd() == str(tmp_path / "node-a" / "engines" / "decode-0_rank0")
    again = await node.start(instance_id="decode-0", role=types_pb2.ROLE_DECODE, config_path="user_config.json")
    assert again.pid == engine.pid
    await node.wait_state("decode-0/rank0", RUNNING)


@pytest.mark.processes
async def test_stop_kills_children_that_ignore_sigterm_after_the_deadline(make_node, tmp_path):
    script = tmp_path / "engine_with_stubborn_child.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "code = ('import os, signal, time; os.setsid(); signal.signal(signal.SIGTERM, signal.SIG_IGN); '\n"
        "        'print(\"child-ready\", flush=True); time.sleep(600)')\n"
        "child = subprocess.Popen([sys.executable, '-c', code])\n"
        "print('children', child.pid, flush=True)\n"
        "time.sleep(600)\n"  # the parent itself dies of SIGTERM at once
    )
    node = await make_node(engine_command=f"{sys.executable} {script}")
    engine = await node.start()

    (child,) = await async_wait_for(lambda: children_of(engine), timeout=20, what="the test engine's child")
    await async_wait_for(
        lambda: "child-ready" in open(engine.log_path, encoding="utf-8").read().splitlines(),
        timeout=20,
        what="the child ignoring SIGTERM",
    )
    stopped = await node.stop("prefill-0/rank0", deadline=duration(1.0))
    assert stopped.state == STOPPED and "SIGKILL after the 1s deadline" in stopped.state_reason
    assert stopped.exit_signal == signal.SIGTERM  # the engine server itself went on SIGTERM
    assert not alive(engine.pid) and not alive(child)


def duration(seconds: float):
    from google.protobuf.duration_pb2 import Duration

    value = Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


@pytest.mark.processes
async def test_init_is_allowed_during_the_startup_grace_then_counts(make_node):
    # The grace outlasts the sim engine server's own start (about 5 s on a loaded machine), so
    # that it answers INIT within the grace.
    node = await make_node(startup_grace=10.0)
    # The sim engine's /health answers 503 "loading" for a minute: its engine server says INIT.
    loading = await node.start(config_json=sim_config(startup_delay_s=60))
    await async_wait_for(lambda: _health_is(node, types_pb2.HEALTH_STATUS_INIT), timeout=20, what="INIT")
    engine = await node.get("prefill-0/rank0")
    assert engine.state == types_pb2.ENGINE_STATE_STARTING and engine.consecutive_abnormal == 0
    failed = await node.wait_state("prefill-0/rank0", FAILED, timeout=30)
    assert failed.state_reason.startswith("killed after 3 abnormal heartbeats: still INIT after the 10s start-up grace")
    assert not alive(loading.pid)


async def _health_is(node, health):
    return (await node.get("prefill-0/rank0")).health == health
