"""motorctl: the controller's command-line client.

motorctl [--controller HOST:PORT[,HOST:PORT...]] [--output table|json] [--cacert CA [--cert C --key K | --token-file
T]] COMMAND
nodes | instances | endpoints [--role R] [--model M] | events [--follow] [--deployment NAME] | deployments
| deployment [NAME] | apply [--dry-run] -f FILE [-f FILE...] | delete [NAME] | controllers
| rollout status|pause|resume|undo [NAME]
up ...  (a local cluster; see `motorctl up --help`); down --run-dir DIR (stop one whose `motorctl up` was killed)
pki init|issue|tokens|dev ...  (a development PKI; see `motorctl pki --help`)
tiny-model [DIR]  (a tiny random-weight Llama made locally, to try the real vLLM engine)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import grpc
from google.protobuf import json_format

from motor.contract.deployment_file import load_deployment
from motor.contract.names import parse_role
from motor.errors import MotorError
from motor.leader import FOLLOW_RETRY_BASE, FOLLOW_RETRY_CAP, ControllerAddresses, backoff_delay, parse_addresses
from motor.v1 import controller_pb2, controller_pb2_grpc, types_pb2
from motorctl import cluster_address, render, rollout_command
from motorctl.connect import add_credential_flags, credentials_from, tls_mismatch
from motorctl.pages import all_pages


def _json(message) -> str:
    return json.dumps(json_format.MessageToDict(message, preserving_proto_field_name=True), indent=2, sort_keys=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="motorctl", description="Command-line client of the Motor controller.")
    p.add_argument(
        "--controller",
        help="controller address, or several comma-separated (the leader is followed); without it: env "
        "MOTOR_CONTROLLER, else the cluster of ./.run/motorctl.env (`make run` from here, with its credentials), "
        f"else {cluster_address.FALLBACK}",
    )
    p.add_argument("--output", "-o", choices=["table", "json"], default="table", help="output format [table]")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the controller [10]")
    add_credential_flags(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    nodes = sub.add_parser("nodes", help="nodes with state, generation, free accelerators, engines")
    instances = sub.add_parser("instances", help="instances and their engines (node, ports, state, health, restarts)")
    endpoints = sub.add_parser("endpoints", help="inference endpoints of NORMAL engines")
    for listing, fields in (
        (nodes, "node_id, state, host"),
        (instances, "instance_id, group, state, role, deployment"),
        (endpoints, "engine_id, instance_id, role, deployment, model"),
    ):
        listing.add_argument(
            "--filter",
            default="",
            help=f"only items matching every field=value term (value* for a prefix); fields: {fields}",
        )
    endpoints.add_argument("--role", help="prefill, decode or union")
    endpoints.add_argument("--model", default="", help="only engines that answer to this model name")
    events = sub.add_parser("events", help="recent events; --follow keeps streaming")
    events.add_argument("--follow", "-f", action="store_true", help="stream new events until Ctrl-C")
    events.add_argument("--deployment", "-d", default="", help="only the events of this deployment")
    sub.add_parser("deployments", help="every deployment: model, revision, instances READY and PENDING")
    deployment = sub.add_parser("deployment", help="a deployment and its revision")
    deployment.add_argument(
        "name", nargs="?", default="", help="its name (may be left out when there is one deployment)"
    )
    apply = sub.add_parser(
        "apply", help="apply deployment files (YAML or JSON), each creating or updating the deployment it names"
    )
    apply.add_argument(
        "-f", "--file", required=True, action="append", help="deployment file; repeat for several, applied in order"
    )
    apply.add_argument(
        "--dry-run",
        action="store_true",
        help="have the controller check each file as an apply would, and change nothing",
    )
    delete = sub.add_parser("delete", help="delete a deployment and stop its engines (the others are untouched)")
    delete.add_argument("name", nargs="?", default="", help="its name (may be left out when there is one deployment)")
    sub.add_parser("controllers", help="the controllers: leader, standbys, epoch, lease (docs/ha.md)")
    rollout_command.add_parser(sub)
    sub.add_parser("up", help="start a local cluster (controller, node managers, example deployment)", add_help=False)
    sub.add_parser(
        "down",
        help="stop the local cluster of a `motorctl up` that was killed (see `motorctl down --help`)",
        add_help=False,
    )
    sub.add_parser("pki", help="development PKI: CA, certificates, tokens (see `motorctl pki --help`)", add_help=False)
    sub.add_parser(
        "tiny-model",
        help="make a tiny random-weight Llama in DIR (no model hub), to try the real vLLM engine (`make run-vllm`)",
        add_help=False,
    )
    return p


def run(args: argparse.Namespace, out=sys.stdout) -> int:
    """Run the command on the first controller that takes it: with several addresses, an
    unreachable one is skipped and a standby's refusal names the leader to ask (motor/leader.py);
    during a failover (no leader yet) they are tried in turn, with a short backoff, until --timeout."""
    controllers = ControllerAddresses(parse_addresses(args.controller, "--controller"))
    deadline = time.monotonic() + args.timeout
    failures = 0
    while True:
        try:
            with credentials_from(args).channel(controllers.current) as channel:
                return _command(args, controller_pb2_grpc.ControllerServiceStub(channel), out)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            failures += 1
            if not controllers.after_failure(exc) and not controllers.several:
                raise  # the only controller there is did not take it
            delay = backoff_delay(failures, FOLLOW_RETRY_BASE, FOLLOW_RETRY_CAP)
            if time.monotonic() + delay >= deadline:
                raise
            time.sleep(delay)


def _command(args: argparse.Namespace, stub: controller_pb2_grpc.ControllerServiceStub, out) -> int:
    t = args.timeout
    as_json = args.output == "json"
    if args.command == "nodes":
        reply = all_pages(stub.ListNodes, controller_pb2.ListNodesRequest(filter=args.filter), "nodes", t)
        print(_json(reply) if as_json else render.render_nodes(reply), file=out)
    elif args.command == "instances":
        reply = all_pages(stub.ListInstances, controller_pb2.ListInstancesRequest(filter=args.filter), "instances", t)
        print(
            _json(reply)
            if as_json
            else render.standby_banner(reply) + render.render_instances(reply) + "\n\n" + render.render_engines(reply),
            file=out,
        )
    elif args.command == "endpoints":
        role = parse_role(args.role, "--role") if args.role else types_pb2.ROLE_UNSPECIFIED
        reply = all_pages(
            stub.ListEndpoints,
            controller_pb2.ListEndpointsRequest(role=role, filter=args.filter, model=args.model),
            "endpoints",
            t,
        )
        print(_json(reply) if as_json else render.render_endpoints(reply), file=out)
    elif args.command == "deployments":
        reply = stub.ListDeployments(controller_pb2.ListDeploymentsRequest(), timeout=t)
        print(_json(reply) if as_json else render.render_deployments(reply), file=out)
    elif args.command == "deployment":
        reply = stub.GetDeployment(controller_pb2.GetDeploymentRequest(name=args.name), timeout=t)
        if as_json:
            print(_json(reply), file=out)
        else:
            import yaml

            body = json_format.MessageToDict(reply.deployment, preserving_proto_field_name=True)
            print(f"# revision {reply.revision}\n" + yaml.safe_dump(body, sort_keys=False), file=out, end="")
    elif args.command == "apply":
        deployments = [load_deployment(path) for path in args.file]  # every file read before any is applied
        for deployment in deployments:  # one after another: a refusal stops there, the earlier ones stay applied
            request = controller_pb2.ApplyDeploymentRequest(deployment=deployment, dry_run=args.dry_run)
            reply = stub.ApplyDeployment(request, timeout=t)
            if as_json:
                print(_json(reply), file=out)
            elif args.dry_run:
                print(
                    f"deployment {reply.deployment.name!r} is valid; an apply would make it revision {reply.revision} "
                    "(dry run: nothing changed)",
                    file=out,
                    flush=True,
                )
            else:
                print(f"deployment {reply.deployment.name!r} applied (revision {reply.revision})", file=out, flush=True)
    elif args.command == "rollout":
        return rollout_command.run(args, stub, out, as_json, _json)
    elif args.command == "controllers":
        reply = stub.ListControllers(controller_pb2.ListControllersRequest(), timeout=t)
        print(_json(reply) if as_json else render.render_controllers(reply), file=out)
    elif args.command == "delete":
        stub.DeleteDeployment(controller_pb2.DeleteDeploymentRequest(name=args.name), timeout=t)
        print(
            "{}"
            if as_json
            else f"deployment {args.name + ' ' if args.name else ''}deleted; its engines are being stopped",
            file=out,
        )
    elif args.command == "events":
        stream = stub.WatchEvents(
            controller_pb2.WatchEventsRequest(deployment=args.deployment), timeout=None if args.follow else t
        )
        try:
            for message in stream:
                if message.HasField("snapshot"):
                    for event in message.snapshot.recent_events:
                        print(
                            _json(event).replace("\n", " ") if as_json else render.render_event(event),
                            file=out,
                            flush=True,
                        )
                    if not args.follow:
                        break
                else:
                    print(
                        _json(message.event).replace("\n", " ") if as_json else render.render_event(message.event),
                        file=out,
                        flush=True,
                    )
        finally:
            stream.cancel()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "up":  # the local cluster has its own flags
        from motorctl import up

        return up.main(argv[argv.index("up") + 1 :])
    if args.command == "down":
        from motorctl import run_processes

        return run_processes.main(argv[argv.index("down") + 1 :])
    if args.command == "pki":
        from motorctl import pki_command

        return pki_command.main(argv[argv.index("pki") + 1 :])
    if args.command == "tiny-model":
        from motorctl import tiny_model

        return tiny_model.main(argv[argv.index("tiny-model") + 1 :])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    where = "--controller"
    if args.controller is None:  # the cluster this shell or directory belongs to (motorctl/cluster_address.py)
        found = cluster_address.find()
        args.controller, where = found.controller, found.source
        for attribute, path in found.credentials.items():
            if getattr(args, attribute) is None:
                setattr(args, attribute, path)
    try:
        return run(args)
    except (MotorError, ValueError) as exc:  # a malformed file, an unknown role, a bad --controller
        print(f"motorctl: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            mismatch = tls_mismatch(parse_addresses(args.controller, "--controller")[0], credentials_from(args))
            if mismatch:
                print(f"motorctl: controller {args.controller}: {mismatch}", file=sys.stderr)
            else:
                print(
                    f"motorctl: controller {args.controller} (from {where}) is not reachable ({exc.details()})",
                    file=sys.stderr,
                )
        else:
            print(f"motorctl: {code.name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`motorctl events | head`): end quietly, as SIGPIPE would
        render.quiet_stdout()
        return 141


if __name__ == "__main__":
    sys.exit(main())
