"""The simulated engine's tokenizer, shared: the engine tokenizes prompts with it, and the front
door with it computes a prompt's KV block keys for a simulated model (front_door/kv_prompt.py), as
a router that tokenizes for vLLM must use the model's own tokenizer.

Whitespace words; a word of WORDS is its index, SPLIT_WORD ("café") is two tokens, any other word
a stable id (crc32, never Python's salted hash()) at OOV_BASE or above. A chat's messages are
rendered to text (`render_chat`), then tokenized.
"""

from __future__ import annotations

import zlib
from typing import Any

WORDS = (
    "motor sim engine token answer fast cache prefill decode quiet river stone light model "
    "graph cloud field north amber signal"
).split()
SPLIT_WORD = "café"
SPLIT_FIRST, SPLIT_SECOND = len(WORDS), len(WORDS) + 1  # b" caf\xc3", b"\xa9"
OOV_BASE = 1000  # ids of words outside the vocabulary: OOV_BASE + crc32(word) % OOV_SPAN
OOV_SPAN = 1 << 24
VOCAB_SIZE = OOV_BASE + OOV_SPAN  # a prompt's ids must be below this

_WORD_IDS = {word: index for index, word in enumerate(WORDS)}


def tokenize(text: str) -> list[int]:
    ids: list[int] = []
    for word in text.split():
        if word in _WORD_IDS:
            ids.append(_WORD_IDS[word])
        elif word == SPLIT_WORD:
            ids += (SPLIT_FIRST, SPLIT_SECOND)
        else:
            ids.append(OOV_BASE + zlib.crc32(word.encode()) % OOV_SPAN)
    return ids


def render_chat(messages: list[dict[str, Any]]) -> str:
    """The chat prompt's text, which its token ids are of."""
    return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in messages)
