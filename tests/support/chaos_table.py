"""The chaos table: one row per fault, recorded by the test that injected it
(tests/chaos, and the partition row of tests/compose), printed at the end of the pytest session
by the terminal summary hook in tests/conftest.py, and written to $MOTOR_CHAOS_TABLE if set.

Columns (docs/chaos.md says how each is measured):
- false kills: engine processes that died or were replaced although the fault did not justify it;
- instances lost: instances of the deployment not READY (or gone) once the cluster settled;
- running twice: (instance, rank) pairs seen with two live engine processes when they must not be;
- orphans: engine processes of the cluster that no live node manager lists;
- recovery: seconds from the end of the fault (the kill, SIGCONT, space freed, the heal) until
  the cluster is whole again (every node READY, every instance READY, each engine once).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

COLUMNS = ("fault", "false kills", "instances lost", "running twice", "orphans", "recovery (s)", "result", "note")


@dataclass
class Row:
    fault: str
    false_kills: int
    instances_lost: int
    running_twice: int
    orphans: int
    recovery_s: float | None
    note: str = ""
    test: str = ""  # the pytest node id that recorded it; its outcome fills the result column

    def zeros(self) -> bool:
        return not (self.false_kills or self.instances_lost or self.running_twice or self.orphans)


ROWS: list[Row] = []
OUTCOMES: dict[str, str] = {}  # test node id -> passed / FAILED / xfail / XPASS / skipped


def current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def record(row: Row) -> Row:
    """Adds (or replaces) the row of the running test."""
    row.test = row.test or current_test()
    ROWS[:] = [r for r in ROWS if r.fault != row.fault]
    ROWS.append(row)
    return row


def render(rows: list[Row] | None = None, outcomes: dict[str, str] | None = None) -> str:
    """A Markdown table, in the order the rows were recorded."""
    rows = ROWS if rows is None else rows
    outcomes = OUTCOMES if outcomes is None else outcomes
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        recovery = "-" if row.recovery_s is None else f"{row.recovery_s:.1f}"
        cells = (
            row.fault,
            row.false_kills,
            row.instances_lost,
            row.running_twice,
            row.orphans,
            recovery,
            outcomes.get(row.test, "?"),
            row.note.replace("|", "/"),
        )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)
