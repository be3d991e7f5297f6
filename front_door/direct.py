"""A request the door sent straight to the engine it chose (front_door/kv_routing.py): when that
engine does not take it, before anything of its answer reached the client, the router gets it, as
if the door had never chosen. What the engine does not take: a 503 (it is draining, not serving,
loading or asleep: vLLM's and the sim's refusals), no connection, or a connection closed before an
answer (it died). Its other answers, errors included, are the client's, as the router would pass
them (vllm-router retries only a failure to reach an engine)."""

from __future__ import annotations

from typing import Protocol

from front_door.messages import Request
from front_door.router_pool import CONTINUING


class Owner(Protocol):
    sent: bytes

    def _to_router(self, request: Request, data: bytes, why: str) -> None: ...


def refused(status: int) -> bool:
    return status == 503


class Fallback:
    """Reads the engine's refusal to its end, then sends the request to the router."""

    def __init__(self, owner: Owner, request: Request, engine: str, status: int) -> None:
        self.owner, self.request, self.engine, self.status = owner, request, engine, status

    def body(self, data: bytes) -> None:
        pass

    def flush(self) -> None:
        pass

    def end(self, broken: bool) -> object:
        self.owner._to_router(self.request, self.owner.sent, f"the engine {self.engine} answered {self.status}")
        return CONTINUING
