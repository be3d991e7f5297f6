"""SGLang backend: argument mapping, and the child-process life cycle with a stand-in launcher.

SGLang itself is not installed here; `tests/support/fake_sglang.py` takes its place as the launched command."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import urllib.error
import urllib.request

import psutil
import pytest

from engine_server.engines.base import EngineOptions
from engine_server.engines.sglang import SglangArgs, SglangEngine, sglang_command
from motor.engine_key import ENGINE_KEY_ENV, authorization
from motor.errors import ConfigError
from motor.v1 import types_pb2
from tests.support import process_alive, wait_for
from tests.support.fake_sglang import SCRIPT, sglang_parser

FAKE = [sys.executable, SCRIPT]
NORMAL = types_pb2.HEALTH_STATUS_NORMAL


def options(role="prefill", **kwargs):
    base = dict(role=role, instance_id="p", dp_rank=0, host="10.0.0.5", port=8000, master_dp_ip="10.0.0.1")
    return EngineOptions(**{**base, **kwargs})


def fullest(**kwargs) -> SglangArgs:
    """Every mapped field of SglangArgs set (a Qwen on two GPUs), with `kwargs` on top."""
    base = dict(
        model_path="/models/qwen",
        served_model_name="qwen",
        tp_size=2,
        mem_fraction_static=0.8,
        context_length=4096,
        trust_remote_code=True,
    )
    return SglangArgs(**{**base, **kwargs})


def test_argument_mapping_prefill_single_container():
    args = fullest(transfer_backend="mooncake", extra_args=["--log-level", "warning"], launcher=["sglang-launch"])
    command = sglang_command(args, options(kv_port=9100, dp_rpc_port=9200))
    assert command == [
        "sglang-launch", "--model-path", "/models/qwen", "--host", "10.0.0.5", "--port", "8000",
        "--served-model-name", "qwen", "--tp-size", "2", "--mem-fraction-static", "0.8", "--context-length", "4096",
        "--trust-remote-code", "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake",
        "--disaggregation-bootstrap-port", "9100", "--dist-init-addr", "10.0.0.1:9200", "--enable-metrics",
        "--log-level", "warning",
    ]  # fmt: skip


def test_every_mapped_flag_is_one_sglang_knows():
    """Each flag of the fullest mapping parses with SGLang's flag names and types (the stand-in's
    strict parser), to the values given."""
    args = fullest(transfer_backend="nixl", launcher=["x"])
    parsed = sglang_parser().parse_args(sglang_command(args, options(kv_port=9100, dp_rpc_port=9200))[1:])
    assert vars(parsed) == {
        "model_path": "/models/qwen", "host": "10.0.0.5", "port": 8000, "served_model_name": "qwen", "tp_size": 2,
        "mem_fraction_static": 0.8, "context_length": 4096, "trust_remote_code": True,
        "disaggregation_mode": "prefill", "disaggregation_transfer_backend": "nixl",
        "disaggregation_bootstrap_port": 9100, "dist_init_addr": "10.0.0.1:9200", "enable_metrics": True,
        "log_level": None, "api_key": None,
    }  # fmt: skip
    decode = sglang_parser().parse_args(sglang_command(SglangArgs(model_path="m"), options("decode"))[3:])
    assert decode.disaggregation_mode == "decode" and decode.enable_metrics


@pytest.mark.parametrize("flag", ["--disagregation-mode", "--tp", "--tensor-parallel"])
def test_the_stand_in_rejects_flags_sglang_does_not_have(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        sglang_parser().parse_args(["--model-path", "m", "--host", "h", "--port", "1", flag, "2"])
    assert exit_.value.code == 2 and flag in capsys.readouterr().err


def test_argument_mapping_decode_and_union():
    args = SglangArgs(model_path="m")
    decode = sglang_command(args, options("decode", kv_port=9100))
    assert decode[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert decode[3:] == ["--model-path", "m", "--host", "10.0.0.5", "--port", "8000",
                          "--disaggregation-mode", "decode", "--enable-metrics"]  # fmt: skip
    union = sglang_command(args, options("union"))
    assert "--disaggregation-mode" not in union


@pytest.mark.parametrize(
    "engine_args, field",
    [({}, "model_path"), ({"model_path": "m", "tp_size": 0}, "tp_size"), ({"model_path": "m", "tp": 2}, "tp"),
     ({"model_path": "m", "extra_args": "--x"}, "extra_args")],
)  # fmt: skip
def test_bad_engine_args_are_named(engine_args, field):
    with pytest.raises(ConfigError, match=rf"motor_engine_decode_config\.engine_args\.{field}"):
        SglangEngine.check_args(engine_args, "motor_engine_decode_config.engine_args")


@pytest.fixture
def sglang_server(engine_server, tmp_path, monkeypatch):
    def start(ignore_term=False, stop_timeout=10.0, role="prefill", **section):
        monkeypatch.setenv("FAKE_SGLANG_STATE", str(tmp_path))
        monkeypatch.setenv("FAKE_SGLANG_IGNORE_TERM", "1" if ignore_term else "0")
        config = {
            f"motor_engine_{role}_config": {
                "engine_type": "sglang",
                "engine_args": {"model_path": "/models/fake", "launcher": FAKE, "stop_timeout": stop_timeout},
                "health_check_config": {"enable_virtual_inference": True, "probe_interval": 0.3,
                                        "utilization_window": 0.1, "utilization_sample_period": 0.05},
                **section,
            }
        }  # fmt: skip
        es = engine_server(config, role=role, extra_args=["--kv-port", "9999"])
        launch_file = tmp_path / "launch.json"
        launch = wait_for(lambda: launch_file.exists() and json.loads(launch_file.read_text()), timeout=30,
                          what="the launcher to start")  # fmt: skip
        return es, launch

    return start


@pytest.mark.processes
def test_sglang_child_is_launched_probed_and_stopped_with_its_group(sglang_server):
    es, launch = sglang_server()
    assert launch["argv"][:6] == ["--model-path", "/models/fake", "--host", "127.0.0.1", "--port", str(es.port)]
    assert "--disaggregation-bootstrap-port" in launch["argv"] and "9999" in launch["argv"]
    assert launch["pgid"] == launch["pid"] != os.getpgid(es.process.pid)  # its own process group
    assert launch["ppid"] == es.process.pid
    es.wait_status(NORMAL)
    wait_for(lambda: es.status().last_probe.outcome == types_pb2.PROBE_OUTCOME_SUCCESS, timeout=15, what="a probe")
    os.kill(es.process.pid, signal.SIGTERM)
    assert es.wait_exit(timeout=30) == 0
    for pid in (launch["pid"], launch["worker_pid"]):
        wait_for(lambda: not process_alive(pid), timeout=10, what=f"process {pid} gone")


@pytest.mark.processes
def test_sglang_that_ignores_sigterm_is_killed_after_stop_timeout(sglang_server):
    es, launch = sglang_server(ignore_term=True, stop_timeout=0.5)
    es.wait_status(NORMAL)
    os.kill(es.process.pid, signal.SIGTERM)
    assert es.wait_exit(timeout=30) == 0
    assert "did not stop within 0.5s of SIGTERM" in es.output
    wait_for(lambda: not process_alive(launch["pid"]), timeout=10, what="SGLang killed")


@pytest.mark.processes
def test_sglang_death_makes_the_engine_server_exit_non_zero(sglang_server):
    es, launch = sglang_server()
    es.wait_status(NORMAL)
    os.kill(launch["pid"], signal.SIGKILL)
    assert es.wait_exit(timeout=10) == 1
    assert "SGLang killed by signal 9 (SIGKILL)" in es.output


@pytest.mark.processes
def test_killed_engine_server_takes_sglang_with_it(sglang_server):
    es, launch = sglang_server()
    es.wait_status(NORMAL)
    es.process.kill()  # SIGKILL of the engine server alone (not its group): no clean-up code runs
    es.process.wait(timeout=10)
    wait_for(lambda: not process_alive(launch["pid"]), timeout=10, what="SGLang gone with its parent")
    try:
        os.killpg(launch["pgid"], signal.SIGKILL)  # its worker is SGLang's own business; tidy up here
    except ProcessLookupError:
        pass


@pytest.mark.processes
@pytest.mark.parametrize("usage_stats", [None, True])
def test_engines_do_not_phone_home_unless_the_section_asks(sglang_server, monkeypatch, usage_stats):
    """Air-gapped fleets: the engine's own processes see VLLM_NO_USAGE_STATS=1 and DO_NOT_TRACK=1."""
    for name in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
        monkeypatch.delenv(name, raising=False)
    es, launch = sglang_server(**({} if usage_stats is None else {"usage_stats": usage_stats}))
    environ = psutil.Process(launch["pid"]).environ()
    told = {name: environ.get(name) for name in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK")}
    if usage_stats:
        assert told == {"VLLM_NO_USAGE_STATS": None, "DO_NOT_TRACK": None}
    else:
        assert told == {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@pytest.mark.processes
def test_sglang_takes_the_engines_key_from_a_private_file_never_the_command_line(sglang_server, monkeypatch):
    """With the engines' key set, SGLang itself answers 401 to a caller without it (the stand-in
    checks only the api_key SGLang would have been given), the engine server's probes carry it,
    the key is on no command line, and its file (0600) is gone once SGLang has stopped."""
    key = "sk-motor-engine-test-" + "k" * 20
    monkeypatch.setenv(ENGINE_KEY_ENV, key)
    es, launch = sglang_server()
    argv = launch["argv"]
    assert not [arg for arg in argv if key in arg], argv
    held = argv[argv.index("--config") + 1]
    assert stat.S_IMODE(os.stat(held).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(held)).st_mode) == 0o700
    assert all(key not in " ".join(psutil.Process(pid).cmdline()) for pid in (launch["pid"], es.process.pid))
    es.wait_status(NORMAL)
    wait_for(lambda: es.status().last_probe.outcome == types_pb2.PROBE_OUTCOME_SUCCESS, timeout=15, what="a probe")

    def models(headers: dict) -> int:
        request = urllib.request.Request(f"http://127.0.0.1:{es.port}/v1/models", headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=10).status
        except urllib.error.HTTPError as refused:
            return refused.code

    assert [models({}), models({"Authorization": "Bearer wrong"}), models(authorization(key))] == [401, 401, 200]
    os.kill(es.process.pid, signal.SIGTERM)
    assert es.wait_exit(timeout=30) == 0
    assert not os.path.exists(os.path.dirname(held))
