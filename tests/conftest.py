import os
import sys

# Make `tests.support` importable however pytest is started.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
