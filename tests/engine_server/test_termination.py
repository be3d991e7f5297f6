"""The engine server's termination message: its own cause of exit, one JSON line, for every way
it ends (real processes with the sim engine; the vLLM tests check the engine-core death)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from motor.contract.termination import read_termination_message
from motor.v1 import types_pb2
from tests.support.engine_server_process import sim_config

NORMAL = types_pb2.HEALTH_STATUS_NORMAL


def start(engine_server, tmp_path, config):
    path = tmp_path / "termination-message"
    return engine_server(config, extra_args=("--termination-message-path", str(path))), str(path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
@pytest.mark.processes
def test_a_stop_signal_leaves_stopped_with_code_0_naming_the_signal(engine_server, tmp_path, sig):
    es, path = start(engine_server, tmp_path, sim_config(engine_args={"utilization": 1}))
    status = es.wait_status(NORMAL)
    # It states how long a SIGTERM may take: drain_timeout (default 30 s) plus its shutdown.
    assert status.stop_grace.ToNanoseconds() / 1e9 > 30.0
    assert read_termination_message(path) is None, "written only at the exit"
    os.kill(es.process.pid, sig)
    assert es.wait_exit() == 0
    message = read_termination_message(path)
    assert (message.exit_code, message.cause) == (0, "stopped") and "drained" in message.message, message
    assert message.message.startswith(f"{sig.name}: "), message  # a SIGHUP was told as SIGTERM


@pytest.mark.processes
def test_engine_death_leaves_the_cause_first(engine_server, tmp_path):
    es, path = start(
        engine_server, tmp_path, sim_config(engine_args={"utilization": 1, "faults": {"crash_after_s": 1.0}})
    )
    assert es.wait_exit() == 1
    message = read_termination_message(path)
    assert (message.exit_code, message.cause) == (1, "engine_died"), message
    assert message.message.startswith("the engine died: sim fault: crash"), message
    with open(path) as file:
        lines = file.read().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["cause"] == "engine_died", lines


@pytest.mark.processes
def test_a_bad_engine_arg_leaves_config_error_naming_the_field(engine_server, tmp_path):
    es, path = start(engine_server, tmp_path, sim_config(engine_args={"latency_ms": -5}))
    assert es.wait_exit() == 2
    message = read_termination_message(path)
    assert (message.exit_code, message.cause) == (2, "config_error"), message
    assert "motor_engine_prefill_config.engine_args.latency_ms" in message.message


def test_an_unreadable_message_is_no_message(tmp_path):
    broken = tmp_path / "broken"
    broken.write_text("not json\n")
    assert read_termination_message(str(broken)) is None
    assert read_termination_message(str(tmp_path / "missing")) is None
