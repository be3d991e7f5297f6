"""The words the node manager refuses a start with, as the controller reads them."""

from motor.contract import start_refusals
from motor.contract.start_refusals import Refusal, kind


def as_sent(error) -> tuple[str, str]:
    return error.code.name, str(error)


def test_the_node_managers_refusals_are_recognised():
    assert kind(*as_sent(start_refusals.accelerators_held([0, 1], ["a-0/rank0"]))) is Refusal.HELD
    assert kind(*as_sent(start_refusals.port_held("port", 21000, "a-0/rank0"))) is Refusal.HELD
    assert kind(*as_sent(start_refusals.wrong_node("node-c", "node-a"))) is Refusal.WRONG_NODE
    wrong = str(start_refusals.wrong_node("node-c", "node-a"))
    assert (
        wrong.startswith("node_id node-c: this address is node node-a's node manager")
        and "--advertise-address" in wrong
    )


def test_other_refusals_are_not():
    assert (
        kind("FAILED_PRECONDITION", "spec.port 21000 is already in use on 10.0.0.1") is None
    )  # another process: a failure
    assert kind("FAILED_PRECONDITION", "engine u-0/rank0: generation 3 is older than generation 4") is None
    assert kind("FAILED_PRECONDITION", "spec.config_path '/x': no such file on node node-a") is None
    # The same words under another code, or not where the node manager puts them, are not these refusals.
    held = str(start_refusals.accelerators_held([0], ["a-0/rank0"]))
    assert kind("INVALID_ARGUMENT", held) is Refusal.NEVER and kind("UNAVAILABLE", held) is None
    assert kind("FAILED_PRECONDITION", "x" + held) is None
    assert kind("FAILED_PRECONDITION", "node-c is registered with the wrong address") is None
    assert kind("FAILED_PRECONDITION", "node_id x: fine") is None
    assert kind("FAILED_PRECONDITION", "spec.port 1 is in use by engine") is None  # no holder named


def test_a_spec_the_node_refuses_as_such_is_refused_for_good():
    """INVALID_ARGUMENT: the spec itself (a local path outside --model-root, code named in it);
    a restart would send the same spec."""
    refused = (
        "spec.config_json.motor_engine_prefill_config.engine_args.model: '/m' is a local path outside a model root"
    )
    assert kind("INVALID_ARGUMENT", refused) is Refusal.NEVER
