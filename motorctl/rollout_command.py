"""`motorctl rollout status|pause|resume|undo [NAME]`: a deployment's rolling update.

`status` exits 0 when the rollout is complete (the new revision's desired count available), 4 when
it is paused (by an operator or by a failing new instance: the reason names it), 3 while it
progresses; `--wait SECONDS` waits for it to complete or pause first. Like every motorctl command it
exits 1 when the controller cannot be reached or refuses the call, 2 on bad input (an unknown name).
"""

from __future__ import annotations

import argparse
import time

from motor.errors import NotFound
from motor.v1 import controller_pb2, controller_pb2_grpc
from motorctl import render

C = controller_pb2
# Apart from 1 (unreachable, refused) and 2 (bad input), which every motorctl command uses.
EXIT_BY_STATE = {C.ROLLOUT_STATE_COMPLETE: 0, C.ROLLOUT_STATE_PAUSED: 4, C.ROLLOUT_STATE_PROGRESSING: 3}


def add_parser(sub) -> None:
    rollout = sub.add_parser(
        "rollout",
        help="a deployment's rolling update: status (exit 0 complete, 3 in progress, 4 paused; 1 unreachable), pause, "
        "resume, undo (back to the previous revision, rolled out alike)",
    )
    rollout.add_argument("action", choices=["status", "pause", "resume", "undo"])
    rollout.add_argument("name", nargs="?", default="", help="the deployment (may be left out when there is one)")
    rollout.add_argument(
        "--wait", type=float, default=0.0, help="status: wait up to this many seconds for it to complete or pause"
    )


def run(args: argparse.Namespace, stub: controller_pb2_grpc.ControllerServiceStub, out, as_json: bool, show) -> int:
    t = args.timeout
    if args.action == "pause":
        stub.PauseRollout(C.PauseRolloutRequest(name=args.name), timeout=t)
        print("{}" if as_json else "rollout paused", file=out)
    elif args.action == "resume":
        stub.ResumeRollout(C.ResumeRolloutRequest(name=args.name), timeout=t)
        print("{}" if as_json else "rollout resumed", file=out)
    elif args.action == "undo":
        reply = stub.UndoRollout(C.UndoRolloutRequest(name=args.name), timeout=t)
        print(
            show(reply)
            if as_json
            else f"deployment {reply.deployment.name!r} back to the previous spec "
            f"(revision {reply.revision}); rolling out",
            file=out,
        )
    else:
        deadline = time.monotonic() + args.wait
        while True:
            summary = _summary(stub, args.name, t)
            if summary.rollout_state != C.ROLLOUT_STATE_PROGRESSING or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        print(show(summary) if as_json else render.render_rollout(summary), file=out)
        return EXIT_BY_STATE.get(summary.rollout_state, 3)
    return 0


def _summary(stub: controller_pb2_grpc.ControllerServiceStub, name: str, timeout: float) -> C.DeploymentSummary:
    deployments = stub.ListDeployments(C.ListDeploymentsRequest(), timeout=timeout).deployments
    if not name and len(deployments) == 1:
        return deployments[0]
    for summary in deployments:
        if summary.deployment.name == name:
            return summary
    known = ", ".join(d.deployment.name for d in deployments) or "none"
    raise NotFound(
        f"name: no deployment is named {name!r} (deployments: {known})"
        if name
        else f"name: required: {len(deployments)} deployments exist ({known})"
    )
