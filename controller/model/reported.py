"""What the controller keeps of each engine a node reported (`NodeRuntime.engines`): a plain
tuple, not the reported Engine message.

A reported Engine is a part of the heartbeat request it came in: keeping it keeps that
request's whole protobuf arena alive (about 900 bytes an engine; 1,250 for a message of its
own), it is one more object per engine for every complete garbage walk, and its spec carries
the deployment's engine config (config_json, possibly kilobytes) again for every engine. The
tuple holds what the controller reads on its own paths (id, state, generation, stop grace) and
the rest serialized; the config is one string shared by every engine reporting the same one.
A tuple of strings, numbers and bytes is not tracked by the garbage collector (CPython stops
tracking it at its first collection; a named tuple would stay tracked). ListNodes and adoption
read the whole message again (`message`): what a node reported is shown unchanged.
"""

from __future__ import annotations

import sys

from motor.contract import pbtime
from motor.v1 import types_pb2

# (engine id, state, spec.generation, stop grace in seconds or None, spec.config_json, the rest
# of the Engine serialized).
Reported = tuple[str, int, int, float | None, str, bytes]
ENGINE_ID, STATE, GENERATION, STOP_GRACE = 0, 1, 2, 3


def keep(engine: types_pb2.Engine, last: Reported | None = None) -> Reported:
    """The compact copy of a reported engine (it keeps nothing of the message). `last`: the copy
    kept of the engine's previous report, returned when nothing changed (the new one is freed at
    once: the next garbage collection has nothing new to walk)."""
    config = engine.spec.config_json
    if config:
        rest = types_pb2.Engine()
        rest.CopyFrom(engine)
        rest.spec.ClearField("config_json")
    else:
        rest = engine
    stop_grace = pbtime.seconds(engine.stop_grace) if engine.HasField("stop_grace") else None
    kept = (
        engine.engine_id,
        engine.state,
        engine.spec.generation,
        stop_grace,
        sys.intern(config),
        rest.SerializeToString(),
    )
    return last if kept == last else kept


def message(kept: Reported) -> types_pb2.Engine:
    """The Engine as the node reported it."""
    engine = types_pb2.Engine.FromString(kept[-1])
    if kept[-2]:
        engine.spec.config_json = kept[-2]
    return engine
