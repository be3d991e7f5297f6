"""A configuration the engine server refuses at its start (exit 2, config_error: vLLM's
`max_model_len` above the model's, a bad engine_args value) is not launched again: the next
StartEngine of the same spec is INVALID_ARGUMENT, which the controller takes as FAILED at once
(issue 61 #13: it was retried five times over 30 s)."""

from __future__ import annotations

import json

import grpc
import pytest

from motor.contract.termination import CONFIG_ERROR, PORT_TAKEN, START_FAILED, TerminationMessage
from motor.errors import InvalidArgument
from motor.v1 import node_manager_pb2, types_pb2
from node_manager.spec_refusals import REMEMBER_S, SpecRefusals
from tests.support.node_manager_harness import sim_config, spec

FAILED, RUNNING = types_pb2.ENGINE_STATE_FAILED, types_pb2.ENGINE_STATE_RUNNING
BAD = json.dumps({"motor_engine_prefill_config": {"engine_type": "sim", "engine_args": {"max_num_seqs": 0}}})


@pytest.mark.processes
async def test_a_spec_the_engine_server_refused_is_refused_at_its_next_start(make_node):
    node = await make_node()
    await node.start(config_json=BAD)
    failed = await node.wait_state("prefill-0/rank0", FAILED, timeout=30)
    assert failed.exit_code == 2 and "max_num_seqs" in failed.state_reason
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await node.stub.StartEngine(node_manager_pb2.StartEngineRequest(spec=spec(config_json=BAD, generation=2)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = refused.value.details()
    assert "refused this configuration at its start" in details and "max_num_seqs" in details, details
    assert (await node.get("prefill-0/rank0")).spec.generation != 2  # nothing launched
    # Another configuration for the same engine is launched as usual.
    await node.start(config_json=sim_config(), generation=3)
    await node.wait_state("prefill-0/rank0", RUNNING, timeout=30)


def message(cause: str) -> TerminationMessage:
    return TerminationMessage(exit_code=2, cause=cause, message=f"{cause}: words")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_only_a_config_error_exit_2_is_remembered_once_and_for_a_while():
    clock = Clock()
    refusals = SpecRefusals(clock)
    requested = spec(config_json=BAD)
    for code, cause in [(2, PORT_TAKEN), (1, START_FAILED), (1, CONFIG_ERROR), (None, CONFIG_ERROR)]:
        refusals.engine_exited(requested, code, message(cause))
        refusals.check(requested)  # the moment's trouble, or an exit not the engine server's: launched
    refusals.engine_exited(requested, 2, None)
    refusals.check(requested)  # no termination message: not known to be the spec
    refusals.engine_exited(requested, 2, message(CONFIG_ERROR))
    refusals.check(spec(config_json=sim_config()))  # another configuration: launched
    refusals.engine_exited(requested, 2, message(CONFIG_ERROR))
    with pytest.raises(InvalidArgument):
        refusals.check(requested)
    refusals.check(requested)  # one answer: the controller has its FAILED; a later apply launches
    refusals.engine_exited(requested, 2, message(CONFIG_ERROR))
    clock.now += REMEMBER_S + 1
    refusals.check(requested)
