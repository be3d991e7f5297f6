"""The grpcurl walkthrough of docs/clients.md (every RPC), read as the tests run them.

Each document is the one place the commands live: every ```console block between a
`<!-- walkthrough: NAME -->` marker and the next marker is a step of section NAME (engine, node,
controller). In a block, a line starting with "$ " is a command (a trailing backslash continues
it, and a here-document `<<EOF` takes the lines up to EOF); the lines after it, up to the next command, are an excerpt
of its output: each of them must
appear in the real output, in that order ("..." marks skipped lines and is not matched). A
command whose excerpt shows "ERROR:" must fail (grpcurl's exit status is non-zero); any other
must succeed. Commands run with bash in the repository root, with $ENGINE, $NODE and
$CONTROLLER set to the addresses of the services the test started and .venv/bin first on PATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

from tests.support import REPO_ROOT

DOC = os.path.join(REPO_ROOT, "docs", "clients.md")
DOCS = (DOC,)
SECTIONS = {"engine": "ENGINE", "node": "NODE", "controller": "CONTROLLER"}
_MARKER = re.compile(r"<!--\s*walkthrough:\s*(\w+)\s*-->")


@dataclass
class Step:
    section: str
    line: int  # line of the command in docs/clients.md
    command: str
    expected: list[str]
    doc: str = "docs/clients.md"  # the document, relative to the repository root

    @property
    def expects_error(self) -> bool:
        return any(line.startswith("ERROR:") for line in self.expected)

    @property
    def id(self) -> str:
        words = re.sub(r"[^\w./-]+", " ", self.command.replace("$", "")).split()
        method = next((w.rsplit("/", 1)[-1] for w in words if "/" in w and w.count(".") >= 2), None)
        return f"{self.section}-L{self.line}-{method or (words[3] if len(words) > 3 else words[-1])}"


def load_steps(paths: tuple[str, ...] = DOCS) -> list[Step]:
    """The steps of every document in `paths`, in order."""
    return [step for path in paths for step in _load_document(path)]


def _load_document(path: str) -> list[Step]:
    doc = os.path.relpath(path, REPO_ROOT)
    steps: list[Step] = []
    section: str | None = None
    in_console = False
    current: Step | None = None
    with open(path) as handle:
        lines = handle.read().splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        number = index + 1
        index += 1
        marker = _MARKER.search(line)
        if marker and not in_console:
            section = marker.group(1) if marker.group(1) in SECTIONS else None
            continue
        if line.startswith("```"):
            if in_console:
                in_console, current = False, None
            elif section and line.strip() == "```console":
                in_console = True
            elif section:
                # Another kind of block inside a section: skip it whole.
                while index < len(lines) and not lines[index].startswith("```"):
                    index += 1
                index += 1
            continue
        if not in_console:
            continue
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\") and index < len(lines):
                command += "\n" + lines[index]  # bash joins the lines itself
                index += 1
            heredoc = re.search(r"<<'?(\w+)'?\s*$", command)
            if heredoc:  # the request body follows, up to the terminator line
                while index < len(lines):
                    command += "\n" + lines[index]
                    index += 1
                    if lines[index - 1] == heredoc.group(1):
                        break
            current = Step(section, number, command, [], doc)
            steps.append(current)
        elif current is not None and line.strip() not in ("", "..."):
            current.expected.append(line.rstrip())
    return steps


def environment(addresses: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for section, variable in SECTIONS.items():
        if section in addresses:
            env[variable] = addresses[section]
    return env


def run_step(step: Step, addresses: dict[str, str], timeout: float = 60) -> str:
    """Run one documented command; fail with the command and its output when it differs."""
    result = subprocess.run(
        ["bash", "-c", step.command],
        cwd=REPO_ROOT,
        env=environment(addresses),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = result.stdout + result.stderr
    where = f"{step.doc}:{step.line}: $ {step.command}\n(exit {result.returncode})\n{output}"
    if step.expects_error:
        assert result.returncode != 0, f"expected the command to fail:\n{where}"
    else:
        assert result.returncode == 0, f"the command failed:\n{where}"
    actual = [line.rstrip() for line in output.splitlines()]
    position = 0
    for expected in step.expected:
        try:
            position = actual.index(expected, position) + 1
        except ValueError:
            raise AssertionError(
                f"documented output line {expected!r} not found (in order) in the real output of\n{where}"
            ) from None
    return output
