"""Prompt-lookup (n-gram) drafting: no weights, just the conversation so far.

If the last n tokens appeared earlier, propose what followed them then. Longer matches are
tried first. Strong where the reply quotes its input: summaries, RAG answers, code edits.

A match of n tokens proposes at most n: the longer the match, the likelier what followed it comes
again, and a short match's later guesses are right too rarely to pay for the rows they add to
the verify pass (re-measure the hit rate by match length and the cost per drafted row:
scripts/lookup_hit_rates.py; figures in docs/results.md).

A match just behind the tail (a loop: the last n tokens also stood p tokens earlier) is read on
into the proposal itself, so that the loop continues.

A reply that copies (a function it was asked to edit, a paragraph it repeats, a loop of its own
text) shows it by a long match: once the last COPY_MIN tokens appeared together before, the
index proposes up to `copy_depth` tokens, at most one fewer than the match is long, instead of
the usual few. Verifying many rows costs more per pass, which a copying run pays back; short
matches keep short drafts.
"""
from __future__ import annotations

import os

from typing import Sequence

COPY_MIN = 8  # a match this long means the reply is copying


class NgramIndex:
    """For each n-gram, the position right after its latest occurrence (not counting the tail)."""

    def __init__(self, n_min: int = 1, n_max: int = 3, copy_depth: int = 0):
        self.n_min, self.n_max, self.copy_depth = n_min, n_max, copy_depth
        self.sizes = sorted(set(range(n_min, n_max + 1)) | ({COPY_MIN} if copy_depth else set()))
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
            for n in self.sizes:
                if end - n >= 0:
                    self.next_after[tuple(tokens[end - n:end])] = end
        self.tokens = list(tokens)

    def propose(self, tokens: Sequence[int], depth: int, copy_depth: int | None = None) -> list[int]:
        """Up to `depth` tokens, and at most as many as the match is long, that followed the
        longest match of the last tokens; or in a copying run up to `copy_depth` (default: the
        index's), at most one fewer than the run."""
        self.sync(tokens)
        copy_depth = self.copy_depth if copy_depth is None else min(copy_depth, self.copy_depth)
        if copy_depth and len(tokens) > COPY_MIN:
            start = self.next_after.get(tuple(tokens[-COPY_MIN:]))
            if start is not None:
                run = _match_length(tokens, start, COPY_MIN, copy_depth + 1)
                return _following(tokens, start, max(depth, min(copy_depth, run - 1)))
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(tokens) <= n:
                continue
            start = self.next_after.get(tuple(tokens[-n:]))
            if start is not None:
                return _following(tokens, start, min(depth, n))
        return []


def _following(tokens: Sequence[int], start: int, n: int) -> list[int]:
    """n tokens from `start` on, reading on into the proposal itself past the end: a match just
    behind the tail (a loop of period p has one p tokens back) continues the loop."""
    out: list[int] = []
    for j in range(start, start + n):
        out.append(tokens[j] if j < len(tokens) else out[j - len(tokens)])
    return out


def _match_length(tokens: Sequence[int], start: int, known: int, limit: int) -> int:
    """How many tokens before `start` equal the last tokens (the first `known` do), up to `limit`."""
    n, end = known, len(tokens)
    while n < limit and start - 1 - n >= 0 and tokens[start - 1 - n] == tokens[end - 1 - n]:
        n += 1
    return n
