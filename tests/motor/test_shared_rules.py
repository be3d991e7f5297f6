"""The shared rules of motor/: one id rule, one fan-out, one exit text, time helpers, defaults."""

from __future__ import annotations

import asyncio
import datetime
import logging
import pathlib

import pytest

from controller.rules.restart_policy import Policy, fill_defaults
from motor.contract import pbtime
from motor.contract.exits import describe_exit, describe_returncode
from motor.contract.names import check_id, check_instance_id, check_node_id, excerpt, parse_engine_id
from motor.errors import InvalidArgument, ResourceExhausted
from motor.service.fanout import FanOut
from motor.service.logs import LOG_LEVELS, check_log_level
from motor.service.tasks import TaskSet, cancel_and_wait, set_within
from motor.v1 import controller_pb2

# --- ids -----------------------------------------------------------------------------------


@pytest.mark.parametrize("good", ["node-a", "a", "0", "prefill-0", "x.y_z-1", "a" * 63])
def test_valid_ids_pass_every_check(good):
    assert check_node_id(good) == check_instance_id(good) == good


@pytest.mark.parametrize("bad", ["Node-A", "", "-a", ".a", "a b", "a/b", "a" * 64, "nl\n", "nul\x00", "a\n\n", "é"])
def test_invalid_ids_fail_with_the_rule_named(bad):
    with pytest.raises(InvalidArgument, match=r"node\.node_id .* must be 1-63 lowercase letters, digits"):
        check_id(bad, "node.node_id")


def test_engine_id_is_matched_whole():
    assert parse_engine_id("prefill-0/rank12") == ("prefill-0", 12)
    for bad in ("prefill-0/rank1\n", "prefill-0/rank1\x00", "Prefill-0/rank1", "prefill-0/rank", "prefill-0/rank١"):
        with pytest.raises(InvalidArgument, match="is not of the form '<instance_id>/rank<dp_rank>'"):
            parse_engine_id(bad)


def test_a_huge_value_is_not_echoed_whole():
    huge = "X" * 1_000_000
    with pytest.raises(InvalidArgument) as error:
        check_instance_id(huge)
    assert len(str(error.value)) < 300
    assert "(1000000 characters)" in str(error.value)
    with pytest.raises(InvalidArgument) as error:
        parse_engine_id(huge)
    assert len(str(error.value)) < 300
    assert excerpt("short") == "'short'"


def test_the_node_manager_config_uses_the_one_id_rule():
    from motor.errors import ConfigError
    from node_manager.cli import load_config

    assert load_config(["--node-id", "node-a"]).node_id == "node-a"
    for bad in ("Node-A", "nl\n"):
        with pytest.raises(ConfigError, match="node_id: must be 1-63 lowercase letters"):
            load_config(["--node-id", bad])


# --- log levels ----------------------------------------------------------------------------


def test_one_list_of_log_levels_everywhere():
    from controller.cli import parse_config
    from node_manager.cli import load_config

    assert check_log_level("critical") == "CRITICAL"
    assert set(LOG_LEVELS) == {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}
    assert parse_config(["--log-level", "critical"]).log_level == "CRITICAL"
    assert load_config(["--node-id", "n", "--log-level", "critical"]).log_level == "CRITICAL"
    with pytest.raises(ValueError, match="must be DEBUG, INFO, WARNING, ERROR or CRITICAL"):
        check_log_level("LOUD")


# --- fan-out -------------------------------------------------------------------------------


async def test_fanout_cuts_only_the_slow_subscriber_and_says_why():
    fanout: FanOut[int] = FanOut("WatchThings", limit=3)
    slow = fanout.subscribe(first=["snapshot"])
    fast = fanout.subscribe()
    received = []
    for i in range(5):
        fanout.publish(i)
        received.append(await fast.__anext__())  # the fast one keeps up
    assert received == [0, 1, 2, 3, 4]
    assert len(fanout) == 1  # the slow one was cut at once
    with pytest.raises(
        ResourceExhausted, match=r"WatchThings: subscriber too slow: more than 3 messages queued; reconnect"
    ):
        await slow.__anext__()
    with pytest.raises(ResourceExhausted):  # and stays ended
        await slow.__anext__()
    fast.close()
    assert len(fanout) == 0


async def test_fanout_close_ends_streams_normally():
    fanout: FanOut[int] = FanOut("WatchThings", limit=10)
    stream = fanout.subscribe(first=[0])
    fanout.publish(1)
    fanout.close()
    assert [item async for item in stream] == [0, 1]
    late = fanout.subscribe(first=[0])
    assert [item async for item in late] == []


async def test_a_slow_watch_stream_ends_with_resource_exhausted_over_grpc():
    """Through the real error mapping: the client sees the status code and the reason."""
    import grpc

    from motor.service.grpc_server import MotorServer

    fanout: FanOut[int] = FanOut("WatchEvents", limit=2)

    async def stream(request, context):
        async for item in fanout.subscribe():
            yield item

    handler = grpc.method_handlers_generic_handler(
        "test.Fan",
        {
            "Watch": grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=bytes, response_serializer=lambda n: bytes([n])
            )
        },
    )
    server = MotorServer("127.0.0.1:0")
    server.server.add_generic_rpc_handlers((handler,))
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/test.Fan/Watch", request_serializer=bytes, response_deserializer=bytes)(
                b"", timeout=30
            )
            while not len(fanout):  # the server has subscribed
                await asyncio.sleep(0.01)
            for i in range(3):
                fanout.publish(i)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in call:
                    pass
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "subscriber too slow: more than 2 messages queued; reconnect" in error.value.details()
    finally:
        await server.stop(0)


# --- exits, time, restart policy, tasks ----------------------------------------------------


def test_one_exit_description():
    assert describe_exit(signal=9) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(exit_code=0) == "exited with code 0"
    assert describe_exit() == "exited (exit code unknown)"
    assert describe_returncode(-15) == "killed by signal 15 (SIGTERM)"
    assert describe_returncode(3) == "exited with code 3"
    assert describe_exit(signal=200) == "killed by signal 200 (unknown)"


def test_protobuf_time_helpers_round_trip():
    assert pbtime.seconds(pbtime.duration(1.5)) == 1.5
    assert pbtime.duration(0.25).ToJsonString() == "0.250s"
    stamp = pbtime.timestamp(1_700_000_000.5)
    assert stamp.ToDatetime(datetime.UTC).timestamp() == 1_700_000_000.5
    assert pbtime.now().seconds > 1_700_000_000


def test_restart_policy_defaults_are_written_once():
    policy = controller_pb2.RestartPolicy()
    fill_defaults(policy)
    assert Policy.from_proto(policy) == Policy() == Policy.from_proto(controller_pb2.RestartPolicy())
    assert policy.scope == controller_pb2.RESTART_SCOPE_GROUP
    custom = controller_pb2.RestartPolicy(max_failures=2, scope=controller_pb2.RESTART_SCOPE_RANK)
    custom.initial_backoff.CopyFrom(pbtime.duration(3))
    fill_defaults(custom)
    assert Policy.from_proto(custom) == Policy(group_scope=False, initial_backoff=3.0, max_failures=2)


async def test_task_set_logs_a_failed_task_and_cancels_the_rest(caplog):
    tasks = TaskSet("tester")

    async def fail():
        raise RuntimeError("boom")

    tasks.spawn(fail(), name="failing")
    forever = tasks.spawn(asyncio.Event().wait(), name="waiting")
    with caplog.at_level(logging.ERROR):
        while len(tasks) > 1:
            await asyncio.sleep(0.01)
    assert "tester: background task failing failed" in caplog.text
    await tasks.cancel_all()
    assert forever.cancelled() and len(tasks) == 0


_IMPORT_SCAN = """
import ast, pathlib, sys
root = pathlib.Path(sys.argv[1])
for package in ("node_manager", "controller"):
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \\
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for m in modules:
                if m.split(".")[0] == "engine_server":
                    print(f"{path.relative_to(root)}: {m}")
"""


@pytest.mark.processes
def test_node_manager_and_controller_import_nothing_from_engine_server():
    """Shared contracts live in motor/: the other services never reach into the engine server."""
    import pathlib
    import subprocess
    import sys

    # A fresh interpreter: CPython 3.11's ast.parse can raise "AST constructor recursion depth
    # mismatch" in a process where an earlier test hit deep recursion (the fuzzing tests do).
    root = pathlib.Path(__file__).resolve().parents[2]
    scan = subprocess.run([sys.executable, "-c", _IMPORT_SCAN, str(root)], capture_output=True, text=True, timeout=60)
    assert scan.returncode == 0, scan.stderr
    assert scan.stdout == "", f"imports from engine_server:\n{scan.stdout}"


async def test_a_stop_ends_a_task_that_swallowed_its_cancel(caplog):
    """What Python 3.11's asyncio.wait_for does when its result lands with the cancel: the task
    goes on. cancel_and_wait cancels it again (with a warning) instead of waiting forever."""
    swallowed = []

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)

    task = asyncio.create_task(stubborn(), name="heartbeats")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING):
        await cancel_and_wait(task, owner="node manager", patience=0.1)
    assert task.cancelled() and swallowed
    assert "node manager: task heartbeats is still running 0.1s after its cancel: cancelling it again" in caplog.text


async def test_set_within_says_whether_the_event_came():
    event = asyncio.Event()
    assert not await set_within(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await set_within(event, 5)


def test_no_service_waits_with_asyncio_wait_for():
    """asyncio.wait_for drops a cancel that lands with its result on Python 3.11 (the CI hang
    above); the services use asyncio.timeout or motor.service.tasks.set_within instead."""
    root = pathlib.Path(__file__).resolve().parents[2]
    offenders = [
        f"{path.relative_to(root)}:{number}"
        for package in ("motor", "controller", "node_manager", "engine_server", "motorctl")
        for path in sorted((root / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "asyncio.wait_for(" in line
    ]
    assert not offenders, f"use asyncio.timeout instead of asyncio.wait_for in {offenders}"
