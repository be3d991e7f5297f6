"""The simulated engine's KV-event publisher: a ZMQ PUB socket on `port` (tcp, all interfaces),
each batch sent as vLLM's ZmqEventPublisher sends it (motor/contract/kv_events.py), with its
sequence number counting up from 0, so a subscriber sees a gap when it missed a batch.

No replay socket: a subscriber that sees a gap clears that engine's index (it learns the cache
again from the next events), which is what Motor's front door does with vLLM as well."""

from __future__ import annotations

import logging
import time

import zmq

from motor.contract.kv_events import TOPIC, EventBatch, KVCacheEvent, encode

logger = logging.getLogger(__name__)


class SimKvEvents:
    def __init__(self, host: str, port: int, dp_rank: int = 0, topic: str = TOPIC):
        self.endpoint = f"tcp://{host}:{port}"
        self.dp_rank, self.topic = dp_rank, topic
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        self._socket.bind(f"tcp://{host}:{port}")
        self.seq = 0
        logger.info("sim engine publishes KV events on %s (topic %r)", self.endpoint, topic)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """One batch, never blocking (a subscriber too slow loses batches, and sees the gap)."""
        batch = EventBatch(ts=time.time(), events=events, data_parallel_rank=self.dp_rank)
        try:
            self._socket.send_multipart(encode(batch, self.seq, self.topic), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        self.seq += 1

    def close(self) -> None:
        self._socket.close(linger=0)
