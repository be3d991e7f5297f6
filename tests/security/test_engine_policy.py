"""Nothing in a request chooses a program, code to load or a file on the node."""

from __future__ import annotations

import pytest

from motor.engine_policy import check_engine_config
from motor.errors import InvalidArgument

SECTION = "motor_engine_prefill_config"


def _config(**engine_args):
    return {SECTION: {"engine_type": "sglang", "engine_args": {"model_path": "Qwen/Qwen2-0.5B", **engine_args}}}


@pytest.mark.parametrize(
    "engine_args, key, says",
    [
        ({"launcher": ["/bin/sh", "-c", "id > /tmp/x"]}, "engine_args.launcher", "may not choose what runs"),
        ({"worker_extension_cls": "evil.Module"}, "engine_args.worker_extension_cls", "Python class"),
        ({"tool_parser_plugin": "plugin.py"}, "engine_args.tool_parser_plugin", "Python file"),
        ({"trust_remote_code": True}, "engine_args.trust_remote_code", "must be false"),
        ({"model_path": "/etc"}, "engine_args.model_path", "'/etc' is a local path outside"),
        ({"model_path": "~root/.ssh"}, "engine_args.model_path", "local path outside"),
        ({"model_path": "/models/../etc/passwd"}, "engine_args.model_path", "local path outside"),
        ({"extra_args": ["--chat-template=/etc/shadow"]}, "engine_args.extra_args[0]", "'/etc/shadow'"),
        ({"extra_args": ["--chat-template", "../../etc/shadow"]}, "engine_args.extra_args[1]", "local path outside"),
    ],
)
def test_program_code_and_outside_paths_are_refused_naming_the_key(engine_args, key, says, tmp_path):
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(_config(**engine_args), [str(tmp_path)], field="spec.config_json")
    assert f"spec.config_json.{SECTION}.{key}:" in str(refused.value) and says in str(refused.value)


def test_engine_tls_files_do_not_come_from_a_request():
    config = {SECTION: {"engine_type": "sim", "mgmt_tls_config": {"enable_tls": True, "cert_file": "/etc/ssl/x.pem"}}}
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(config, [])
    assert "mgmt_tls_config: not accepted in a request" in str(refused.value)


def test_model_names_and_paths_inside_the_model_roots_are_accepted(tmp_path):
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    check_engine_config(_config(model_path=str(model), trust_remote_code=False, tp_size=2), [str(tmp_path / "models")])
    check_engine_config(_config(served_model_name="org/name", extra_args=["--max-running-requests", "8"]), [])
    check_engine_config({SECTION: {"engine_type": "sim", "engine_args": {"model": "sim-tiny", "latency_ms": 5}}}, [])


def test_a_symlink_out_of_a_model_root_is_outside(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    (root / "escape").symlink_to("/etc")
    with pytest.raises(InvalidArgument):
        check_engine_config(_config(model_path=str(root / "escape")), [str(root)])
