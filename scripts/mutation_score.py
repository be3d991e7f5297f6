"""Prints the mutation score of the last `mutmut run` and checks every surviving mutant against the
list of equivalent ones (tests/mutation/equivalent.md). Run from the repository root after
`mutmut run` (`make mutation` does both).

Exit status 1 when the score is under the goal or a survivor is neither killed nor listed: a new
survivor needs a test that kills it, or an entry saying why no test can (the mutant behaves exactly
like the original).

A survivor is matched by its function and its changed lines, not by mutmut's numbering, so the list
stays valid when other functions change.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_mutatable_files
from mutmut.utils.format_utils import mangled_name_from_mutant_name, orig_function_and_class_names_from_key

GOAL = 90.0
EQUIVALENT = Path("tests/mutation/equivalent.md")
# A mutant that fails a test, hangs it, crashes it or does not type-check was detected.
DETECTED = {"killed", "timeout", "segfault", "caught by type check"}
# `- `function`: `old` → `new` — why`: one line of tests/mutation/equivalent.md per survivor.
ENTRY = re.compile(r"^- `(?P<function>[^`]+)`: `(?P<old>[^`]*)` → `(?P<new>[^`]*)` — (?P<why>.+)$")


def function_of(mutant: str) -> str:
    """controller.model.instances.x_transition__mutmut_3 -> controller.model.instances.transition
    (methods as Class.method)."""
    module = mangled_name_from_mutant_name(mutant).rpartition(".")[0]
    name, class_name = orig_function_and_class_names_from_key(mutant)
    return f"{module}.{class_name}.{name}" if class_name else f"{module}.{name}"


def changed_lines(diff: str) -> tuple[str, str]:
    """(old, new): the removed and the added lines of a mutant's diff, whitespace collapsed."""

    def collect(sign: str) -> str:
        lines = [line[1:] for line in diff.splitlines() if line.startswith(sign) and not line.startswith(sign * 3)]
        return " ⏎ ".join(" ".join(line.split()) for line in lines)

    return collect("-"), collect("+")


def listed_equivalents() -> dict[tuple[str, str, str], str]:
    entries = {}
    for line in EQUIVALENT.read_text().splitlines():
        match = ENTRY.match(line)
        if match:
            entries[(match["function"], match["old"], match["new"])] = match["why"]
    return entries


def main() -> int:
    statuses: dict[str, str] = {}
    paths: dict[str, Path] = {}
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        for mutant, exit_code in data.exit_code_by_key.items():
            statuses[mutant] = status_by_exit_code[exit_code]
            paths[mutant] = path
    if not statuses:
        print("mutation: no results; run `mutmut run` first", file=sys.stderr)
        return 1
    counts = Counter(statuses.values())
    detected = sum(n for status, n in counts.items() if status in DETECTED)
    total = len(statuses)
    score = 100.0 * detected / total
    equivalents = listed_equivalents()
    used: set[tuple[str, str, str]] = set()
    unexplained = []
    for mutant, status in sorted(statuses.items()):
        if status in DETECTED:
            continue
        old, new = changed_lines(get_diff_for_mutant(mutant, path=paths[mutant]))
        key = (function_of(mutant), old, new)
        if key in equivalents:
            used.add(key)
        else:
            unexplained.append((mutant, status, key))
    print(
        f"mutation score: {score:.1f}% ({detected} of {total} mutants detected; "
        + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        + ")"
    )
    print(f"listed as equivalent in {EQUIVALENT}: {len(used)} survivors")
    for mutant, status, (function, old, new) in unexplained:
        print(f"NOT EXPLAINED ({status}) {mutant}\n- `{function}`: `{old}` → `{new}` — WHY?")
    stale = set(equivalents) - used
    if stale:
        print(f"{len(stale)} entries of {EQUIVALENT} match no survivor any more (killed, or the code changed):")
        for function, old, new in sorted(stale):
            print(f"  {function}: {old} → {new}")
    if score < GOAL:
        print(f"mutation: the score is under the goal of {GOAL:g}%")
    if unexplained:
        print(
            f"mutation: {len(unexplained)} survivors need a test that kills them or an entry in {EQUIVALENT} "
            "(`mutmut show NAME` prints one)"
        )
    return 1 if score < GOAL or unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
