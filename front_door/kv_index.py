"""What each engine copy holds in its prefix cache, as its KV events tell (front_door/kv_routing.py
keeps one `EngineIndex` per engine copy: a new generation starts with a new, empty one).

Keys are the door's own (motor/contract/kv_events.py `prefix_keys`), computed from the token ids a
`BlockStored` carries, so the door never needs the engine's hash function: an engine block hash is
only mapped to the door's key, for the `BlockRemoved` that names it later. Blocks are kept per
adapter (`lora_name`; None: the base model), as an engine keeps them apart.

Trust: a batch whose sequence number is not the next one (a batch lost, or a publisher that
restarted) clears the engine's index, which then fills again from the next events; a block whose
parent the door does not know is skipped. Blocks the door itself sent a request for are held as
`pending` for PENDING_S, so that requests that share a prefix and arrive before the engine's events
go to the same engine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from motor.contract.kv_events import BLOCK_SIZE, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, block_key

PENDING_S = 5.0


class EngineIndex:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.keys: dict[str | None, set[bytes]] = {}  # adapter (None: base model) -> door keys cached
        self._by_hash: dict[Any, tuple[str | None, bytes]] = {}  # engine block hash -> (adapter, door key)
        self._pending: dict[tuple[str | None, bytes], float] = {}  # sent here, not yet stored -> until
        self.seq = -1  # the last batch's sequence number (-1: none yet)
        # Tokens a block, as the engine's events say (vLLM's CPU backend uses 128, its GPU ones 16).
        self.block_size = BLOCK_SIZE
        self.gaps = 0

    def blocks(self) -> int:
        return sum(len(keys) for keys in self.keys.values())

    def clear(self) -> None:
        self.keys.clear()
        self._by_hash.clear()
        self._pending.clear()

    def apply(self, seq: int, batch: EventBatch) -> bool:
        """One batch taken in; False when it showed a gap (the index was cleared first)."""
        whole = self.seq < 0 or seq == self.seq + 1
        if not whole:
            self.gaps += 1
            self.clear()
        self.seq = seq
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    found = self._by_hash.pop(_hashable(block_hash), None)
                    if found is not None:
                        self.keys.get(found[0], set()).discard(found[1])
            elif isinstance(event, AllBlocksCleared):
                self.clear()
        return whole

    def _stored(self, event: BlockStored) -> None:
        adapter = event.lora_name
        if event.parent_block_hash is None:
            parent = b""
        else:
            known = self._by_hash.get(_hashable(event.parent_block_hash))
            if known is None:
                return  # its prefix is unknown to the door (a gap cleared it): keyed from the next root
            parent = known[1]
        keys = self.keys.setdefault(adapter, set())
        size = self.block_size = event.block_size
        for index, block_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[index * size : (index + 1) * size]
            if len(tokens) < size:
                break
            parent = block_key(parent, tokens)
            keys.add(parent)
            self._by_hash[_hashable(block_hash)] = (adapter, parent)
            self._pending.pop((adapter, parent), None)

    def sent(self, adapter: str | None, keys: Sequence[bytes]) -> None:
        """The door sent a request of these blocks here: held as cached until PENDING_S have passed."""
        until = self.clock() + PENDING_S
        for key in keys:
            self._pending[(adapter, key)] = until
        if len(self._pending) > 4 * (self.blocks() + 1024):  # (expired ones swept now and then)
            now = self.clock()
            self._pending = {k: t for k, t in self._pending.items() if t > now}

    def matched(self, adapter: str | None, keys: Sequence[bytes]) -> int:
        """How many of the leading blocks `keys` are cached here (or just sent here)."""
        cached, now = self.keys.get(adapter, set()), self.clock()
        count = 0
        for key in keys:
            if key not in cached and self._pending.get((adapter, key), 0.0) <= now:
                break
            count += 1
        return count


def _hashable(block_hash: Any) -> Any:
    return tuple(block_hash) if isinstance(block_hash, list) else block_hash
