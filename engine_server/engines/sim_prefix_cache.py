"""The simulated engine's prefix cache, as vLLM's automatic prefix caching keeps one: a prompt's
full blocks (BLOCK_SIZE tokens) are hashed in a chain (each block's hash covers its parent's), a
request reuses the longest run of its leading blocks still cached and computes the rest, and the
cache holds at most `capacity` blocks, the least recently used evicted first.

Every change is a KV-cache event in vLLM's wire format (motor/contract/kv_events.py), published by
`SimKvEvents` (sim_kv_events.py): BlockStored for the blocks a prefill computed (with their token
ids, as vLLM sends them), BlockRemoved for those evicted, AllBlocksCleared when the cache is reset.
Hits are counted in tokens under vLLM's names (vllm:prefix_cache_queries, vllm:prefix_cache_hits),
so the fleet's hit rate reads the same from a simulated and a real engine.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

from prometheus_client import Counter

from motor.contract.kv_events import BLOCK_SIZE, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

PREFIX_QUERIES = Counter(
    "vllm:prefix_cache_queries",
    "Prefix cache queries, in terms of number of queried tokens.",
    ["model_name", "engine"],
)
PREFIX_HITS = Counter(
    "vllm:prefix_cache_hits",
    "Prefix cache hits, in terms of number of cached tokens.",
    ["model_name", "engine"],
)


def _block_hash(parent: int | None, tokens: Sequence[int], extra: str) -> int:
    """The engine's own block hash (an int, as vLLM's ExternalBlockHash may be)."""
    digest = hashlib.blake2b((parent or 0).to_bytes(8, "little"), digest_size=8)
    digest.update(extra.encode())
    digest.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return int.from_bytes(digest.digest(), "little") >> 1  # (fits msgpack's int64)


class SimPrefixCache:
    """`lookup` says how many of a prompt's tokens are cached; `store` puts its blocks in (after its
    prefill), evicting the least recently used; each change goes to `publish` as events."""

    def __init__(
        self,
        capacity: int,
        publish: Callable[[list[KVCacheEvent]], None],
        labels: tuple[str, str],
        block_size: int = BLOCK_SIZE,
    ):
        self.capacity, self.block_size, self.publish = capacity, block_size, publish
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._queries, self._hits = (c.labels(*labels) for c in (PREFIX_QUERIES, PREFIX_HITS))
        self.queried = self.hit = 0  # tokens, for tests and the bench

    def hashes(self, token_ids: Sequence[int], adapter: str | None = None) -> list[int]:
        """The chained hashes of the prompt's full blocks (an adapter's blocks are its own)."""
        hashes: list[int] = []
        parent = None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = _block_hash(parent, token_ids[start : start + self.block_size], adapter or "")
            hashes.append(parent)
        return hashes

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def lookup(self, token_ids: Sequence[int], adapter: str | None = None) -> int:
        """Tokens of the prompt's prefix that are cached (counted as a query and its hits)."""
        cached = 0
        for block_hash in self.hashes(token_ids, adapter):
            if block_hash not in self._blocks:
                break
            cached += self.block_size
        # As vLLM: the last token is always computed, so a wholly cached prompt hits one block less.
        if cached and cached >= len(token_ids):
            cached -= self.block_size
        self.queried += len(token_ids)
        self.hit += cached
        self._queries.inc(len(token_ids))
        self._hits.inc(cached)
        return cached

    def store(self, token_ids: Sequence[int], adapter: str | None = None) -> None:
        """The prompt's blocks cached, most recently used; new ones published, evicted ones too."""
        if self.capacity <= 0:
            return
        hashes = self.hashes(token_ids, adapter)[: self.capacity]
        new = [i for i, h in enumerate(hashes) if h not in self._blocks]
        # Touched leaf first, so a prefix outlives its extensions (vLLM frees a request's blocks
        # tail first): evicting from the front then drops the longest chains' ends before their roots.
        for block_hash in reversed(hashes):
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        events: list[KVCacheEvent] = []
        if new:
            first = new[0]
            # (new blocks follow the cached prefix: a chain's cached blocks come first)
            stored = hashes[first:]
            events.append(
                BlockStored(
                    block_hashes=stored,
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=list(token_ids[first * self.block_size : len(hashes) * self.block_size]),
                    block_size=self.block_size,
                    lora_id=None,
                    medium="GPU",
                    lora_name=adapter,
                )
            )
        evicted = []
        while len(self._blocks) > self.capacity:
            evicted.append(self._blocks.popitem(last=False)[0])
        if evicted:
            events.append(BlockRemoved(block_hashes=evicted, medium="GPU"))
        if events:
            self.publish(events)

    def clear(self) -> None:
        self._blocks.clear()
        self.publish([AllBlocksCleared()])
