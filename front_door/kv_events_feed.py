"""One engine copy's KV events, read from its ZMQ publisher into its `EngineIndex` until stopped
(the engine left the table, or a new generation replaced it). A message that is not a KV event
batch is skipped and said once; the socket reconnects by itself (ZMQ) when the engine restarts,
and the sequence gap that follows clears the index (kv_index.py)."""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from front_door.kv_index import EngineIndex
from motor.contract.kv_events import decode

logger = logging.getLogger(__name__)


class EventsFeed:
    def __init__(self, context: zmq.asyncio.Context, endpoint: str, index: EngineIndex, name: str) -> None:
        self.endpoint, self.index, self.name = endpoint, index, name
        self.batches = 0
        self._socket = context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, 100_000)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        said = False
        while True:
            frames = await self._socket.recv_multipart()
            try:
                seq, batch = decode(frames)
            except ValueError as exc:
                if not said:
                    logger.warning("KV events of %s from %s: %s (skipped)", self.name, self.endpoint, exc)
                    said = True
                continue
            self.batches += 1
            if not self.index.apply(seq, batch):
                logger.info("KV events of %s: a gap before batch %d; its index was cleared", self.name, seq)

    def stop(self) -> None:
        self._task.cancel()
        self._socket.close(linger=0)
