"""`apply --dry-run` says the revision the apply then makes, after a delete too (it said 1 where
the apply made the deleted deployment's last revision plus one)."""

from __future__ import annotations

from tests.support.controller_harness import example_deployment


async def test_a_dry_run_after_a_delete_says_the_revision_the_apply_makes(harness):
    await harness.start()
    ctl = harness.controller
    ctl.apply_deployment(example_deployment())
    changed = example_deployment()
    changed.restart_policy.max_failures = 9
    assert ctl.apply_deployment(changed)[1] == 2
    ctl.delete_deployment("local-sim")
    _, said = ctl.dry_run_apply(example_deployment())
    _, made = ctl.apply_deployment(example_deployment())
    assert said == made == 3
    assert ctl.dry_run_apply(example_deployment())[1] == 3  # the same again: no new revision
