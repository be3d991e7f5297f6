"""`make run` and `make run-vllm` take the same knobs, each reaching `motorctl up` (read from the
commands `make -n` prints, nothing started), and refuse a variable they do not take."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

from tests.support import REPO_ROOT, require

pytestmark = pytest.mark.processes  # it runs make

KNOBS = {
    "PORT": ("28080", ["--router-port", "28080"]),
    "CONTROLLER_PORT": ("50251", ["--controller-port", "50251"]),
    "METRICS_PORT": ("19471", ["--metrics-port", "19471"]),
    "RUN_DIR": ("/tmp/knob-run", ["--run-dir", "/tmp/knob-run"]),
    "NODES": ("3", ["--nodes", "3"]),
    "DEPLOYMENT": ("mine.yaml", ["--deployment", "mine.yaml"]),
    "RUN_ARGS": ("--router-pd --refresh 2", ["--router-pd", "--refresh", "2"]),
}


def make_n(target: str, *assignments: str) -> subprocess.CompletedProcess:
    require(shutil.which("make") is not None, "make")
    return subprocess.run(
        ["make", "-n", "--no-print-directory", target, "VENV=/venv", *assignments],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def up_argv(printed: str) -> list[str]:
    lines = [line for line in printed.splitlines() if "motorctl up" in line]
    assert len(lines) == 1, printed
    return shlex.split(lines[0])


def contains(argv: list[str], words: list[str]) -> bool:
    return any(argv[i : i + len(words)] == words for i in range(len(argv)))


@pytest.mark.parametrize("target", ["run", "run-vllm"])
def test_every_knob_reaches_motorctl_up(target):
    printed = make_n(target, *(f"{name}={value}" for name, (value, _) in KNOBS.items()))
    assert printed.returncode == 0, printed.stderr
    argv = up_argv(printed.stdout)
    for name, (_, words) in KNOBS.items():
        assert contains(argv, words), f"make {target} {name}=...: {words} not in {argv}"
    assert argv.count("--nodes") == 1 and argv.count("--deployment") == 1, argv


@pytest.mark.parametrize("target", ["run", "run-vllm"])
def test_without_knobs_motorctl_up_keeps_its_defaults(target):
    argv = up_argv(make_n(target).stdout)
    for flag in ("--router-port", "--controller-port", "--run-dir", "--metrics-port"):
        assert flag not in argv, argv
    assert contains(argv, ["--nodes", "2" if target == "run" else "1"]), argv


@pytest.mark.parametrize("target", ["run", "run-vllm"])
def test_a_variable_the_target_does_not_take_is_refused(target):
    printed = make_n(target, "PROT=28080")
    assert printed.returncode != 0
    assert f"{target} does not take PROT" in printed.stderr and "PORT CONTROLLER_PORT" in printed.stderr, printed.stderr
