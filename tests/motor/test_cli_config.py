"""One way from command line and --config file to settings (motor/service/cli_config.py), for all three
services: errors name the setting, flags win over the file, help shows the model's real default."""

from __future__ import annotations

import pytest

from controller.cli import FLAGS as CONTROLLER_FLAGS
from controller.cli import parse_config
from controller.config import ControllerConfig
from engine_server.cli import FLAGS as ENGINE_FLAGS
from engine_server.cli import EngineServerArgs, build_parser
from motor.errors import ConfigError
from motor.service.cli_config import default_text, flag_name, settings_parser
from node_manager.cli import FLAGS as NODE_FLAGS
from node_manager.cli import load_config, parser
from node_manager.config import NodeManagerConfig


def test_a_bad_flag_value_names_the_setting():
    with pytest.raises(
        ConfigError, match=r"command line: heartbeat_interval: Input should be a valid number.*\(got 'abc'\)"
    ):
        load_config(["--node-id", "n", "--heartbeat-interval", "abc"])
    with pytest.raises(ConfigError, match=r"command line: node_grace: Input should be greater than 0 \(got '0'\)"):
        parse_config(["--node-grace", "0"])


def test_a_missing_required_setting_names_the_flag_and_the_file_key():
    with pytest.raises(ConfigError, match=r"^node_id: required \(--node-id or node_id in --config\)$"):
        load_config([])


def test_flags_win_over_the_file_and_file_errors_name_file_and_setting(tmp_path):
    path = tmp_path / "controller.yaml"
    path.write_text("node_grace: 7\nheartbeat_interval: 2\n")
    config = parse_config(["--config", str(path), "--node-grace", "9"])
    assert (config.node_grace, config.heartbeat_interval) == (9.0, 2.0)
    path.write_text("node_gracee: 7\n")
    with pytest.raises(ConfigError, match=rf"{path} \+ command line: node_gracee: Extra inputs are not permitted"):
        parse_config(["--config", str(path)])
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping of settings"):
        load_config(["--config", str(path)])
    with pytest.raises(ConfigError, match="absent.yaml: file not found"):
        load_config(["--config", str(tmp_path / "absent.yaml")])


@pytest.mark.parametrize(
    "model, flags, make_parser",
    [
        (NodeManagerConfig, NODE_FLAGS, parser),
        (
            ControllerConfig,
            CONTROLLER_FLAGS,
            lambda: settings_parser("motor-controller", "", ControllerConfig, CONTROLLER_FLAGS),
        ),
        (EngineServerArgs, ENGINE_FLAGS, build_parser),
    ],
)
def test_help_shows_each_settings_real_default(model, flags, make_parser, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps to the terminal width
    help_text = " ".join(make_parser().format_help().split())
    assert set(flags) <= set(model.model_fields)
    for setting, flag in flags.items():
        shown = default_text(model, setting, flag)
        assert flag_name(setting) in help_text
        assert (f"[default: {shown}]" if shown != "required" else "[required]") in help_text, setting
    assert "[default: 0.0.0.0:50052]" in " ".join(parser().format_help().split())
    assert default_text(NodeManagerConfig, "heartbeat_interval", NODE_FLAGS["heartbeat_interval"]) == "1.0"
