"""compose.yaml's node managers take their accelerators and model roots from the environment
(MOTOR_ACCELERATOR_TYPE, MOTOR_ACCELERATORS, MOTOR_MODEL_ROOTS): the flags of each node's
command, with compose's variable substitution, make the node manager settings they should."""

from __future__ import annotations

import os
import re

import yaml

from node_manager.cli import load_config
from tests.support import REPO_ROOT

KNOBS = ("--accelerator-type", "--accelerators", "--model-roots")
# compose's ${VAR:-default} (unset or empty: default) and ${VAR-default} (unset: default).
VARIABLE = re.compile(r"\$\{(\w+)(:?)-([^}]*)\}")


def substitute(text: str, environ: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        name, colon, default = match.groups()
        given = environ.get(name)
        return default if given is None or (colon and not given) else given

    return VARIABLE.sub(value, text)


def node_settings(environ: dict[str, str], tmp_path) -> dict[str, tuple]:
    with open(os.path.join(REPO_ROOT, "compose.yaml"), encoding="utf-8") as handle:
        services = yaml.safe_load(handle)["services"]
    found = {}
    for name in ("node-a", "node-b", "node-c"):
        command = [substitute(word, environ) for word in services[name]["command"]]
        flags = [word for flag in KNOBS for word in (flag, command[command.index(flag) + 1])]
        config = load_config(["--node-id", name, "--state-dir", str(tmp_path), *flags])
        found[name] = (config.accelerator_type, config.accelerators, config.model_roots)
    return found


def test_by_default_each_node_offers_two_simulated_accelerators_and_no_model_root(tmp_path):
    assert list(node_settings({}, tmp_path).values()) == [("sim", [0, 1], [])] * 3


def test_the_environment_sets_every_nodes_accelerators_and_model_roots(tmp_path):
    environ = {"MOTOR_ACCELERATOR_TYPE": "auto", "MOTOR_ACCELERATORS": "", "MOTOR_MODEL_ROOTS": str(tmp_path)}
    cores = sorted(os.sched_getaffinity(0))  # no GPU here: auto finds the CPU cores
    assert list(node_settings(environ, tmp_path).values()) == [("cpu", cores, [str(tmp_path)])] * 3
