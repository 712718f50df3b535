"""Incremental detokenization: turn a growing list of token ids into text deltas.

Byte-level BPE tokens can split a UTF-8 character, and some tokenizers change how a token
renders depending on its neighbours, so decoding token by token is wrong. We decode a short
window ending at the new tokens and hold text back while it ends in an incomplete character.
"""
from __future__ import annotations

from typing import Callable, Sequence

_WINDOW = 6  # tokens of left context kept when decoding new ones


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # tokens whose text has been emitted completely
        self.held = 0  # characters already emitted from tokens past `read` (before a split character)

    def add(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(token_ids)
        done = self.decode(self.ids[self.prefix:self.read])
        full = self.decode(self.ids[self.prefix:])
        new = full[len(done):]
        if full.endswith("\ufffd"):  # the last character is incomplete: emit up to it and wait
            stable = new.rstrip("\ufffd")
            delta, self.held = stable[self.held:], max(self.held, len(stable))
            return delta
        delta, self.held = new[self.held:], 0
        self.read = len(self.ids)
        self.prefix = max(0, self.read - _WINDOW)
        return delta

    def flush(self) -> str:
        """Text still held back at the end of the stream (e.g. a dangling partial character)."""
        if self.read == len(self.ids):
            return ""
        done = self.decode(self.ids[self.prefix:self.read])
        full = self.decode(self.ids[self.prefix:])
        self.read = len(self.ids)
        delta, self.held = full[len(done):][self.held:], 0
        return delta
