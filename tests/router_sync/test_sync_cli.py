"""motor-router-sync's and the front door's command lines: bad input is named, not a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes  # each case runs the command line as a process


@pytest.mark.parametrize(
    "args, said",
    [
        (
            ["--controller", "127.0.0.1:1", "--router", "127.0.0.1:8080"],
            "--router '127.0.0.1:8080': give a URL starting with http://",
        ),
        (
            ["--controller", "127.0.0.1:1", "--router", "http://127.0.0.1:8080", "--tls-cert", "c.crt"],
            "--tls-cert and --tls-key go together",
        ),
        (
            ["--controller", "127.0.0.1:1", "--router", "http://127.0.0.1:8080", "--relist-interval", "0"],
            "--relist-interval must be above 0",
        ),
        (
            ["--controller", "127.0.0.1:1", "--router", "http://127.0.0.1:8080", "--report-interval", "-1"],
            "--report-interval must be above 0",
        ),
        (["--router", "http://127.0.0.1:8080"], "the following arguments are required: --controller"),
        (
            ["--controller", "127.0.0.1:1", "--router", "http://127.0.0.1:8081", "--front-door", "0.0.0.0:8080"],
            "the front door runs in its own process now (motor-front-door --listen 0.0.0.0:8080",
        ),
        (
            ["--controller", "127.0.0.1:1", "--router", "http://127.0.0.1:8081", "--front-door-table", "127.0.0.1:1"],
            "--front-door-table '127.0.0.1:1': give a URL",
        ),
    ],
)
def test_bad_flags_exit_2_naming_what_to_fix(args, said):
    done = subprocess.run([sys.executable, "-m", "router_sync", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    "args, said",
    [
        (["--listen", "8080", "--router", "http://127.0.0.1:8081", "--table", "127.0.0.1:1"], "--listen '8080'"),
        (["--listen", "127.0.0.1:1", "--router", "127.0.0.1:8081", "--table", "127.0.0.1:1"], "--router '127.0"),
        (["--listen", "127.0.0.1:1", "--router", "http://127.0.0.1:8081"], "required: --table"),
    ],
)
def test_the_front_doors_bad_flags_exit_2_naming_what_to_fix(args, said):
    done = subprocess.run([sys.executable, "-m", "front_door.cli", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_sync_feeding_a_front_door_files_engines_by_model():
    from router_sync.cli import parse

    args = parse(
        ["--controller", "127.0.0.1:1", "--router", "http://127.0.0.1:8081", "--front-door-table", "http://h:8079"]
    )
    assert args.front_door_table == "http://h:8079" and args.by_model
