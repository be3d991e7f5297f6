"""The live screen of `motorctl up`: the cluster's status, its router and /metrics, and the commands
to try, refreshed until asked to stop; and printing that survives a reader that goes away.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import grpc

from motor.v1 import controller_pb2, controller_pb2_grpc
from motorctl import router as front
from motorctl.connect import Credentials
from motorctl.render import quiet_stdout

if TYPE_CHECKING:
    from motorctl.up import LocalCluster


class ReaderGone(Exception):
    """`motorctl up | head`: the reader of stdout went away; the cluster is stopped, exit 141."""


def show_status(address: str, credentials: Credentials = Credentials()) -> str:
    from motorctl.render import render_status

    with credentials.channel(address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        nodes = stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5)
        instances = stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5)
    return render_status(nodes, instances)


def try_commands(cluster: LocalCluster) -> str:
    """What the screen suggests: grpcurl and motorctl commands that work on this cluster."""
    address = cluster.controller_address
    every = ",".join(cluster.controller_addresses)  # motorctl follows the leader among them
    if not cluster.tls:
        return (
            f"Try:  grpcurl -plaintext {address} list\n"
            f"      grpcurl -plaintext {address} motor.v1.ControllerService/ListInstances\n"
            f"      motorctl --controller {every} events --follow"
            + (f"\n      motorctl --controller {every} controllers" if cluster.ha else "")
        )
    pki = cluster.pki
    viewer = f"-cacert {pki.ca} -cert {pki.cert('viewer')} -key {pki.key('viewer')}"
    token = f'-cacert {pki.ca} -H "authorization: Bearer $(cat {pki.token_file("operator")})"'
    return (
        f"Try:  grpcurl {viewer} {address} list\n"
        f"      grpcurl {viewer} {address} motor.v1.ControllerService/ListInstances\n"
        f"      grpcurl {token} 127.0.0.1:{cluster.token_port} motor.v1.ControllerService/GetDeployment\n"
        f"      motorctl --controller {every} --cacert {pki.ca} --cert {pki.cert('operator')} --key "
        f"{pki.key('operator')} events --follow\n"
        f"      (certificates, keys and tokens in {pki.directory}; docs/security.md)"
    )


def watch(cluster: LocalCluster, refresh: float, stopping) -> None:
    """Show the cluster until asked to stop."""
    address = cluster.controller_address
    metrics = "".join(f"  {name:<11} {url}\n" for name, url in cluster.metrics_urls().items())
    hint = (
        (f"Prometheus /metrics (engines serve theirs on their inference port):\n{metrics}\n" if metrics else "")
        + try_commands(cluster)
        + "\nCtrl-C stops the cluster."
    )
    while not stopping():
        try:
            screen = show_status(address, cluster.credentials("viewer"))
        except grpc.RpcError as exc:
            screen = f"controller not answering: {exc.code().name}"
        clear = "\033[2J\033[H" if sys.stdout.isatty() else ""
        router = (
            f"{front.router_line(cluster.router_url, cluster.front_door_state())}\n"
            if cluster.router_port is not None
            else ""
        )
        if (
            not say(
                f"{clear}Motor local cluster — controller {address} — "
                f"{time.strftime('%H:%M:%S')}\n\n{screen}\n\n{router}{hint}"
            )
            and not stopping()
        ):
            raise ReaderGone
        end = time.monotonic() + refresh
        while not stopping() and time.monotonic() < end:
            time.sleep(0.05)


def say(text: str) -> bool:
    """Print to stdout; once stdout is gone (a closed pipe), print nothing more, quietly. False
    when its reader went away (a closed pipe)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        quiet_stdout()
        return False
    except OSError:  # EIO once the terminal is closed (SIGHUP stops the cluster)
        quiet_stdout()
    return True
