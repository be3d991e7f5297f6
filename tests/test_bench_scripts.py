"""Every script in bench/ still imports: a helper a bench borrowed from elsewhere in the project
moved once and bench/front_door.py stopped starting, unnoticed, since no test runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.processes  # (one interpreter importing them all)

CHECK = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_bench_script_imports():
    names = sorted(
        f"bench.{name[:-3]}" for name in os.listdir(os.path.join(REPO_ROOT, "bench")) if name.endswith(".py")
    )
    assert len(names) > 10
    done = subprocess.run(
        [sys.executable, "-c", CHECK, *names], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"bench scripts that do not import:\n{done.stdout}{done.stderr[-2000:]}"
