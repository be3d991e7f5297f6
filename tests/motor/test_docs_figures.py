"""The docs' figures about the suite are today's: the test counts README.md and docs/testing.md
state are within 10% of what pytest collects (the whole suite, and the fast tier), and every time
they give for the fast tier says when it was measured. Times are not checked: they depend on the
machine; the date says how old a figure is."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.processes  # it runs pytest's collection

FAST_TIER = "not processes and not vllm and not docker and not slow"  # the Makefile's test-fast
TOLERANCE = 0.10
DATE = re.compile(r"\d{4}-\d\d-\d\d")


def read(name: str) -> str:
    with open(os.path.join(REPO_ROOT, name), encoding="utf-8") as handle:
        return handle.read()


def collected(*args: str) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args, "tests"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "MOTOR_FAST_TIER"},
    ).stdout.splitlines()[-1]
    return int(re.match(r"(\d+)(/\d+)? tests? collected", out).group(1))


def stated(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    assert found, f"no figure matching {pattern!r}"
    return int(found.group(1).replace(",", ""))


def close(stated_count: int, real: int) -> bool:
    return abs(stated_count - real) <= TOLERANCE * real


def test_the_stated_test_counts_are_within_ten_percent_of_the_collected_ones():
    readme, testing = read("README.md"), read("docs/testing.md")
    whole, fast = collected(), collected("-m", FAST_TIER)
    for where, count, real in (
        ("README.md (the whole suite)", stated(r"runs the whole suite, ([\d,]+) tests", readme), whole),
        ("docs/testing.md (the whole suite)", stated(r"([\d,]+) tests \(`pytest --collect-only", testing), whole),
        ("docs/testing.md (make test-fast)", stated(r"etcd\), ([\d,]+) of them", testing), fast),
    ):
        assert close(count, real), f"{where} says {count} tests; pytest collects {real}: write the new count and date"


def test_every_time_given_for_the_fast_tier_says_when_it_was_measured():
    for name in ("README.md", "docs/testing.md"):
        for paragraph in read(name).split("\n\n"):
            if "test-fast" in paragraph and re.search(r"\d+ s\b|minutes?\b", paragraph) and "fast" in paragraph:
                timed = [s for s in re.split(r"(?<=[.;])\s", paragraph) if re.search(r"\d+ s\b|\bminutes?\b", s)]
                for sentence in timed:
                    assert DATE.search(sentence), f"{name}: a time without the date it was measured: {sentence!r}"
