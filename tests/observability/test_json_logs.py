"""JSON log lines (motor.service.logs): one object per line with the ids a line is about and the reason."""

from __future__ import annotations

import io
import json
import logging

from controller.model.events import EventBus
from motor.service.logs import JsonFormatter
from motor.v1 import controller_pb2


def capture(fields=None):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(fields))
    return stream, handler


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]  # each line is one object


def test_controller_events_carry_their_ids_and_reason():
    stream, handler = capture({"service": "controller"})
    logger = logging.getLogger("controller.model.events")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        EventBus().emit(
            controller_pb2.EVENT_TYPE_NODE_LOST, "node node-b lost: no heartbeat for 6.0s", node_id="node-b"
        )
        EventBus().emit(
            controller_pb2.EVENT_TYPE_ENGINE_FAILED,
            "engine decode-0/rank0 on node-a exited with code 1",
            node_id="node-a",
            instance_id="decode-0",
            engine_id="decode-0/rank0",
        )
    finally:
        logger.removeHandler(handler)
    lost, failed = lines(stream)
    assert lost["service"] == "controller" and lost["level"] == "INFO" and lost["time"].endswith("+00:00")
    assert lost["event"] == "node_lost" and lost["node_id"] == "node-b" and "engine_id" not in lost
    assert lost["reason"] == "node node-b lost: no heartbeat for 6.0s"
    assert (failed["node_id"], failed["instance_id"], failed["engine_id"]) == ("node-a", "decode-0", "decode-0/rank0")


def test_engine_lines_name_the_engine_and_process_ids_are_on_every_line():
    stream, handler = capture({"service": "node_manager", "node_id": "node-a"})
    logger = logging.getLogger("test.json.node")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("engine %s: abnormal heartbeat %d/%d: %s", "prefill-0/rank1", 2, 5, "probe timed out")
        try:
            raise OSError("no such file")
        except OSError:
            logger.error("could not read the engine records", exc_info=True)
    finally:
        logger.removeHandler(handler)
    engine, failure = lines(stream)
    assert (
        engine["node_id"] == "node-a"
        and engine["engine_id"] == "prefill-0/rank1"
        and engine["instance_id"] == "prefill-0"
    )
    assert engine["message"] == "engine prefill-0/rank1: abnormal heartbeat 2/5: probe timed out"
    assert failure["node_id"] == "node-a" and "engine_id" not in failure
    assert "OSError: no such file" in failure["exception"]
