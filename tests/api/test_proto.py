"""The API contract: buf lint passes and the committed Python code matches proto/."""

import filecmp
import os
import shutil
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.processes

PROTO_DIR = os.path.join(REPO_ROOT, "proto")
GENERATED_DIR = os.path.join(REPO_ROOT, "motor", "v1")


def _bin(name: str) -> str:
    path = shutil.which(name, path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert path, f"{name} not found: run `make setup`"
    return path


def test_buf_lint_passes():
    result = subprocess.run([_bin("buf"), "lint"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_code_is_fresh(tmp_path):
    protos = sorted(
        os.path.join("proto", "motor", "v1", name)
        for name in os.listdir(os.path.join(PROTO_DIR, "motor", "v1"))
        if name.endswith(".proto")
    )
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iproto",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--mypy_out={tmp_path}",
            f"--mypy_grpc_out={tmp_path}",
            *protos,
        ],
        cwd=REPO_ROOT,
        check=True,
        env=env,
        capture_output=True,
    )
    fresh_dir = tmp_path / "motor" / "v1"
    fresh = sorted(p.name for p in fresh_dir.iterdir())
    committed = sorted(n for n in os.listdir(GENERATED_DIR) if n.endswith((".py", ".pyi")) and n != "__init__.py")
    assert fresh == committed, "generated file set differs: run `make proto`"
    stale = [
        name for name in fresh if not filecmp.cmp(fresh_dir / name, os.path.join(GENERATED_DIR, name), shallow=False)
    ]
    assert not stale, f"stale generated code {stale}: run `make proto` and commit the result"
