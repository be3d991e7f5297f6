import os
import platform
import subprocess
import sys

import pytest

# Make `tests.support` importable however pytest is started.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Folders whose every test starts real processes (services, engines, vLLM, etcd, docker). A test
# elsewhere that does says so with the `processes` mark; `make test-fast` leaves all of them out.
PROCESS_FOLDERS = {"chaos", "clients", "compose", "e2e", "grpcurl", "ha", "vllm"}
# `make test-fast` sets this: a test there that starts a process fails, naming the mark it lacks,
# so the fast tier stays fast as tests are added.
FAST_TIER = os.environ.get("MOTOR_FAST_TIER") == "1"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        folder = os.path.relpath(str(item.path), here).split(os.sep)[0]
        if folder in PROCESS_FOLDERS:
            item.add_marker(pytest.mark.processes)


def _no_process(*args, **kwargs):
    raise RuntimeError(
        "this test starts a real process, so it does not belong in the fast tier: mark it "
        "`pytest.mark.processes` (or its module: `pytestmark = pytest.mark.processes`)"
    )


def pytest_configure(config):
    # Patched for the whole session, so that module and session fixtures are held to it too; with
    # pytest-xdist (`-n`) in each worker, not in the process that starts them.
    starts_workers = bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")
    if FAST_TIER and not starts_workers:
        platform.processor()  # read once now (it runs `uname -p`): pytest-xdist's workers ask for it
        subprocess.Popen._execute_child = _no_process
        os.fork = _no_process
        os.posix_spawn = _no_process


def pytest_runtest_logreport(report):
    """The outcome of each test, for the result column of the chaos table."""
    from tests.support.chaos_table import OUTCOMES

    if report.when == "call" or report.outcome != "passed":
        if hasattr(report, "wasxfail"):
            outcome = "xfail" if report.skipped else "XPASS"
        else:
            outcome = {"passed": "passed", "failed": "FAILED", "skipped": "skipped"}[report.outcome]
        if report.when == "call" or report.nodeid not in OUTCOMES or outcome == "FAILED":
            OUTCOMES[report.nodeid] = outcome


def pytest_terminal_summary(terminalreporter):
    """The chaos table (tests/chaos, docs/chaos.md), when this session recorded any of its rows."""
    from tests.support.chaos_table import ROWS, render

    if not ROWS:
        return
    table = render()
    terminalreporter.section("chaos table (docs/chaos.md)")
    for line in table.splitlines():
        terminalreporter.write_line(line)
    path = os.environ.get("MOTOR_CHAOS_TABLE")
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(table + "\n")
