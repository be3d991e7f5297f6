"""Where motorctl finds the controller it talks to, and how `motorctl up` tells it.

`motorctl up` writes `<run dir>/motorctl.env` once its cluster serves: shell `export` lines of
MOTOR_CONTROLLER (and, with --tls, MOTOR_CACERT, MOTOR_CERT and MOTOR_KEY of its operator), which
`. <run dir>/motorctl.env` loads into a shell; it removes the file when the cluster stops, so that
a stale address never sends a command to whatever listens there later.

motorctl's order, first found wins: --controller (and the credential flags), the environment
(MOTOR_CONTROLLER, MOTOR_CACERT...), the current directory's `.run/motorctl.env` (`make run`'s
run dir, from the repository root), then localhost:50051.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field

from motorctl.connect import Credentials

ENV_FILE = "motorctl.env"
DEFAULT_RUN_DIR = ".run"
FALLBACK = "localhost:50051"
# The credential settings an env file may carry, by motorctl's flag (argparse attribute).
CREDENTIAL_VARIABLES = {"cacert": "MOTOR_CACERT", "cert": "MOTOR_CERT", "key": "MOTOR_KEY"}
_FROM_CREDENTIALS = {"cacert": "ca", "cert": "cert", "key": "key"}  # flag -> Credentials attribute


def env_file(run_dir: str) -> str:
    return os.path.join(run_dir, ENV_FILE)


def write(run_dir: str, controllers: list[str], credentials: Credentials = Credentials()) -> str:
    """Write the cluster's env file; returns its path."""
    values = {"MOTOR_CONTROLLER": ",".join(controllers)}
    for attribute, variable in CREDENTIAL_VARIABLES.items():
        path = getattr(credentials, _FROM_CREDENTIALS[attribute])
        if path:
            values[variable] = os.path.abspath(path)
    path = env_file(run_dir)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("".join(f"export {name}={shlex.quote(value)}\n" for name, value in values.items()))
    return path


def forget(run_dir: str) -> None:
    """The cluster is stopping: its address is no longer its."""
    try:
        os.remove(env_file(run_dir))
    except FileNotFoundError:
        pass


def read(path: str) -> dict[str, str]:
    """The variables of an env file (`export NAME=value` lines); {} when there is none."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        words = shlex.split(line, comments=True)
        if words and words[0] == "export":
            words = words[1:]
        for word in words:
            name, equals, value = word.partition("=")
            if equals:
                values[name] = value
    return values


@dataclass(frozen=True)
class Found:
    """The controller motorctl talks to when --controller is not given, and where it came from."""

    controller: str
    source: str  # "env MOTOR_CONTROLLER", ".run/motorctl.env" or "the default"
    credentials: dict[str, str] = field(default_factory=dict)  # argparse attribute -> path, from the same place


def find(environ: dict[str, str] | None = None, cwd: str | None = None) -> Found:
    environ = os.environ if environ is None else environ
    if environ.get("MOTOR_CONTROLLER"):
        return Found(environ["MOTOR_CONTROLLER"], "env MOTOR_CONTROLLER")
    relative = env_file(DEFAULT_RUN_DIR)
    values = read(os.path.join(cwd or os.getcwd(), relative))
    if values.get("MOTOR_CONTROLLER"):
        credentials = {a: values[v] for a, v in CREDENTIAL_VARIABLES.items() if values.get(v)}
        return Found(values["MOTOR_CONTROLLER"], relative, credentials)
    return Found(FALLBACK, "the default")


def export_line(run_dir: str, controllers: list[str], credentials: Credentials = Credentials()) -> str:
    """What the screen prints for another terminal: the export line of the address, or (with
    credentials too) the env file to load."""
    if credentials.ca:
        return f". {os.path.abspath(env_file(run_dir))}"
    return f"export MOTOR_CONTROLLER={','.join(controllers)}"
