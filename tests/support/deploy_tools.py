"""What tests/deploy shares: the installed entry points and their --help (the flags a manifest or
unit may give them are the ones their parsers have)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tomllib

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
