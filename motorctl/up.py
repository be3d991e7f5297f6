"""`motorctl up`: a local cluster on this machine (the `make run` job).

Starts a controller and N node managers as real processes, applies a deployment, shows the
cluster live until Ctrl-C, then stops every engine, node manager and the controller and checks
that no process is left behind. The cluster itself is motorctl/local_cluster.py's LocalCluster.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import signal
import sys

import grpc
from google.protobuf import json_format

from motor.contract.deployment_file import load_deployment
from motor.contract.engine_policy import local_paths_outside
from motor.errors import MotorError
from motor.ports import CONTROLLER_METRICS_PORT, free_port, port_is_free
from motor.service.signals import STOP_SIGNALS  # SIGHUP among them: the terminal was closed
from motorctl import cluster_address
from motorctl import guardian as cluster_guardian
from motorctl import router as front
from motorctl.cluster_processes import DEFAULT_CONTROLLER_PORT, PortTaken, ProcessExited, check_port_free
from motorctl.door_access import DoorAccess, development_access
from motorctl.local_cluster import LocalCluster
from motorctl.run_processes import describe, run_processes
from motorctl.up_screen import ReaderGone, say, watch
from node_manager import accelerators as host_accelerators

logger = logging.getLogger(__name__)

# /metrics of `motorctl up`: the controller on DEFAULT_METRICS_PORT, node manager i on
# DEFAULT_METRICS_PORT + 1 + i (node-a on the node managers' own default, 9472).
DEFAULT_METRICS_PORT = CONTROLLER_METRICS_PORT
SIM_ACCELERATORS = 4  # simulated accelerators per node manager unless --accelerators says otherwise
ACCELERATOR_KINDS = ("sim", "cpu", "gpu", "auto")


# `--kv-routing`: the engines publish their KV events (the controller asks every node manager for a
# port each) and the front door routes by them (docs/router.md, "KV routing").
KV_ROUTING_CONTROLLER, KV_ROUTING_DOOR = ("--kv-events",), ("--kv-routing",)


def accelerator_plan(
    kind: str, per_node: int | None, nodes: int, detect=host_accelerators.detect
) -> tuple[str, int, tuple[int, ...]]:
    """(the node managers' --accelerator-type, accelerators per node manager, the host's devices
    they share: node i gets the i-th run of them). sim: `per_node` simulated accelerators each.
    cpu, gpu, auto: the host's CPU cores or GPUs (node_manager/accelerators.py), shared out so that
    no two node managers hand the same device to their engines. ValueError naming the flag to change."""
    if per_node is not None and per_node < 1:
        raise ValueError(f"--accelerators {per_node}: must be at least 1")
    if kind == "sim":
        return "sim", per_node or SIM_ACCELERATORS, ()
    try:
        found = detect(kind)
    except MotorError as exc:
        raise ValueError(f"--accelerator-type {kind}: {exc}") from None
    what = "GPU(s)" if found.type == host_accelerators.GPU_TYPE else "CPU core(s)"
    have = f"this host has {len(found.ids)} {what} ({found.source}: {','.join(map(str, found.ids))})"
    if per_node is None:
        per_node = len(found.ids) // nodes
        if per_node == 0:
            raise ValueError(f"--nodes {nodes}: {have}, fewer than one per node manager; lower --nodes")
    elif per_node * nodes > len(found.ids):
        raise ValueError(
            f"--accelerators {per_node} x --nodes {nodes} needs {per_node * nodes} {what}, but {have}: lower "
            "--accelerators or --nodes (node managers of one host must not hand the same device to two engines)"
        )
    return found.type, per_node, found.ids


def local_path_problem(deployment_path: str, model_roots: list[str]) -> str | None:
    """What a node manager given only `model_roots` would refuse to start in the deployment (a
    local path outside them), worded with the flag to add; None when it names none (or does not
    load: the controller names what is wrong with it)."""
    try:
        deployment = load_deployment(deployment_path)
    except (MotorError, ValueError):
        return None
    engine_config = json_format.MessageToDict(deployment.engine_config)
    outside = local_paths_outside(engine_config, model_roots)
    if not outside:
        return None
    key, local = outside[0]
    allowed = (
        f"outside every --model-root ({', '.join(model_roots)})" if model_roots else "but no --model-root is given"
    )
    return (
        f"--deployment {deployment_path}: {key} names the local path {local!r}, {allowed}; the node managers "
        f"would refuse to start its engines: add --model-root DIR, a folder holding it (e.g. --model-root "
        f"{os.path.dirname(os.path.abspath(os.path.expanduser(local)))})"
    )


def _default_controller_port() -> int:
    return _default_port(DEFAULT_CONTROLLER_PORT)


def _default_port(port: int) -> int:
    return port if port_is_free(port) else free_port()


def vllm_missing(path: str) -> str | None:
    """Why the deployment at `path` cannot run here: it asks for vLLM, which this environment
    lacks (`make run` sets up the simulated engine only); None when it can."""
    from engine_server.engines import VLLM_INSTALL_HINT
    from motor.contract.deployment_file import load_deployment

    try:
        config = json_format.MessageToDict(load_deployment(path).engine_config)
    except MotorError:
        return None  # the controller names what is wrong with the file
    wants = any(isinstance(s, dict) and s.get("engine_type") == "vllm" for s in config.values())
    if not wants or importlib.util.find_spec("vllm") is not None:
        return None
    return f"--deployment {path}: its engine_config runs engine_type vllm: {VLLM_INSTALL_HINT}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="motorctl up", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2, help="node managers to start (default 2)")
    parser.add_argument("--deployment", default="examples/local-deployment.yaml", help="deployment file to apply")
    parser.add_argument("--run-dir", default=".run", help="state and logs of this cluster (wiped at start)")
    parser.add_argument("--controller-port", type=int, default=0, help="default 50051, or a free port if taken")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help=f"controller /metrics port, node manager i on this + 1 + i; a taken one is replaced by a free one; "
        f"0: no metrics (default {DEFAULT_METRICS_PORT})",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address every /metrics (and the controller's /discovery/engines, every engine's address) listens "
        "on: plaintext HTTP, so this host only unless you name another, e.g. 0.0.0.0 for a Prometheus elsewhere "
        "[127.0.0.1]",
    )
    parser.add_argument(
        "--router-port",
        type=int,
        default=0,
        help=f"port of the router (vllm-router) in front of the engines: default {front.ROUTER_PORT}, "
        "or a free port if taken",
    )
    parser.add_argument(
        "--api-keys",
        metavar="FILE",
        help="the front door takes only these API keys (a YAML key file, or a directory of them; docs/security.md); "
        "without it, and without --secure-door, the door is open to whoever reaches 127.0.0.1",
    )
    parser.add_argument("--tls-cert", metavar="FILE", help="the front door speaks TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", metavar="FILE", help="the front door's certificate's private key (PEM)")
    parser.add_argument(
        "--secure-door",
        action="store_true",
        help="the front door takes API keys and speaks TLS, with a development key and certificate made for this "
        "run in <run-dir>/door (the screen says how to use them)",
    )
    parser.add_argument(
        "--stream-continuations",
        type=int,
        default=None,
        metavar="N",
        help="the front door goes on with a stream cut by its engine's death on another engine, token for token, "
        "this many times at most (default 3; 0: never, a cut stream ends with an error event)",
    )
    parser.add_argument(
        "--kv-routing",
        action="store_true",
        help="the front door sends each request to the engine that holds most of its prompt's prefix in its KV "
        "cache, which it learns from the engines' KV events (the controller's --kv-events; docs/router.md)",
    )
    # Routing by model is the default now; the flag is still taken so that scripts keep working.
    parser.add_argument("--router-by-model", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--router-pd",
        action="store_true",
        help="prefill and decode engines as the router's prefill and decode workers: each request is prefilled on "
        "one and decoded on the other (its P/D flow)",
    )
    parser.add_argument(
        "--model-root",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder engines may read models from (local weights), handed to every node manager; repeatable",
    )
    parser.add_argument(
        "--accelerator-type",
        choices=ACCELERATOR_KINDS,
        default="sim",
        help="sim: simulated accelerators (the simulated engine); cpu: this host's CPU cores, each engine bound "
        "to its own (vLLM's CPU build); gpu: this host's GPUs (CUDA_VISIBLE_DEVICES, else NVML); auto: its GPUs "
        "if it has any, else its CPU cores [sim]",
    )
    parser.add_argument(
        "--accelerators",
        type=int,
        metavar="N",
        help=f"accelerators per node manager: sim ones [{SIM_ACCELERATORS}], or the host's cores or GPUs, which "
        "the node managers share without overlap [all of them, split evenly]",
    )
    parser.add_argument("--refresh", type=float, default=1.0, help="seconds between status refreshes")
    parser.add_argument(
        "--tls", action="store_true", help="mutual TLS on every plane, with a development PKI in <run-dir>/pki"
    )
    parser.add_argument(
        "--ha",
        action="store_true",
        help="high availability: one etcd member (etcd from PATH) and two controllers, the first on "
        "the usual port (docs/ha.md)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    if args.secure_door and (args.api_keys or args.tls_cert):
        parser.error("--secure-door makes its own key and certificate: give it, or --api-keys/--tls-cert, not both")
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    for flag, path in (("--api-keys", args.api_keys), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path and not os.path.exists(path):
            parser.error(f"{flag} {path}: no such file or directory")
    if not os.path.exists(args.deployment):
        parser.error(
            f"--deployment {args.deployment!r}: file not found (the default is relative to the repository "
            "root: run it from there, or give --deployment FILE)"
        )

    model_roots = [os.path.abspath(os.path.expanduser(root)) for root in args.model_root]
    for given, root in zip(args.model_root, model_roots):
        if not os.path.isdir(root):
            parser.error(f"--model-root {given}: no such folder")
    problem = local_path_problem(args.deployment, model_roots)
    if problem:
        parser.error(problem)
    # What this machine lacks after what the file gets wrong: the same answer with or without vLLM here.
    needs = vllm_missing(args.deployment)
    if needs:
        parser.error(needs)
    try:
        accelerator_type, per_node, host_devices = accelerator_plan(
            args.accelerator_type, args.accelerators, args.nodes
        )
    except ValueError as exc:
        parser.error(str(exc))

    if args.controller_port:
        try:
            check_port_free(args.controller_port)
        except PortTaken as exc:
            print(f"motorctl up: {exc}", file=sys.stderr)
            return 2
    live = run_processes(args.run_dir)
    if live:  # wiping it would pull the state directories from under a running cluster
        print(
            f"motorctl up: --run-dir {args.run_dir} is in use by a running cluster (processes "
            f"{', '.join(describe(p) for p in live[:5])}{' ...' if len(live) > 5 else ''}); stop it with "
            f"`motorctl down --run-dir {args.run_dir}`, or give this one another --run-dir",
            file=sys.stderr,
        )
        return 2
    shutil.rmtree(args.run_dir, ignore_errors=True)
    if args.secure_door:
        access = development_access(args.run_dir)
    else:
        paths = [os.path.abspath(p) if p else None for p in (args.api_keys, args.tls_cert, args.tls_key)]
        access = DoorAccess(*paths)
    if args.ha and not shutil.which("etcd"):
        parser.error("--ha needs etcd on PATH: install Debian's etcd-server (scripts/etcd-server.sh)")
    cluster = LocalCluster(
        args.run_dir,
        nodes=args.nodes,
        deployment_path=args.deployment,
        accelerators_per_node=per_node,
        accelerator_type=accelerator_type,
        host_accelerators=host_devices,
        model_roots=model_roots,
        controller_port=args.controller_port or _default_controller_port(),
        any_free_controller_port=not args.controller_port,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        tls=args.tls,
        ha=args.ha,
        router_port=args.router_port or _default_port(front.ROUTER_PORT),
        router_pd=args.router_pd,
        door_args=([] if args.stream_continuations is None else [f"--stream-continuations={args.stream_continuations}"])
        + (list(KV_ROUTING_DOOR) if args.kv_routing else []),
        extra_controller_args=list(KV_ROUTING_CONTROLLER) if args.kv_routing else [],
        door_access=access,
    )
    stopping, started = False, False
    # Stops the cluster if this process is killed before it can (SIGKILL, the OOM killer).
    guardian = cluster_guardian.spawn(args.run_dir)

    def request_stop(signum, frame):  # Ctrl-C, SIGTERM, the terminal closed: leave the loop, then clean up
        nonlocal stopping
        stopping = True
        if not started:
            raise KeyboardInterrupt  # abandon the start-up; the stop below cleans up

    for sig in STOP_SIGNALS:
        signal.signal(sig, request_stop)
    # Every way this ends (a signal, stdout closed under `| tee`, the controller dying while the
    # nodes register, any exception) goes through the stop below: no cluster is left running.
    status, failure = 0, ""
    try:
        what = "one etcd member, 2 controllers" if args.ha else "1 controller"
        if not say(f"Starting a local Motor cluster: {what}, {args.nodes} node managers (logs in {args.run_dir}/logs)"):
            raise ReaderGone
        cluster.start()
        started = True
        # motorctl in another shell (and from here, the run dir's env file) reaches this cluster, no other.
        cluster_address.write(args.run_dir, cluster.controller_addresses, cluster.credentials("operator"))
        watch(cluster, args.refresh, lambda: stopping)
    except ReaderGone:  # as SIGPIPE would end it, once the cluster is stopped
        status = 141
    except BaseException as exc:  # noqa: BLE001 (the cluster is stopped whatever happened; reported below)
        status, failure = 1, describe_failure(exc, cluster)
    started = True  # a second Ctrl-C now does not interrupt the stop
    say("\nStopping engines, node managers and the controller ...")
    cluster_address.forget(args.run_dir)
    problems = cluster.stop()
    cluster_guardian.release(guardian)
    for problem in problems:
        say(f"  {problem}")
    say("Stopped; no process left behind." if not problems else "Stopped (see above).")
    if failure:
        print(f"motorctl up: {failure}; see the logs in {args.run_dir}/logs", file=sys.stderr)
    return status


def describe_failure(exc: BaseException, cluster: LocalCluster) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"the controller at {cluster.controller_address} stopped answering ({exc.code().name}: {exc.details()})"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted while starting"
    plain = (TimeoutError, OSError, ProcessExited, PortTaken)
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, plain) else str(exc)
