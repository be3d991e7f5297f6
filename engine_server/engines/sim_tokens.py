"""The simulated engine's tokenizer and "model": text to token ids, a deterministic autoregressive
next id, and ids back to text incrementally as vLLM's detokenizer does.

Tokenizer (motor/contract/sim_tokenizer.py, shared with the front door): whitespace words; a
word of WORDS is its index, SPLIT_WORD ("café") is two tokens whose first ends inside the UTF-8
bytes of "é", any other word a stable id (crc32, never Python's salted hash()) at OOV_BASE or
above. Every generated id is a vocabulary id (PIECES).

Model: the next id is a function of all the ids so far (prompt ids and generated ids), a rolling
hash folded over the sequence; so generating from prompt ids + the first k generated ids gives
exactly the rest of the uninterrupted answer, in any process. After the first half of SPLIT_WORD
comes its second half; the split word comes now and then (about one token in SPLIT_EVERY).

Detokenizer: each token's text is its piece (a leading space per word); a token whose bytes end
inside a character gives "" (held back) and the next token gives the whole character, as vLLM's
incremental detokenizer does. It is primed with the prompt's last ids, so a continuation whose
prompt ends with a first half emits the whole character with the second.

For tests: `generate(prompt_ids, n)` is the answer's ids, `pieces(prompt_ids, ids)` their texts,
`text(prompt_ids, ids)` the answer's text, `tokenize(text)` a text prompt's ids.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from motor.contract.sim_tokenizer import (  # (the tokenizer is shared with the front door)
    OOV_BASE,
    OOV_SPAN,
    SPLIT_FIRST,
    SPLIT_SECOND,
    SPLIT_WORD,
    VOCAB_SIZE,
    WORDS,
    tokenize,
)

__all__ = ["OOV_BASE", "OOV_SPAN", "SPLIT_FIRST", "SPLIT_SECOND", "SPLIT_WORD", "VOCAB_SIZE", "WORDS", "tokenize"]

_SPLIT_BYTES = f" {SPLIT_WORD}".encode()
PIECES: tuple[bytes, ...] = (*(f" {word}".encode() for word in WORDS), _SPLIT_BYTES[:-1], _SPLIT_BYTES[-1:])
SPLIT_EVERY = 29  # about one generated token in this many starts the split word
PRIME_IDS = 6  # the prompt's last ids the detokenizer is primed with (vLLM: a few)

_WORD_TEXT = tuple(piece.decode() for piece in PIECES[: len(WORDS)])
_MASK = (1 << 64) - 1
_SEED = 0xCBF29CE484222325
_PRIME = 0x100000001B3
_UTF8 = codecs.getincrementaldecoder("utf-8")


def token_bytes(token: int) -> bytes:
    return PIECES[token] if 0 <= token < len(PIECES) else f" <{token}>".encode()


def _fold(state: int, token: int) -> int:
    return ((state ^ (token + 1)) * _PRIME) & _MASK


def _mix(state: int) -> int:
    """splitmix64's finalizer: every bit of the state moves the choice."""
    z = (state + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class Model:
    """The answer to one prompt, a token at a time: `next()` gives its id and the text the
    detokenizer emits with it ("" while a character is incomplete); `logprobs()` the last one's."""

    def __init__(self, prompt_ids: Sequence[int]):
        state = _SEED
        for token in prompt_ids:
            state = _fold(state, token)
        self._state = state
        self._last = prompt_ids[-1] if prompt_ids else -1
        self._mixed = 0
        self._detokenizer = Detokenizer(prompt_ids)

    def next(self) -> tuple[int, str]:
        self._mixed = mixed = _mix(self._state)
        if self._last == SPLIT_FIRST:
            token = SPLIT_SECOND
        elif mixed % SPLIT_EVERY == 0:
            token = SPLIT_FIRST
        else:
            token = (mixed >> 8) % len(WORDS)
        self._state, self._last = _fold(self._state, token), token
        return token, self._detokenizer.step(token)

    def logprobs(self, count: int) -> list[tuple[int, float]]:
        """The last token's logprob first, then `count` other likely ids, most likely first
        (made-up values, derived from the sequence)."""
        chosen = -((self._mixed >> 20) % 2000) / 1000.0
        others = [((self._last + step) % len(PIECES), round(chosen - 0.75 * step, 3)) for step in range(1, count + 1)]
        return [(self._last, chosen), *others]


class Detokenizer:
    """Text from ids, token by token: a token whose bytes end inside a character gives "" and
    the next gives all the text held back (vLLM's incremental detokenizer)."""

    def __init__(self, prompt_ids: Sequence[int] = ()):
        self._pending = b""
        for token in prompt_ids[-PRIME_IDS:]:
            self.step(token)

    def step(self, token: int) -> str:
        if not self._pending and 0 <= token < len(WORDS):
            return _WORD_TEXT[token]
        data = self._pending + token_bytes(token)
        decoder = _UTF8("replace")
        text = decoder.decode(data)
        if decoder.getstate()[0]:  # ends inside a character: hold the whole token's text back
            self._pending = data
            return ""
        self._pending = b""
        return text


def generate(prompt_ids: Sequence[int], count: int) -> list[int]:
    """The first `count` ids of the answer to `prompt_ids`."""
    model = Model(prompt_ids)
    return [model.next()[0] for _ in range(count)]


def pieces(prompt_ids: Sequence[int], ids: Sequence[int]) -> list[str]:
    """Each generated id's text, as streamed after `prompt_ids`."""
    detokenizer = Detokenizer(prompt_ids)
    return [detokenizer.step(token) for token in ids]


def text(prompt_ids: Sequence[int], ids: Sequence[int]) -> str:
    return "".join(pieces(prompt_ids, ids))


def token_text(token: int) -> str:
    """One token alone as text (logprobs' `token`): an incomplete character reads U+FFFD."""
    return token_bytes(token).decode(errors="replace")


def deterministic_text(prompt: str, tokens: int) -> str:
    """The answer's text for a text prompt: the same prompt always gives the same answer."""
    prompt_ids = tokenize(prompt)
    return text(prompt_ids, generate(prompt_ids, tokens))
