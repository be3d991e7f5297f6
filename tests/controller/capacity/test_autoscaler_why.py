"""The autoscaler's WHY column is true to the moment: a hold that ended (the rollout COMPLETE) is
not shown as still holding, and a group at its max under more load says it is capped."""

from __future__ import annotations

from types import SimpleNamespace

from controller.capacity.autoscaler import WINDOW_S, Autoscaler, GroupScaler, ScalePolicy
from motor.contract.deployment_file import deployment_from_dict

POLICY = ScalePolicy(min=1, max=3, target=4.0, scale_down_delay_s=300.0)


def test_a_group_at_max_under_more_load_says_it_is_capped():
    scaler = GroupScaler("chat", POLICY, now=0.0)
    for second in range(1, 40):
        assert scaler.step(float(second), 3, 60.0) is None  # 20 per engine against 4: it would want 15
    assert scaler.last.startswith("capped at max 3: in flight 20.0 per engine"), scaler.last
    assert scaler.last.endswith("the load asks for 15"), scaler.last


def test_a_hold_that_ended_is_not_shown_as_holding():
    deployment = deployment_from_dict(
        {
            "name": "d",
            "model": "m",
            "instance_groups": [
                {"name": "chat", "role": "union", "count": 1, "autoscaling": {"max": 3, "target_in_flight": 4}}
            ],
        }
    )
    scaler = GroupScaler("chat", POLICY, now=0.0)
    scaler.held, scaler.last = True, "held: a rollout is in progress"  # the last look, during the rollout
    autoscaler = Autoscaler.__new__(Autoscaler)
    autoscaler.state, autoscaler.scalers = SimpleNamespace(instances={}), {("d", "chat"): scaler}
    autoscaler._held = lambda name: ""  # the rollout is COMPLETE now
    (scale,) = autoscaler.status("d", deployment)
    assert "held:" not in scale.reason and scale.reason.startswith(f"gathering {WINDOW_S:.0f} s of load"), scale.reason
    autoscaler._held = lambda name: "a rollout is in progress"
    assert autoscaler.status("d", deployment)[0].reason == "held: a rollout is in progress"
