"""KV-cache events on the wire, as vLLM publishes them (vllm/distributed/kv_events.py): a ZMQ PUB
socket sends multipart (topic, sequence as 8 bytes big-endian, payload), the payload a msgpack
`EventBatch` of tagged `BlockStored` / `BlockRemoved` / `AllBlocksCleared`. The simulated engine
publishes these and the front door reads them, so both speak exactly vLLM's format; only the
fields Motor reads or writes are declared (msgspec ignores the rest when decoding).

Also the door's own prefix keys (`prefix_keys`): a chained hash of each full block of token ids.
The door never needs an engine's block hashes to match its own: a `BlockStored` carries its
blocks' token ids, so the door keys them itself (front_door/kv_index.py), whatever hash the
engine uses (vLLM's sha256/cbor seeded by PYTHONHASHSEED, the sim's blake2b).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec

BLOCK_SIZE = 16  # tokens per KV block (vLLM's default --block-size)
TOPIC = "kv-events"
SEQ_BYTES = 8


class KVCacheEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    # (no defaults: vLLM's decoder requires them, and omit_defaults would leave a default out)
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Any]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode(batch: EventBatch, seq: int, topic: str = TOPIC) -> list[bytes]:
    """The multipart message of one batch, as vLLM's ZmqEventPublisher sends it."""
    return [topic.encode(), seq.to_bytes(SEQ_BYTES, "big"), _encoder.encode(batch)]


def decode(frames: Sequence[bytes]) -> tuple[int, EventBatch]:
    """(sequence, batch) of one multipart message; raises ValueError on anything else."""
    if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
        raise ValueError(f"a KV event message is 3 frames (topic, seq, payload), got {len(frames)}")
    try:
        return int.from_bytes(frames[1], "big"), _decoder.decode(frames[2])
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a KV EventBatch: {exc}") from None


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The door's key of one full block after `parent`'s (b"" for the first block)."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens))
    return digest.digest()


def prefix_keys(token_ids: Sequence[int], block_size: int = BLOCK_SIZE, parent: bytes = b"") -> list[bytes]:
    """The keys of the full blocks of `token_ids` (a partial last block is never cached)."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys
