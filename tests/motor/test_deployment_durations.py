"""One duration convention across the deployment file: every duration it takes (restart_policy's
backoffs and windows, strategy's deadlines, autoscaling's scale_down_delay_s) is read the same way,
seconds as a number or a number with a unit, and a refusal names every accepted form."""

from __future__ import annotations

import pytest

from motor.contract.deployment_file import deployment_from_dict
from motor.contract.pbtime import seconds
from motor.errors import InvalidArgument

WRITTEN = [(60, 60.0), ("60", 60.0), ("60s", 60.0), ("5m", 300.0), ("500ms", 0.5), ("1h", 3600.0), (0.5, 0.5)]
DURATIONS = [
    ("restart_policy", "initial_backoff"),
    ("restart_policy", "max_backoff"),
    ("restart_policy", "reset_after"),
    ("restart_policy", "failure_window"),
    ("strategy", "progress_deadline"),
    ("strategy", "min_ready"),
]


def document(**sections) -> dict:
    group = {"name": "u", "role": "union", "count": 1, "autoscaling": {"max": 3, "target_in_flight": 4}}
    return {"name": "d", "model": "m", "instance_groups": [group], **sections}


@pytest.mark.parametrize("written, expected", WRITTEN)
@pytest.mark.parametrize("section, name", DURATIONS)
def test_every_duration_field_takes_every_form(section, name, written, expected):
    deployment = deployment_from_dict(document(**{section: {name: written}}))
    assert seconds(getattr(getattr(deployment, section), name)) == pytest.approx(expected)


@pytest.mark.parametrize("written, expected", WRITTEN)
def test_scale_down_delay_takes_the_same_forms(written, expected):
    data = document()
    data["instance_groups"][0]["autoscaling"]["scale_down_delay_s"] = written
    deployment = deployment_from_dict(data)
    assert deployment.instance_groups[0].autoscaling.scale_down_delay_s == pytest.approx(expected)


@pytest.mark.parametrize("written", ["5 minutes", "5x", "s", True, [1]])
def test_anything_else_is_refused_naming_every_form(written):
    data = document(restart_policy={"initial_backoff": written})
    data["instance_groups"][0]["autoscaling"]["scale_down_delay_s"] = written
    with pytest.raises(InvalidArgument) as refused:
        deployment_from_dict(data)
    forms = "seconds as a number (60) or with a unit: 500ms, 60s, 5m, 1h"
    assert f"restart_policy.initial_backoff: expected a duration ({forms})" in str(refused.value)
    assert f"instance_groups[0].autoscaling.scale_down_delay_s: expected a duration ({forms})" in str(refused.value)
