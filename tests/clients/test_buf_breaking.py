"""`buf breaking`: the API in proto/ stays compatible with the one users generated stubs from.

The baseline is the last release tag (v*) when one exists, else the first commit of main that
has proto/: with no release yet, the API as first published is the contract. buf.yaml's
breaking rules are FILE, the strictest set: deleting or renumbering a field, changing its type,
renaming a field, message, enum value, service or RPC, or moving a type to another file fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT, require

BUF = os.path.join(os.path.dirname(sys.executable), "buf")


def _git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    return result.stdout.strip() if result.returncode == 0 else ""


def breaking_baseline() -> tuple[str, str] | None:
    """(commit, why) to check against: the last release tag, else the first commit with proto/."""
    tag = _git("describe", "--tags", "--abbrev=0", "--match", "v[0-9]*")
    if tag:
        return _git("rev-list", "-n", "1", tag), f"release tag {tag}"
    first = _git("log", "--reverse", "--format=%H", "--", "proto").splitlines()
    if first:
        return first[0], f"first commit with proto/ ({first[0][:12]})"
    return None


def buf_breaking(workdir: str, commit: str) -> subprocess.CompletedProcess:
    against = f"{os.path.join(REPO_ROOT, '.git')}#ref={commit}"
    return subprocess.run(
        [BUF, "breaking", "--against", against], cwd=workdir, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def baseline() -> str:
    require(os.path.exists(BUF), "buf (PyPI buf-bin, installed by `make setup`)")
    found = breaking_baseline()
    require(found is not None, "git history with proto/ (buf breaking needs a baseline commit)")
    return found[0]


@pytest.fixture
def proto_copy(tmp_path) -> str:
    """A scratch copy of proto/ and buf.yaml to edit."""
    shutil.copytree(os.path.join(REPO_ROOT, "proto"), tmp_path / "proto")
    shutil.copy(os.path.join(REPO_ROOT, "buf.yaml"), tmp_path / "buf.yaml")
    return str(tmp_path)


def _edit(root: str, relative: str, old: str, new: str) -> None:
    path = os.path.join(root, "proto", "motor", "v1", relative)
    with open(path) as handle:
        text = handle.read()
    assert old in text, f"{old!r} no longer in {relative}: update this test's edit"
    with open(path, "w") as handle:
        handle.write(text.replace(old, new, 1))


def test_proto_has_no_breaking_change_against_the_baseline(baseline):
    result = buf_breaking(REPO_ROOT, baseline)
    assert result.returncode == 0, f"breaking change against {breaking_baseline()[1]}:\n{result.stdout}{result.stderr}"


def test_deleting_a_field_is_caught(baseline, proto_copy):
    _edit(proto_copy, "types.proto", "  string reason = 2;", "  reserved 2;")
    result = buf_breaking(proto_copy, baseline)
    assert result.returncode != 0
    assert 'field "2" with name "reason" on message "EngineStatus" was deleted' in result.stdout, result.stdout


def test_renaming_a_field_is_caught(baseline, proto_copy):
    # Same number and type (wire-compatible), but JSON, grpcurl and generated code break.
    _edit(
        proto_copy, "controller.proto", "  string node_id = 1;\n  // Address", "  string node_name = 1;\n  // Address"
    )
    result = buf_breaking(proto_copy, baseline)
    assert result.returncode != 0
    assert 'changed name from "node_id" to "node_name"' in result.stdout, result.stdout


def test_renaming_an_rpc_is_caught(baseline, proto_copy):
    _edit(proto_copy, "engine.proto", "rpc GetStatus(", "rpc GetEngineStatus(")
    result = buf_breaking(proto_copy, baseline)
    assert result.returncode != 0
    assert '"GetStatus" on service "EngineService" was deleted' in result.stdout, result.stdout


def test_adding_a_field_is_not_breaking(baseline, proto_copy):
    _edit(
        proto_copy,
        "types.proto",
        "  string reason = 2;",
        "  string reason = 2;\n  // A new field.\n  string hint = 999;",
    )
    result = buf_breaking(proto_copy, baseline)
    assert result.returncode == 0, result.stdout + result.stderr
