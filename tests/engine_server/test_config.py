"""Every bad user_config value or flag stops engine_server with exit code 2 and names what to fix."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess

import pytest

from engine_server.config import load_section
from motor.errors import ConfigError
from tests.support.engine_server_process import ENGINE_SERVER

P = "motor_engine_prefill_config"
H = f"{P}.health_check_config"
GOOD = {
    P: {
        "engine_type": "sim",
        "engine_args": {"latency_ms": 1},
        "health_check_config": {"enable_virtual_inference": True},
        "mgmt_tls_config": {"enable_tls": False},
        "drain_timeout": 5,
    }
}


def _set(config: dict, dotted: str, value) -> dict:
    config = copy.deepcopy(config)
    *parents, last = dotted.split(".")
    node = config
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return config


# (field to set, bad value, text the error must contain)
BAD_VALUES = [
    (f"{H}.npu_usage_threshold", "5", f"{H}.npu_usage_threshold"),
    (f"{H}.enable_virtual_inference", "yes", f"{H}.enable_virtual_inference"),
    (f"{H}.health_collector_timeout", 0, f"{H}.health_collector_timeout"),
    (f"{H}.max_failure_count", 0, f"{H}.max_failure_count"),
    (f"{H}.max_failure_count", 2.5, f"{H}.max_failure_count"),
    (f"{H}.probe_interval", -1, f"{H}.probe_interval"),
    (f"{H}.busy_probe_interval", 0, f"{H}.busy_probe_interval"),
    (f"{H}.busy_utilization", 101, f"{H}.busy_utilization"),
    (f"{H}.probe_timeout", 0, f"{H}.probe_timeout"),
    (f"{H}.utilization_window", 0, f"{H}.utilization_window"),
    (f"{H}.utilization_sample_period", 0, f"{H}.utilization_sample_period"),
    (f"{H}.utilization_sample_period", 10, "must not exceed utilization_window"),
    (f"{H}.health_poll_interval", 0, f"{H}.health_poll_interval"),
    (f"{H}.probe_intervall", 5, f"{H}.probe_intervall: Extra inputs are not permitted"),
    (f"{P}.engine_type", "tensorrt", f"{P}.engine_type"),
    (f"{P}.drain_timeout", -1, f"{P}.drain_timeout"),
    (f"{P}.drian_timeout", 1, f"{P}.drian_timeout"),
    (f"{P}.mgmt_tls_config.enable_tls", "true", f"{P}.mgmt_tls_config.enable_tls"),
    (f"{P}.mgmt_tls_config.enable_tls", True, f"{P}.mgmt_tls_config.cert_file: required"),
    (f"{P}.mgmt_tls_config.cert", "x.pem", f"{P}.mgmt_tls_config.cert"),
    (f"{P}.engine_args.latency_ms", -5, f"{P}.engine_args.latency_ms"),
    (f"{P}.engine_args.faults.utilization", 150, f"{P}.engine_args.faults.utilization"),
    (f"{P}.engine_args.faults.crash", "yes", f"{P}.engine_args.faults.crash"),
    (f"{P}.engine_args.modle", "x", f"{P}.engine_args.modle"),
    ("motor_engine_prefil_config", {}, "motor_engine_prefil_config: Extra inputs are not permitted"),
    ("health_check_config", {}, "health_check_config: Extra inputs are not permitted"),
    # A section other than the one used is validated too.
    ("motor_engine_decode_config.engine_type", "gpu", "motor_engine_decode_config.engine_type"),
]


def run_engine_server(tmp_path, config, role="prefill", extra=(), env=None):
    path = tmp_path / "user_config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    args = [
        ENGINE_SERVER, "--dp-rank", "0", "--instance-id", "prefill-0", "--role", role, "--host", "127.0.0.1",
        "--port", "18080", "--mgmt-port", "18081", "--master-dp-ip", "127.0.0.1", "--config-path", str(path),
        "--log-dir", str(tmp_path / "logs"), *extra,
    ]  # fmt: skip
    return subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("field, value, expected", BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
@pytest.mark.processes
def test_bad_value_exits_2_naming_the_field(tmp_path, field, value, expected):
    result = run_engine_server(tmp_path, _set(GOOD, field, value))
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr


@pytest.mark.processes
def test_tls_file_that_cannot_be_read_is_named(tmp_path):
    config = _set(
        GOOD,
        f"{P}.mgmt_tls_config",
        {"enable_tls": True, "cert_file": str(tmp_path / "no.pem"), "key_file": str(tmp_path / "no.key")},
    )
    result = run_engine_server(tmp_path, config)
    assert result.returncode == 2
    assert f"{P}.mgmt_tls_config.cert_file: cannot read" in result.stderr


@pytest.mark.parametrize(
    "text, expected",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ("{}", f"{P}: missing; the prefill role needs"),
    ],
)
@pytest.mark.processes
def test_malformed_file_exits_2(tmp_path, text, expected):
    result = run_engine_server(tmp_path, text)
    assert result.returncode == 2 and expected in result.stderr


@pytest.mark.processes
def test_missing_section_for_the_role_is_named(tmp_path):
    result = run_engine_server(tmp_path, GOOD, role="decode")
    assert result.returncode == 2
    assert "motor_engine_decode_config: missing; the decode role needs this section" in result.stderr


@pytest.mark.parametrize(
    "change, expected",
    [
        (["--role", "router"], "--role: invalid choice"),
        (["--port", "70000"], "--port: 70000 is not within 1-65535"),
        (["--dp-rank", "-1"], "--dp-rank: -1 is negative"),
        (["--mgmt-port", "18080"], "--mgmt-port 18080 is the same port as --port"),
        (["--instance-id", "Prefill 0"], "--instance-id 'Prefill 0' must be"),
    ],
)
@pytest.mark.processes
def test_bad_flag_exits_2(tmp_path, change, expected):
    result = run_engine_server(tmp_path, GOOD, extra=change)
    assert result.returncode == 2 and expected in result.stderr


@pytest.mark.parametrize("cores, expected", [("1,x", "invalid literal"), ("4096", "Invalid argument")])
@pytest.mark.processes
def test_bad_cores_from_the_node_manager_exit_2_naming_the_variable(tmp_path, cores, expected):
    result = run_engine_server(tmp_path, GOOD, env={**os.environ, "MOTOR_ENGINE_CPUS": cores})
    assert result.returncode == 2, result.stderr
    assert f"MOTOR_ENGINE_CPUS={cores!r}: expected this host's CPU core numbers" in result.stderr
    assert expected in result.stderr


@pytest.mark.processes
def test_config_missing_file_exits_2(tmp_path):
    result = subprocess.run(
        [ENGINE_SERVER, "--dp-rank", "0", "--instance-id", "p", "--role", "prefill", "--host", "127.0.0.1",
         "--port", "18080", "--mgmt-port", "18081", "--master-dp-ip", "127.0.0.1",
         "--config-path", str(tmp_path / "absent.json"), "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "absent.json: file not found" in result.stderr


def test_defaults_follow_mindie_and_union_falls_back_to_prefill(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({P: {"engine_type": "sim"}}))
    name, section = load_section(str(path), "union")
    assert name == P
    health = section.health_check_config
    assert (health.enable_virtual_inference, health.max_failure_count, health.npu_usage_threshold) == (False, 6, 3)
    assert (health.health_collector_timeout, health.probe_interval, health.busy_probe_interval) == (2, 5, 20)
    assert (health.busy_utilization, health.probe_timeout, health.utilization_window) == (80, 5, 3)
    with pytest.raises(ConfigError, match="motor_engine_decode_config: missing"):
        load_section(str(path), "decode")


def test_union_uses_its_own_section_when_present(tmp_path):
    path = tmp_path / "c.json"
    union = {"engine_type": "sim", "drain_timeout": 7}
    path.write_text(json.dumps({P: {"engine_type": "sim"}, "motor_engine_union_config": union}))
    name, section = load_section(str(path), "union")
    assert name == "motor_engine_union_config" and section.drain_timeout == 7


def test_the_shipped_example_is_valid():
    from tests.support import REPO_ROOT

    for role in ("prefill", "decode", "union"):
        load_section(f"{REPO_ROOT}/examples/user_config.json", role)


def test_sections_of_other_components_are_set_aside_with_one_log_line(tmp_path, caplog):
    """A MindIE user_config holds the controller's and node manager's sections beside the engines'."""
    caplog.set_level(logging.INFO, logger="engine_server.config")
    mindie = {**GOOD, "motor_nodemanger_config": {"probe_interval": 3}, "motor_controller_config": {"x": [1]}}
    path = tmp_path / "mindie.json"
    path.write_text(json.dumps(mindie))
    name, section = load_section(str(path), "prefill")
    assert name == P and section.engine_type == "sim"
    lines = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert lines == [
        f"{path}: ignoring the sections of other components: motor_controller_config, motor_nodemanger_config"
    ]
    # The engine sections stay strict beside them.
    path.write_text(json.dumps(_set(mindie, f"{P}.drian_timeout", 1)))
    with pytest.raises(ConfigError, match=f"{P}.drian_timeout: Extra inputs are not permitted"):
        load_section(str(path), "prefill")


@pytest.mark.parametrize("threshold", [0, -5, 100.5])
def test_a_threshold_outside_mindies_range_turns_probing_off_with_a_warning(tmp_path, caplog, threshold):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_set(GOOD, f"{H}.npu_usage_threshold", threshold)))
    _, section = load_section(str(path), "prefill")
    assert section.health_check_config.enable_virtual_inference and not section.health_check_config.probing
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [f"{path}: {H}.npu_usage_threshold: {threshold:g} is outside 0 < npu_usage_threshold "
                        "<= 100: virtual inference is off"]  # fmt: skip


def test_a_threshold_above_busy_utilization_is_a_warning_not_a_refusal(tmp_path, caplog):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_set(GOOD, f"{H}.npu_usage_threshold", 90)))
    _, section = load_section(str(path), "prefill")
    assert section.health_check_config.probing
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{path}: {H}.npu_usage_threshold (90) exceeds busy_utilization (80): an engine between the two counts as "
        "idle yet is probed at busy_probe_interval"
    ]


@pytest.mark.processes
def test_an_engine_whose_threshold_turns_probing_off_is_never_probed(engine_server):
    from motor.v1 import types_pb2
    from tests.support.engine_server_process import sim_config

    es = engine_server(sim_config(engine_args={"utilization": 1}, health={"npu_usage_threshold": 0}))
    es.wait_status(types_pb2.HEALTH_STATUS_NORMAL)
    status = es.status()
    assert not status.probing and not status.HasField("last_probe")
    assert "npu_usage_threshold: 0 is outside 0 < npu_usage_threshold <= 100: virtual inference is off" in es.output
