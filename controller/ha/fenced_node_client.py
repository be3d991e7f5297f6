"""The node-manager client of an HA controller: a StartEngine/StopEngine goes out only while this
controller leads, after the store has written everything staged before it (a generation is in
etcd before a node runs it), and with the epoch on it (docs/ha.md)."""

from __future__ import annotations

import asyncio

from controller.engines.node_client import Abandonments, NodeCallError, NodeClient
from controller.ha.election import LeaderElection
from controller.store.etcd import EtcdStore, Fenced
from motor.v1 import controller_pb2, types_pb2

C = controller_pb2


async def flush_while_leading(store: EtcdStore, election: LeaderElection, timeout: float) -> None:
    """Waits until etcd has committed every staged write. A write etcd refused (`Fenced`: another
    controller's epoch) ends this controller's leadership; `Fenced` and `TimeoutError` are for the
    caller to word for its own caller."""
    try:
        async with asyncio.timeout(timeout):
            await store.flush()
    except Fenced as exc:
        election.lost(f"a write was refused by etcd: {exc}")
        raise


class LeaderOnlyNodeClient(NodeClient):
    def __init__(self, inner: NodeClient, election: LeaderElection, store: EtcdStore, flush_timeout: float):
        self.inner, self.election, self.store, self.flush_timeout = inner, election, store, flush_timeout
        self.abandonments = Abandonments()  # a node abandoned while a call waits for the flush: not sent

    async def _admit(self, what: str) -> None:
        if not self.election.is_leader():
            raise NodeCallError("FAILED_PRECONDITION", f"{what} not sent: {self.election.not_leader_message()}")
        try:
            await flush_while_leading(self.store, self.election, self.flush_timeout)
        except Fenced as exc:
            raise NodeCallError("FAILED_PRECONDITION", f"{what} not sent: leadership lost ({exc})") from None
        except TimeoutError:
            raise NodeCallError(
                "UNAVAILABLE", f"{what} not sent: etcd did not commit the state in {self.flush_timeout}s"
            ) from None
        if not self.election.is_leader():  # the flush may have outlasted the leadership
            raise NodeCallError("FAILED_PRECONDITION", f"{what} not sent: {self.election.not_leader_message()}")

    async def start_engine(self, node: C.NodeInfo, spec: types_pb2.EngineSpec) -> types_pb2.Engine:
        since = self.abandonments.count(node.node_id)
        await self._admit(f"StartEngine of {spec.instance_id}/rank{spec.dp_rank}")
        self.abandonments.check(node.node_id, since)
        return await self.inner.start_engine(node, spec)

    async def stop_engine(self, node: C.NodeInfo, engine_id: str, generation: int, deadline: float) -> None:
        since = self.abandonments.count(node.node_id)
        await self._admit(f"StopEngine of {engine_id}")
        self.abandonments.check(node.node_id, since)
        await self.inner.stop_engine(node, engine_id, generation, deadline)

    async def list_engines(self, node: C.NodeInfo, timeout: float) -> list[types_pb2.Engine]:
        return await self.inner.list_engines(node, timeout)

    async def forget(self, address: str) -> None:
        await self.inner.forget(address)

    def abandon(self, node_id: str, why: str) -> None:
        self.abandonments.add(node_id, why)
        self.inner.abandon(node_id, why)

    async def close(self) -> None:
        await self.inner.close()
