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
        self.read = 0  # tokens whose text has already been emitted

    def add(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(token_ids)
        done = self.decode(self.ids[self.prefix:self.read])
        full = self.decode(self.ids[self.prefix:])
        if full.endswith("\ufffd"):
            return ""  # wait for the rest of the character
        delta = full[len(done):]
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
        return full[len(done):]
