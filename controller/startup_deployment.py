"""--deployment FILE at start-up (docs/controller.md, "A lost database").

The file seeds a new store (a first start, or a lost database: no deployment ever applied), once.
A store that knows a deployment is never changed by it: the stored revision may be an operator's
newer apply, and under HA every controller is given the file and calls this on each election it
wins (an election must never change the desired state). On a new store applying at once would
place and start every engine before the node managers still running the lost store's engines
have registered: nothing could be adopted, every engine would start again elsewhere and the old
copies be fenced. So there the file waits, until
the first of:
- the registered nodes run every engine it describes: all of it can be adopted, nothing to wait for;
- `--startup-grace` (default: the node grace) has passed since the start: what has not registered
  by then is not waited for (a brand-new cluster, whose nodes run nothing, waits this long).
An ApplyDeployment or DeleteDeployment arriving meanwhile is the operator's newer word: the file is
then not applied.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from controller.rules.deployment_checks import validate_deployment
from controller.rules.expansion import expand
from motor.contract import names
from motor.v1 import controller_pb2

if TYPE_CHECKING:
    from controller.core import Controller

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2  # how often the registered nodes' engines are looked at while deferred


class StartupDeployment:
    def __init__(self, controller: Controller, path: str, deployment: controller_pb2.Deployment, window: float):
        """`window`: the startup grace (s). An invalid deployment raises InvalidArgument here."""
        self.controller, self.path, self.window = controller, path, window
        self.wanted = wanted = validate_deployment(deployment, controller.config.max_engines_per_deployment)
        self.engine_ids = {
            names.engine_id(spec.instance_id, rank)
            for spec in expand(wanted).values()
            for rank in range(spec.data_parallel_size)
        }

    def begin(self) -> None:
        """On a new store: apply now, or defer (a task of the controller's, stopped with it).
        On a store that knows a deployment: nothing but a line saying so."""
        controller = self.controller
        if not controller.adoption.waiting:
            # Deployments are named: the file is held against the one of its name.
            stored, revision = controller.deployments.by_name.get(self.wanted.name, (None, 0))
            held = (
                f"no deployment named {self.wanted.name} (deleted, or never applied)"
                if stored is None
                else "the same deployment"
                if _same(self.wanted, stored)
                else "a different deployment"
            )
            logger.info(
                "%s not applied: the store holds revision %d, %s (a --deployment file seeds a new store only; "
                "`motorctl apply -f FILE` changes a running cluster's deployments)",
                self.path,
                revision,
                held,
            )
        elif self.window > 0:
            logger.info(
                "start-up deployment deferred: the store is new (no deployment ever applied: a first start "
                "or a lost database), so %s waits until the registered nodes run the %d engine(s) it describes "
                "(they are adopted, not restarted), for at most --startup-grace %gs",
                self.path,
                len(self.engine_ids),
                self.window,
            )
            self.controller.spawn(self._deferred(), "start-up deployment")
        else:
            self.apply_now()

    def apply_now(self) -> None:
        _, revision = self.controller.apply_deployment(self.wanted)
        logger.info("applied %s at start-up to a new store (revision %d)", self.path, revision)

    def missing(self) -> set[str]:
        """The engines the file describes that no READY node runs (yet)."""
        return self.engine_ids - self.controller.adoption.live_copies().keys()

    async def _deferred(self) -> None:
        controller = self.controller
        began = controller.mono()
        while controller.adoption.waiting and controller.mono() - began < self.window and self.missing():
            await asyncio.sleep(POLL_SECONDS)
        missing = self.missing()
        nodes = len(controller.state.nodes)
        why = (
            f"the {nodes} registered node(s) run every engine it describes"
            if not missing
            else f"--startup-grace {self.window:g}s passed with {len(self.engine_ids) - len(missing)} of its "
            f"{len(self.engine_ids)} engine(s) running on the {nodes} registered node(s)"
        )
        applied = await controller.apply_on_new_store(self.wanted)
        waited = controller.mono() - began
        if applied is None:
            logger.info(
                "start-up deployment %s not applied after %.1fs: an ApplyDeployment or DeleteDeployment came first",
                self.path,
                waited,
            )
        else:
            logger.info(
                "start-up deployment applied after %.1fs: %s (revision %d): %s", waited, self.path, applied[1], why
            )


def _same(a: controller_pb2.Deployment, b: controller_pb2.Deployment) -> bool:
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)
