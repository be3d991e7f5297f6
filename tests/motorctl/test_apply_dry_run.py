"""`motorctl apply` against a real controller: an engine_args typo is refused before any revision
is written, in the file's words; `apply --dry-run` checks a file as an apply would and changes nothing."""

from __future__ import annotations

import json

import pytest

from tests.support.controller_harness import EXAMPLE
from tests.support.controller_process import motorctl

pytestmark = pytest.mark.processes


def test_an_engine_args_typo_is_refused_at_apply_and_by_a_dry_run(controller, tmp_path):
    address = controller.address
    typo = tmp_path / "typo.yaml"
    typo.write_text(open(EXAMPLE).read().replace("latency_ms: 5", "latncy_ms: 5", 1))
    for dry in ([], ["--dry-run"]):
        result = motorctl(address, "apply", *dry, "-f", str(typo), check=False)
        assert result.returncode == 1 and "INVALID_ARGUMENT" in result.stderr, result.stderr
        assert (
            "engine_config.motor_engine_prefill_config.engine_args.latncy_ms: Extra inputs are not permitted; "
            "did you mean 'latency_ms'?" in result.stderr
        )
    one = tmp_path / "one.yaml"
    one.write_text(open(EXAMPLE).read().replace("data_parallel_size: 2", "data_parallel_size: one", 1))
    result = motorctl(address, "apply", "--dry-run", "-f", str(one), check=False)
    assert result.returncode == 2
    assert "instance_groups[0].data_parallel_size: expected an integer, got 'one'" in result.stderr
    assert "# revision 1" in motorctl(address, "deployment").stdout  # nothing became a revision


def test_a_dry_run_validates_and_writes_nothing(controller, tmp_path):
    address = controller.address
    same = motorctl(address, "apply", "--dry-run", "-f", EXAMPLE).stdout
    assert "'local-sim' is valid" in same and "revision 1" in same and "dry run: nothing changed" in same
    changed = tmp_path / "changed.yaml"
    changed.write_text(open(EXAMPLE).read().replace("latency_ms: 5", "latency_ms: 7", 1))
    reply = json.loads(motorctl(address, "-o", "json", "apply", "--dry-run", "-f", str(changed)).stdout)
    assert reply["dry_run"] is True and reply["revision"] == "2"
    assert reply["deployment"]["strategy"]["max_surge"] == 1  # the defaults an apply fills in
    assert "# revision 1" in motorctl(address, "deployment").stdout
    assert "latency_ms: 5" in motorctl(address, "deployment").stdout
    new = tmp_path / "new.yaml"
    new.write_text(
        open(EXAMPLE)
        .read()
        .replace("name: local-sim", "name: other", 1)
        .replace("name: prefill", "name: p2", 1)
        .replace("pair_with: decode", "pair_with: d2", 1)
        .replace("name: decode", "name: d2", 1)
    )
    assert (
        "'other' is valid; an apply would make it revision 1"
        in motorctl(address, "apply", "--dry-run", "-f", str(new)).stdout
    )
    assert "other" not in motorctl(address, "deployments").stdout
    taken = tmp_path / "taken.yaml"
    taken.write_text(open(EXAMPLE).read().replace("name: local-sim", "name: thief", 1))
    result = motorctl(address, "apply", "--dry-run", "-f", str(taken), check=False)
    assert result.returncode == 1 and "is a group of deployment 'local-sim'" in result.stderr
