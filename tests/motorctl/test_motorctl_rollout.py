"""`motorctl rollout status|pause|resume|undo` against a real controller process."""

from __future__ import annotations

import pytest

from motor.ports import free_port
from tests.support.controller_harness import EXAMPLE
from tests.support.controller_process import motorctl

pytestmark = pytest.mark.processes


def test_rollout_status_pause_resume_and_undo(controller, tmp_path):
    address = controller.address
    # No node is registered: nothing serves, so the rollout is not complete, however little it has to do.
    status = motorctl(address, "rollout", "status", check=False)
    assert status.returncode == 3 and "rollout PROGRESSING" in status.stdout and "revision 1" in status.stdout
    assert "waiting for" in status.stdout and "no READY node" in status.stdout, status.stdout
    # Counted as kubectl does: new available of desired, old ones left.
    assert "0 of 2 updated instances available (2 updated), 0 old instance(s) remaining" in status.stdout
    changed = tmp_path / "changed.yaml"
    changed.write_text(
        open(EXAMPLE).read().replace("model: sim-tiny\n", "model: sim-other\n")
    )  # the deployment and its engines alike
    motorctl(address, "apply", "-f", str(changed))
    assert motorctl(address, "rollout", "pause", "local-sim").stdout.strip() == "rollout paused"
    paused = motorctl(address, "rollout", "status", "local-sim", check=False)
    assert paused.returncode == 4 and "rollout PAUSED" in paused.stdout and "paused by an operator" in paused.stdout
    assert "PAUSED" in motorctl(address, "deployments").stdout
    motorctl(address, "rollout", "resume", "local-sim")
    waited = motorctl(address, "rollout", "status", "--wait", "1", check=False)
    assert waited.returncode == 3 and "rollout PROGRESSING" in waited.stdout, waited.stdout
    assert "revision 3" in motorctl(address, "rollout", "undo").stdout
    assert "model: sim-tiny" in motorctl(address, "deployment").stdout
    revisions = motorctl(address, "instances").stdout
    assert "REVISION" in revisions.splitlines()[0]
    unreachable = motorctl(f"127.0.0.1:{free_port()}", "rollout", "status", check=False)
    assert unreachable.returncode == 1 and "not reachable" in unreachable.stderr  # apart from paused (4)
    unknown = motorctl(address, "rollout", "status", "nope", check=False)
    assert unknown.returncode == 2 and "no deployment is named 'nope'" in unknown.stderr
