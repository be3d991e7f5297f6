"""LoRA adapters at run time: a deployment lists adapters (name, path under the node's model
root); every engine of the deployment that can serve gets them loaded through the engine's own
runtime LoRA API, vLLM's (`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`, served
with VLLM_ALLOW_RUNTIME_LORA_UPDATING; the simulated engine emulates it), without a restart.

`AdapterSync` compares, per engine, the adapters loaded (in memory: after a controller restart
they are loaded again, and vLLM's "already loaded" counts as loaded) with the deployment's list,
and loads or unloads the difference, one call at a time per engine. An adapter to unload leaves
the engine's endpoint first, and the engine unloads it once no front door routes to it (the
sync's reports: its router no longer holds the adapter's worker), at most WITHDRAW_WAIT later:
a request naming it never reaches an engine that no longer has it. A failed load is one
EVENT_TYPE_ADAPTER event naming the adapter and the engine's answer; it is not tried again until
the deployment's list changes (or the engine is replaced). The engine stays in service with the
adapters that did load, and its endpoint lists only those (controller/routing/endpoints.py).
"""

from __future__ import annotations

import asyncio
import logging
import posixpath
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

import aiohttp

from controller.model.cluster import ClusterState
from controller.model.slots import EngineSlot
from controller.routing.door_reports import FrontDoors
from motor.contract.router_workers import adapter_worker_url
from motor.engine_key import authorization, engine_key
from motor.v1 import controller_pb2, types_pb2

logger = logging.getLogger(__name__)

C, T = controller_pb2, types_pb2
CALL_TIMEOUT = 60.0  # loading an adapter reads its weights
# How long an unload waits for the front doors to stop routing to the adapter's worker: a few of
# the sync's report intervals (2 s); a stale front door (its sync gone) is waited out this long.
WITHDRAW_WAIT = 10.0
WITHDRAW_POLL = 0.1


@dataclass
class EngineAdapters:
    """What one copy (generation) of an engine has loaded, and the loads it refused."""

    generation: int
    loaded: dict[str, str] = field(default_factory=dict)  # name -> path
    failed: dict[str, str] = field(default_factory=dict)  # name -> the path that failed
    busy: bool = False  # a call in flight


class AdapterSync:
    def __init__(self, state: ClusterState, spawn: Callable[[Coroutine, str], asyncio.Task], front_doors: FrontDoors):
        self.state, self.spawn, self.front_doors = state, spawn, front_doors
        self.engines: dict[str, EngineAdapters] = state.engine_adapters
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def pass_once(self) -> None:
        """Start a sync for every serving engine whose adapters differ from its deployment's."""
        st = self.state
        for engine_id in [e for e in self.engines if e not in st.slots]:  # engines gone with their instance
            del self.engines[engine_id]
        if not st.deployments.any_adapters() and not self.engines:
            return  # no deployment has adapters: nothing to look at
        for slot in st.slots.values():
            inst = st.instances.get(slot.instance_id)
            wanted = st.deployments.adapters(st.deployment_of(inst)) if inst is not None else {}
            held = self.engines.get(slot.engine_id)
            if held is not None and held.generation != slot.generation:  # a new copy starts with none loaded
                del self.engines[slot.engine_id]
                st.engines_changed([slot.engine_id])
                held = None
            if (not wanted and held is None) or (held is not None and held.busy) or not self._serving(slot):
                continue
            held = held or self.engines.setdefault(slot.engine_id, EngineAdapters(slot.generation))
            loads = {n: p for n, p in wanted.items() if held.loaded.get(n) != p and held.failed.get(n) != p}
            unloads = [n for n, p in held.loaded.items() if wanted.get(n) != p]
            if loads or unloads:
                held.busy = True
                self.spawn(self._sync(slot, held, loads, unloads), f"adapters of {slot.engine_id}")

    def _serving(self, slot: EngineSlot) -> bool:
        return (
            bool(slot.node_id and slot.port)
            and slot.state == T.ENGINE_STATE_RUNNING
            and slot.health == T.HEALTH_STATUS_NORMAL
        )

    async def _sync(self, slot: EngineSlot, held: EngineAdapters, loads: dict[str, str], unloads: list[str]) -> None:
        try:
            base = f"http://{slot.host}:{slot.port}"
            for name in unloads:
                path = held.loaded.pop(name)  # out of the engine's endpoint first
                self.state.engines_changed([slot.engine_id])
                await self._unrouted(adapter_worker_url(base, name))
                status, answer = await self._post(f"{base}/v1/unload_lora_adapter", {"lora_name": name})
                if status in (200, 404):  # 404: not loaded there (any more)
                    self._announce(slot, f"adapter {name!r} unloaded from engine {slot.engine_id}")
                else:  # still loaded: listed again, and tried again on a later pass
                    held.loaded[name] = path
                    self._announce(
                        slot, f"adapter {name!r} could not be unloaded from engine {slot.engine_id}: {answer}"
                    )
            node = self.state.nodes.get(slot.node_id)
            roots = list(node.info.model_roots) if node is not None else []
            for name, path in loads.items():
                if not roots:
                    self._failed(
                        slot,
                        held,
                        name,
                        path,
                        f"node {slot.node_id} has no model root (--model-root) to read adapters from",
                    )
                    continue
                status, answer = await self._post(
                    f"{base}/v1/load_lora_adapter", {"lora_name": name, "lora_path": posixpath.join(roots[0], path)}
                )
                if status == 200 or (
                    status == 400 and "already been loaded" in answer
                ):  # loaded before a controller restart
                    held.loaded[name] = path
                    held.failed.pop(name, None)
                    self._announce(slot, f"adapter {name!r} ({path}) loaded into engine {slot.engine_id}")
                else:
                    self._failed(slot, held, name, path, answer)
        finally:
            held.busy = False

    async def _unrouted(self, worker_url: str) -> None:
        """Until no front door routes to `worker_url` (none reports at all: at once), at most
        WITHDRAW_WAIT."""
        until = self.state.mono() + WITHDRAW_WAIT
        while self.front_doors.doors and self.front_doors.may_route_to(worker_url) and self.state.mono() < until:
            await asyncio.sleep(WITHDRAW_POLL)

    def _failed(self, slot: EngineSlot, held: EngineAdapters, name: str, path: str, why: str) -> None:
        held.failed[name] = path
        self._announce(slot, f"adapter {name!r} ({path}) failed to load into engine {slot.engine_id}: {why}")

    def _announce(self, slot: EngineSlot, message: str) -> None:
        inst = self.state.instances.get(slot.instance_id)
        deployment = self.state.deployment_of(inst) if inst is not None else ""
        # About one engine: its endpoint (the models it answers to) is read again.
        self.state.event(
            C.EVENT_TYPE_ADAPTER,
            message,
            node_id=slot.node_id,
            instance_id=slot.instance_id,
            engine_id=slot.engine_id,
            deployment=deployment,
        )

    async def _post(self, url: str, body: dict) -> tuple[int, str]:
        """The status and, when not 200, the engine's answer (cut short); 0 when it did not answer."""
        try:
            if self._session is None:
                # the engines' key (motor/engine_key.py): their LoRA API asks for it
                self._session = aiohttp.ClientSession(headers=authorization(engine_key()))
            async with self._session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT)) as reply:
                text = "" if reply.status == 200 else (await reply.text()).strip()
                return reply.status, f"HTTP {reply.status}: {text[:300]}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return 0, f"no answer ({exc or type(exc).__name__})"
