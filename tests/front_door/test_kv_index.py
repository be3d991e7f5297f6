"""The door's KV index and scorer, alone: events in, prefixes matched, engines chosen."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry

from front_door.kv_index import PENDING_S, EngineIndex
from front_door.kv_routing import KvRouting
from motor.contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, prefix_keys
from motor.contract.sim_tokenizer import tokenize


def stored(hashes, tokens, parent=None, lora=None):
    return BlockStored(hashes, parent, tokens, 16, None, "GPU", lora)


def batch(*events):
    return EventBatch(ts=0.0, events=list(events))


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def test_blocks_stored_are_matched_by_the_doors_own_keys_whatever_the_engines_hashes():
    index = EngineIndex()
    tokens = list(range(48))
    index.apply(0, batch(stored([b"h1", b"h2"], tokens[:32])))
    index.apply(1, batch(stored([b"h3"], tokens[32:48], parent=b"h2")))
    keys = prefix_keys(tokens + [7] * 20)
    assert index.matched(None, keys) == 3 and index.blocks() == 3
    assert index.matched(None, prefix_keys([1] + tokens[1:])) == 0
    assert index.matched("lora", keys) == 0  # an adapter's blocks are its own
    index.apply(2, batch(BlockRemoved([b"h2"], "GPU")))
    assert index.matched(None, keys) == 1  # the chain breaks where a block went
    index.apply(3, batch(AllBlocksCleared()))
    assert index.blocks() == 0


def test_a_gap_in_the_sequence_clears_the_index_and_an_unknown_parent_is_skipped():
    index = EngineIndex()
    index.apply(0, batch(stored([1, 2], list(range(32)))))
    assert not index.apply(2, batch(stored([3], list(range(32, 48)), parent=2)))  # batch 1 lost
    assert index.blocks() == 0 and index.gaps == 1  # (and block 3's parent is unknown now: skipped)
    assert index.apply(3, batch(stored([4], [9] * 16))) and index.blocks() == 1


def test_blocks_the_door_sent_count_as_cached_for_a_while():
    clock = Clock()
    index = EngineIndex(clock)
    keys = prefix_keys(list(range(64)))
    index.sent(None, keys)
    assert index.matched(None, keys) == 4
    clock.now += PENDING_S + 0.1
    assert index.matched(None, keys) == 0


def routing(engines, served=None):
    kv = KvRouting(lambda: served or {"m": None}, CollectorRegistry())
    assert kv.take(engines) is None
    return kv


def engine(name, models=("m",)):
    return {"engine_id": name, "generation": 1, "url": f"http://{name}", "models": list(models), "tokenizer": "sim"}


def body(prompt):
    return json.dumps({"model": "m", "prompt": prompt}).encode()


SYSTEM = " ".join(f"w{n}" for n in range(160))  # 10 blocks


def test_the_engine_holding_the_prefix_wins_until_its_queue_costs_more():
    kv = routing([engine("a"), engine("b")])
    a = kv.engines["a"]
    ids = tokenize(SYSTEM + " q")
    a.index.apply(0, batch(stored(list(range(10)), ids[:160])))
    chosen, uncached = kv.choose("m", "/v1/completions", body(SYSTEM + " another question"))
    assert chosen is a and uncached == 0
    a.backlog, a.in_flight = 9, 2  # its queue: more than the 10 blocks computed again elsewhere
    assert kv.choose("m", "/v1/completions", body(SYSTEM + " q"))[0] is kv.engines["b"]


def test_without_reuse_the_least_loaded_engine_is_chosen():
    kv = routing([engine("a"), engine("b")])
    kv.engines["a"].in_flight = 1
    for n in range(5):
        assert kv.choose("m", "/v1/completions", body(f"fresh prompt {n}"))[0] is kv.engines["b"]


def test_engines_of_other_models_unknown_tokenizers_and_unserved_models_are_left_to_the_router():
    kv = routing([engine("a", models=("other",))])
    assert kv.choose("m", "/v1/completions", body("x")) is None
    assert kv.choose("nope", "/v1/completions", body("x")) is None
    kv = routing([{**engine("a"), "tokenizer": "hf"}])
    assert kv.choose("m", "/v1/completions", body("x")) is None


def test_an_engine_that_leaves_the_table_or_is_replaced_loses_its_index():
    kv = routing([engine("a"), engine("b")])
    old = kv.engines["a"]
    old.index.apply(0, batch(stored([1], list(range(16)))))
    assert kv.take([engine("a"), engine("b")]) is None and kv.engines["a"] is old  # the same copy: kept
    assert kv.take([{**engine("a"), "generation": 2}, engine("b")]) is None
    assert kv.engines["a"] is not old and kv.engines["a"].index.blocks() == 0 and old.index.blocks() == 0
    assert kv.take([engine("b")]) is None and set(kv.engines) == {"b"}
    assert kv.take([{"engine_id": "x"}]) is not None  # refused: no URL


def test_an_engine_with_128_token_blocks_is_matched_at_its_own_block_size():
    """vLLM's CPU backend caches 128-token blocks: the prompt is cut at the size its events carry
    (cut at 16 tokens, no key would ever match theirs)."""
    kv = routing([engine("a"), engine("b")])
    ids = tokenize(SYSTEM + " q")  # 161 ids: one full block of 128
    event = BlockStored([7], None, ids[:128], 128, None, "GPU", None)
    kv.engines["b"].index.apply(0, batch(event))
    assert kv.engines["b"].index.block_size == 128
    chosen, uncached = kv.choose("m", "/v1/completions", body(SYSTEM + " another"))
    assert chosen is kv.engines["b"] and uncached == 0
    kv.engines["b"].in_flight = 7  # its queue: still cheaper than the 128 tokens (8 blocks of 16) elsewhere
    assert kv.choose("m", "/v1/completions", body(SYSTEM + " more"))[0] is kv.engines["b"]
    kv.engines["b"].in_flight = 11
    chosen, uncached = kv.choose("m", "/v1/completions", body(SYSTEM + " more"))
    assert chosen is kv.engines["a"] and uncached == 10  # a's 16-token blocks: 10 full ones
