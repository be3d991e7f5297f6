"""Several motor-controller processes on one etcd: started, their stubs, which one leads."""

from __future__ import annotations

import grpc

from motor.v1 import controller_pb2, controller_pb2_grpc


def _stub(address: str) -> controller_pb2_grpc.ControllerServiceStub:
    return controller_pb2_grpc.ControllerServiceStub(grpc.insecure_channel(address))


def _controllers(cluster, exclude: str = "") -> controller_pb2.ListControllersResponse | None:
    for address in cluster.controller_addresses:
        if address == exclude:
            continue
        try:
            return _stub(address).ListControllers(controller_pb2.ListControllersRequest(), timeout=2)
        except grpc.RpcError:
            continue
    return None


def _leader(cluster, exclude: str = "") -> str:
    """The leader as the controllers report it; with `exclude`, asked elsewhere and not that one."""
    reply = _controllers(cluster, exclude)
    leader = reply.leader_address if reply else ""
    return "" if leader == exclude else leader


def _process_of(cluster, address: str):
    index = cluster.controller_addresses.index(address)
    return cluster.process("controller" if index == 0 else f"controller-{index + 1}"), index
