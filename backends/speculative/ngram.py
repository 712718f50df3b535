"""Prompt-lookup (n-gram) drafting: no weights, just the conversation so far.

If the last n tokens appeared earlier, propose what followed them then. Longer matches are
tried first. Strong where the reply quotes its input: summaries, RAG answers, code edits.
"""
from __future__ import annotations

import os

from typing import Sequence


class NgramIndex:
    """For each n-gram, the position right after its latest occurrence (not counting the tail)."""

    def __init__(self, n_min: int = 1, n_max: int = 3):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.next_after: dict[tuple[int, ...], int] = {}

    def reset(self) -> None:
        self.tokens = []
        self.next_after = {}

    def sync(self, tokens: Sequence[int]) -> None:
        """Bring the index in line with `tokens` (appending, or rebuilding after a rollback)."""
        common = len(os.path.commonprefix([self.tokens, list(tokens)]))
        if common < len(self.tokens):
            self.reset()
            common = 0
        # Index n-grams that end at position end-1 and are followed by a token (end < len).
        for end in range(max(common, 1), len(tokens)):
            for n in range(self.n_min, self.n_max + 1):
                if end - n >= 0:
                    self.next_after[tuple(tokens[end - n:end])] = end
        self.tokens = list(tokens)

    def propose(self, tokens: Sequence[int], depth: int) -> list[int]:
        self.sync(tokens)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(tokens) <= n:
                continue
            start = self.next_after.get(tuple(tokens[-n:]))
            if start is not None:
                return list(tokens[start:start + depth])
        return []
