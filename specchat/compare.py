"""Aligning two replies and judging where they part: the one module behind `specchat verify`
and the A/B view.

Two runs of the same prompt with the same seed must give the same tokens. When they don't,
the reference model's own scores at the first differing position tell a floating-point
near-tie (the two tokens were within `near_tie_margin` of each other, so a batched and a
single-token kernel can legitimately flip them) from a real mismatch (a bug).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from specchat.backends.base import STOP_CANCELLED

IDENTICAL = "identical"
NEAR_TIE = "near-tie"
MISMATCH = "mismatch"

# Largest score gap (logits, or tempered logits plus the position's Gumbel noise when sampling)
# that we still attribute to arithmetic rather than to a bug, by the reference's dtype. bfloat16
# logits of a ~135M model sit around 16-32, where one bfloat16 step is 0.125: two steps.
NEAR_TIE_MARGIN = {"float32": 1e-3, "float16": 0.05, "bfloat16": 0.25, "default": 0.25}


def near_tie_margin(dtype: str | None) -> float:
    return NEAR_TIE_MARGIN.get(dtype or "default", NEAR_TIE_MARGIN["default"])


def first_divergence(ref: Sequence, other: Sequence) -> Optional[int]:
    """Index of the first differing element, or None when one is a prefix of the other
    (see `judge_tokens` for when a different length is itself a divergence)."""
    for i, (a, b) in enumerate(zip(ref, other)):
        if a != b:
            return i
    return None


@dataclass
class Verdict:
    kind: str  # identical | near-tie | mismatch
    index: Optional[int] = None  # token (or character, for text alignment) index of the divergence
    ref_text: str = ""  # the reference's token at the divergence
    other_text: str = ""
    margin: Optional[float] = None  # reference score of its token minus that of the other's
    compared: int = 0  # tokens compared
    by: str = "tokens"  # tokens | text

    @property
    def ok(self) -> bool:
        return self.kind != MISMATCH

    def line(self) -> str:
        if self.kind == IDENTICAL:
            return f"identical ({self.compared} {self.by})"
        where = f"{'token' if self.by == 'tokens' else 'character'} {self.index}"
        margin = f", margin {self.margin:.2e}" if self.margin is not None else ""
        return f"{self.kind} at {where}{margin}: {self.ref_text!r} (reference) vs {self.other_text!r}"

    def as_dict(self) -> dict:
        return {"verdict": self.kind, "index": self.index, "reference_token": self.ref_text,
                "other_token": self.other_text, "margin": self.margin, "compared": self.compared, "by": self.by}


def judge_tokens(ref_ids: Sequence[int], other_ids: Sequence[int],
                 decode: Callable[[Sequence[int]], str],
                 margin_at: Optional[Callable[[int, int, int], float]] = None,
                 tie_margin: float = NEAR_TIE_MARGIN["default"],
                 stops: Optional[tuple[str, str]] = None) -> Verdict:
    """Compare two token-id replies.

    `margin_at(index, ref_token, other_token)` returns the reference's score gap at that
    position; without it every divergence counts as a mismatch (we never assume a tie).
    `stops`: both replies' stop reasons, when both ran under the same sampling settings; then
    ending differently (one reply longer, or eos against max tokens) is a mismatch unless one
    of them was cancelled. Without it, a reply that stopped earlier is only a shorter reply."""
    compared = min(len(ref_ids), len(other_ids))
    i = first_divergence(ref_ids, other_ids)
    if i is None:
        ended_apart = stops is not None and STOP_CANCELLED not in stops and (
            len(ref_ids) != len(other_ids) or stops[0] != stops[1])
        if not ended_apart:
            return Verdict(IDENTICAL, compared=compared)
        return Verdict(MISMATCH, compared, _end_text(ref_ids, compared, stops[0], decode),
                       _end_text(other_ids, compared, stops[1], decode), None, compared)
    a, b = ref_ids[i], other_ids[i]
    margin = margin_at(i, a, b) if margin_at else None
    kind = NEAR_TIE if margin is not None and abs(margin) <= tie_margin else MISMATCH
    return Verdict(kind, i, decode([a]), decode([b]), margin, compared)


def _end_text(ids: Sequence[int], i: int, stop: str, decode: Callable[[Sequence[int]], str]) -> str:
    return decode([ids[i]]) if i < len(ids) else f"<{stop}>"


def judge_text(ref: str, other: str) -> Verdict:
    """Fallback for backends that return no token ids (e.g. a remote server without logprobs)."""
    i = first_divergence(ref, other)
    if i is None:
        return Verdict(IDENTICAL, compared=min(len(ref), len(other)), by="text")
    return Verdict(MISMATCH, i, ref[i:i + 12], other[i:i + 12], None, min(len(ref), len(other)), by="text")
