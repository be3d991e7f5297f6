"""The live screen of `motorctl up`: the cluster's status, its router and /metrics, and the commands
to try, refreshed until asked to stop; and printing that survives a reader that goes away.
"""

from __future__ import annotations

import os
import select
import sys
import time
from typing import TYPE_CHECKING

import grpc

from motor.contract.names import enum_short_name
from motor.v1 import controller_pb2, controller_pb2_grpc, types_pb2
from motorctl import cluster_address
from motorctl import router as front
from motorctl.connect import Credentials
from motorctl.render import quiet_stdout, render_status

CLEAR = "\033[2J\033[H"  # clear the terminal, cursor home

if TYPE_CHECKING:
    from motorctl.local_cluster import LocalCluster


class ReaderGone(Exception):
    """`motorctl up | head`: the reader of stdout went away; the cluster is stopped, exit 141."""


def read_status(
    address: str, credentials: Credentials = Credentials()
) -> tuple[controller_pb2.ListNodesResponse, controller_pb2.ListInstancesResponse]:
    with credentials.channel(address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        nodes = stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5)
        instances = stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5)
    return nodes, instances


def status_subjects(
    nodes: controller_pb2.ListNodesResponse, instances: controller_pb2.ListInstancesResponse
) -> dict[str, str]:
    """What the screen shows, one line per node, instance and engine, without what changes every
    second (heartbeat ages): the lines a log follows for changes."""
    out = {}
    for n in nodes.nodes:
        out[f"node {n.info.node_id}"] = (
            f"{enum_short_name(controller_pb2.NodeState, n.state)} (generation {n.generation}, "
            f"{len(n.free_accelerator_ids)}/{len(n.info.accelerator_ids)} accelerators free): {n.state_reason}"
        )
    for alarm in nodes.alarms:
        out[f"alarm {alarm}"] = "raised"
    for i in instances.instances:
        out[f"instance {i.instance_id}"] = (
            f"{enum_short_name(controller_pb2.InstanceState, i.state)}{' (spare)' if i.spare else ''} "
            f"(revision {i.revision}, restarts {i.restarts}): {i.state_reason}"
        )
        for e in i.engines:
            where = f" on {e.node_id} at {e.host}:{e.port}" if e.port else (f" on {e.node_id}" if e.node_id else "")
            failure = f", last failure: {e.last_failure_reason}" if e.last_failure_reason else ""
            out[f"engine {e.engine_id}"] = (
                f"{enum_short_name(types_pb2.EngineState, e.state)}/{enum_short_name(types_pb2.HealthStatus, e.health)}"
                f"{where}{f' pid {e.pid}' if e.pid else ''} (restarts {e.restarts}{failure})"
            )
    return out


def changes(before: dict[str, str], after: dict[str, str], when: str) -> list[str]:
    """`when subject: now` for each subject that is new or changed, `when subject: gone` for the others."""
    lines = [f"{when} {subject}: {now}" for subject, now in after.items() if before.get(subject) != now]
    return lines + [f"{when} {subject}: gone" for subject in before if subject not in after]


def try_commands(cluster: LocalCluster) -> str:
    """What the screen suggests: grpcurl and motorctl commands that work on this cluster, and the
    line that points another shell's motorctl at it."""
    every = cluster.controller_addresses  # motorctl follows the leader among them
    line = cluster_address.export_line(cluster.run_dir, every, cluster.credentials("operator"))
    access = cluster.door_access
    door = f"{access.how_to(cluster.router_url)}\n" if cluster.router_port is not None and access.api_keys else ""
    return (
        door
        + _try_lines(cluster)
        + f"\nmotorctl in another shell reaches this cluster after:  {line}"
        + f"\n      (from {os.getcwd()}, motorctl finds .run/motorctl.env by itself)"
        * (os.path.abspath(cluster.run_dir) == os.path.abspath(cluster_address.DEFAULT_RUN_DIR))
    )


def _try_lines(cluster: LocalCluster) -> str:
    address = cluster.controller_address
    every = ",".join(cluster.controller_addresses)
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
    # A terminal gets the whole screen, redrawn; a log or a pipe the screen once, then the lines
    # that changed (a screen a second filled a redirected log with 350 KB in 6 minutes).
    terminal = sys.stdout.isatty()
    shown: dict[str, str] | None = None
    while not stopping():
        router = ""
        if cluster.router_port is not None:
            access = cluster.door_access.note()
            line = front.router_line(cluster.router_url, cluster.front_door_state(), cluster.router_admin_url, access)
            router = line + "\n"
        try:
            status = read_status(address, cluster.credentials("viewer"))
            screen = render_status(*status)
            subjects = {**status_subjects(*status), "router": router.strip()}
        except grpc.RpcError as exc:
            screen = f"controller not answering: {exc.code().name}"
            subjects = {"controller": screen}
        if terminal or shown is None:
            text = (
                f"{CLEAR if terminal else ''}Motor local cluster — controller {address} — "
                f"{time.strftime('%H:%M:%S')}\n\n{screen}\n\n{router}{hint}"
                + ("" if terminal else "\nFrom now on: what changes, one line each.")
            )
        else:
            text = "\n".join(changes(shown, subjects, time.strftime("%H:%M:%S")))
        shown = subjects
        if (not say(text) if text else reader_gone()) and not stopping():
            raise ReaderGone
        end = time.monotonic() + refresh
        while not stopping() and time.monotonic() < end:
            time.sleep(0.05)


def reader_gone() -> bool:
    """Whether stdout is a pipe its reader closed, found without writing (a quiet cluster prints
    nothing to a log for long): poll reports an error on such a pipe. Then stdout is quieted."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)  # no events asked: only errors and hang-ups come back
        gone = any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):  # no file descriptor (a test's stdout)
        return False
    if gone:
        quiet_stdout()
    return gone


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
