"""Node managers sharing a host never hand out the same port (issue 61 #2): a port found free is
not yet taken (vLLM binds its inference port only after loading its model), so each port handed
out is held host-wide, a lock file per port under --port-lock-dir, until its engine ends."""

from __future__ import annotations

import pytest

from motor.errors import FailedPrecondition, InvalidArgument
from node_manager import specs
from tests.support.node_manager_fakes import FakeNode, sim_spec


# The ranges lie below Linux's ephemeral ports (32768-60999): there, any outgoing connection on the
# machine may hold one of them for a while, and a range of four ran out with no node to blame.
async def nodes(tmp_path, count: int, port_range: str) -> list[FakeNode]:
    made = []
    for index in range(count):
        node = FakeNode(str(tmp_path / f"n{index}"), node_id=f"node-{index}", port_range=port_range,
                        port_lock_dir=str(tmp_path / "ports"))  # fmt: skip
        await node.manager.start()
        made.append(node)
    return made


async def test_two_node_managers_of_one_host_with_one_range_hand_out_different_ports(tmp_path):
    # The fake engines bind nothing, as a vLLM engine loading its model: every port looks free.
    a, b = await nodes(tmp_path, 2, "31700-31703")
    first = await a.manager.start_engine(sim_spec("prefill-0", accelerator_ids=[0]))
    second = await b.manager.start_engine(sim_spec("decode-0", accelerator_ids=[0]))
    assert not set(specs.ports_of(first.spec)) & set(specs.ports_of(second.spec))
    with pytest.raises(FailedPrecondition, match="no free port left in 31700-31703"):
        await b.manager.start_engine(sim_spec("decode-1", accelerator_ids=[1]))
    given = sim_spec("decode-2", accelerator_ids=[1], port=first.spec.port)
    with pytest.raises(FailedPrecondition, match=f"spec.port {first.spec.port} is reserved by another node manager"):
        await b.manager.start_engine(given)
    # A node manager that ends (its process: here its close) gives its ports back to the host.
    await a.manager.close()
    third = await b.manager.start_engine(sim_spec("decode-3", accelerator_ids=[1]))
    assert set(specs.ports_of(third.spec)) == set(specs.ports_of(first.spec))


async def test_an_engine_asked_for_kv_events_gets_a_port_of_its_own_for_them(tmp_path):
    (node,) = await nodes(tmp_path, 1, "31710-31715")
    try:
        plain = await node.manager.start_engine(sim_spec("prefill-0", accelerator_ids=[0]))
        assert plain.spec.kv_events_port == 0 and "--kv-events-port" not in specs.engine_argv([], plain.spec, "t")
        wanted = await node.manager.start_engine(sim_spec("decode-0", accelerator_ids=[1], kv_events=True))
        port = wanted.spec.kv_events_port
        assert 31710 <= port <= 31715 and port not in (
            wanted.spec.port,
            wanted.spec.mgmt_port,
            *specs.ports_of(plain.spec),
        )
        assert specs.engine_argv([], wanted.spec, "t")[-2:] == ["--kv-events-port", str(port)]
        with pytest.raises(InvalidArgument, match="kv_events_port is only used with spec.kv_events"):
            await node.manager.start_engine(sim_spec("decode-1", accelerator_ids=[2], kv_events_port=31715))
    finally:
        await node.manager.close()
