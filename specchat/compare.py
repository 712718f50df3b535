"""Aligning two replies and judging where they part: the one module behind `specchat verify`,
the A/B view and the REPL's /verify.

Two runs of the same prompt with the same seed must give the same tokens. Where they don't:
- if both runs computed that token with the arithmetic of single-token decoding (strict
  verification, see backends/native/exact_rows.py), the difference cannot be rounding: it is a
  **mismatch**, a bug;
- otherwise the speculative run's own verify row for that token is recomputed
  (backends/speculative/replay.py): if it chose the speculative token, a multi-row pass rounded a
  **near-tie** the other way; if it did not, the speculative code emitted a token its verification
  never chose: a mismatch;
- where no row can be recomputed (a remote server), the reference's own scores decide: a gap
  within `near_tie_margin` is a near-tie, anything wider a mismatch; without scores, a mismatch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from specchat.backends.base import STOP_CANCELLED

IDENTICAL = "identical"
NEAR_TIE = "near-tie"
MISMATCH = "mismatch"
# the target-only reference itself gave different replies when run again (verify --repeat): the
# speculative run cannot be judged against it, and no drafter is blamed
NOT_REPRODUCIBLE = "target not reproducible"
# the reference runs another engine, backend, dtype or quantization, and the speculative run's own
# target-only reply already parts from it there: the engines' arithmetic differs, not the drafter
ENGINES_DIFFER = "engines differ"

# Largest score gap (logits, or tempered logits plus the position's Gumbel noise when sampling)
# still attributed to arithmetic rather than to a bug where no verify row can be recomputed, by
# the reference's precision. Chosen from the margins of real flips and of planted bugs on the
# default model, not strict, greedy and at temperature 0.7 (scripts/near_tie_margins.py; the
# table and its false-negative / false-positive counts are in docs/results.md): int4's real
# flips reach 0.18 and all but one bug divergence lie above 0.4; bfloat16's flips stay under
# 0.04, its bugs above 0.4; float32 showed no flip and its bugs lie above 0.8. float16 is not
# measured (no float16 kernels on CPU). "default": a precision not named here ("auto").
NEAR_TIE_MARGIN = {"float32": 1e-3, "float16": 0.05, "bfloat16": 0.1, "int4": 0.25, "default": 0.25}


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
    kind: str  # identical | near-tie | mismatch | target not reproducible | engines differ
    index: Optional[int] = None  # token (or character, for text alignment) index of the divergence
    ref_text: str = ""  # the reference's token at the divergence
    other_text: str = ""
    margin: Optional[float] = None  # reference score of its token minus that of the other's
    compared: int = 0  # tokens compared
    by: str = "tokens"  # tokens | text
    ref_score: Optional[float] = None  # the reference's score of its own token, and of the other's
    other_score: Optional[float] = None
    strict: Optional[bool] = None  # whether both runs computed the divergent token with single-token arithmetic
    why: str = ""  # the arithmetic behind the judgement, in words
    complete: bool = True  # both replies ran to their own end (False: one was cancelled)

    @property
    def ok(self) -> bool:
        return self.kind != MISMATCH

    @property
    def clean(self) -> bool:
        """Identical in every compared token, and both replies ended the same way."""
        return self.kind == IDENTICAL and self.complete

    def line(self) -> str:
        if self.kind == IDENTICAL:
            if not self.complete:
                return f"identical for the {self.compared} {self.by} both produced (a reply was stopped)"
            return f"identical ({self.compared} {self.by})"
        where = f"{'token' if self.by == 'tokens' else 'character'} {self.index}"
        if self.kind == NOT_REPRODUCIBLE:
            return f"{self.kind}: its runs part at {where}: {self.ref_text!r} vs {self.other_text!r} · {self.why}"
        if self.kind == ENGINES_DIFFER:
            ours, theirs = repr(self.other_text), repr(self.ref_text)
            if self.ref_score is not None and self.other_score is not None:  # both scored by our target
                ours, theirs = f"{ours} ({self.other_score:.4f})", f"{theirs} ({self.ref_score:.4f})"
            return f"{self.kind} at {where}: {ours} (its own target-only) vs {theirs} (reference) · {self.why}"
        margin = f", margin {self.margin:.2e}" if self.margin is not None else ""
        ref, other = repr(self.ref_text), repr(self.other_text)
        if self.ref_score is not None and self.other_score is not None:
            ref, other = f"{ref} ({self.ref_score:.4f})", f"{other} ({self.other_score:.4f})"
        line = f"{self.kind} at {where}{margin}: {ref} (reference) vs {other}"
        return line + (f" · {self.why}" if self.why else "")

    def as_dict(self) -> dict:
        return {"verdict": self.kind, "index": self.index, "reference_token": self.ref_text,
                "other_token": self.other_text, "margin": self.margin, "reference_score": self.ref_score,
                "other_score": self.other_score, "strict": self.strict, "why": self.why,
                "complete": self.complete, "compared": self.compared, "by": self.by}


def mark_and_colour(v: Verdict) -> tuple[str, str]:
    """How every front end shows a verdict: green only when every compared token was equal and both
    replies ended the same way; identical up to a stop plain; a near-tie (possible only without
    strict verification) yellow; a target that does not reproduce itself magenta (no drafter is
    judged against it); another engine's reference that the speculative run's own target-only
    already parts from cyan (the engines differ, not the drafter); a mismatch red."""
    if v.kind == IDENTICAL:
        return "✔", "green" if v.clean else ""
    if v.kind == NOT_REPRODUCIBLE:
        return "↯", "magenta"
    if v.kind == ENGINES_DIFFER:
        return "⇄", "cyan"
    return ("≈", "yellow") if v.kind == NEAR_TIE else ("✘", "red")


def judge_runs(runs: Sequence[tuple[Sequence, str]], decode: Callable[[Sequence], str],
               by: str = "tokens") -> Optional[Verdict]:
    """Whether repeated runs of one request (each its reply's ids, or text, and its stop reason)
    gave one reply: None if so, else a NOT_REPRODUCIBLE verdict at the earliest place where a run
    parts from the first, saying how many of them do. A reply that stops earlier or for another
    reason parts where the shorter one ends."""
    first, first_stop = runs[0]
    parted: list[tuple[int, int]] = []  # (where, which run)
    for k, (ids, stop) in enumerate(runs[1:], 2):
        i = first_divergence(first, ids)
        if i is None and (len(ids) != len(first) or stop != first_stop):
            i = min(len(ids), len(first))
        if i is not None:
            parted.append((i, k))
    if not parted:
        return None
    i, k = min(parted)
    ids = runs[k - 1][0]
    show = (lambda seq: decode([seq[i]]) if i < len(seq) else "<end>") if by == "tokens" else \
        (lambda seq: seq[i:i + 12] if i < len(seq) else "<end>")
    return Verdict(NOT_REPRODUCIBLE, i, show(first), show(ids), compared=min(len(r[0]) for r in runs), by=by,
                   why=f"{len(parted)} of {len(runs)} target-only runs differ from the first (run {k} parts first)")


def judge_tokens(ref_ids: Sequence[int], other_ids: Sequence[int],
                 decode: Callable[[Sequence[int]], str],
                 margin_at: Optional[Callable[[int, int, int], float]] = None,
                 tie_margin: float = NEAR_TIE_MARGIN["default"],
                 stops: Optional[tuple[str, str]] = None,
                 scores_at: Optional[Callable[[int, int, int], tuple[float, float]]] = None,
                 strict_until: int = 0, not_strict: str | Callable[[int], str] = "",
                 row_choice: Optional[Callable[[int], Optional[int]]] = None) -> Verdict:
    """Compare two token-id replies (see the module docstring for the rules).

    `scores_at(index, ref_token, other_token)` gives the reference's scores of both tokens there
    (or `margin_at`, their difference); without either a divergence that no recomputed row
    explains is a mismatch (a tie is never assumed). `strict_until`: how many leading tokens both
    runs computed with single-token arithmetic; `not_strict`: what the arithmetic was past that,
    in words (or a function of the token's index giving them). `row_choice(index)`: the token the
    other run's own verify row chooses there, recomputed (None where it cannot be). `stops`: both
    replies' stop reasons, when both ran under the same sampling settings; then ending
    differently (one reply longer, or eos against max tokens) is a mismatch unless one of them
    was cancelled. Without it, a reply that stopped earlier is only a shorter reply."""
    compared = min(len(ref_ids), len(other_ids))
    cancelled = stops is not None and STOP_CANCELLED in stops
    i = first_divergence(ref_ids, other_ids)
    if i is None:
        ended_apart = stops is not None and not cancelled and (len(ref_ids) != len(other_ids) or stops[0] != stops[1])
        if not ended_apart:
            return Verdict(IDENTICAL, compared=compared,
                           complete=not cancelled and (stops is not None or len(ref_ids) == len(other_ids)))
        return Verdict(MISMATCH, compared, _end_text(ref_ids, compared, stops[0], decode),
                       _end_text(other_ids, compared, stops[1], decode), None, compared, strict=compared < strict_until,
                       why="the replies end differently")
    a, b = ref_ids[i], other_ids[i]
    ref_score = other_score = None
    if scores_at is not None:
        ref_score, other_score = scores_at(i, a, b)
        margin = ref_score - other_score
    else:
        margin = margin_at(i, a, b) if margin_at else None
    v = Verdict(MISMATCH, i, decode([a]), decode([b]), margin, compared, ref_score=ref_score, other_score=other_score,
                strict=i < strict_until, complete=not cancelled)
    choice = row_choice(i) if row_choice is not None else None
    not_strict = not_strict(i) if callable(not_strict) else not_strict
    if v.strict:
        v.why = "strict: both runs computed this token with single-token arithmetic, so no rounding can part them"
        if choice == b:
            v.why += " (the speculative verify row itself chose it: its pass was not row-exact)"
    elif choice is not None:
        if choice == b:
            v.kind = NEAR_TIE
            v.why = f"not strict: {not_strict}; the speculative run's own verify row chose {decode([b])!r}"
        else:
            v.why = (f"the speculative run's own verify row chose {decode([choice])!r}, not the {decode([b])!r} "
                     "it emitted")
    elif margin is not None and abs(margin) <= tie_margin:
        v.kind = NEAR_TIE
        v.why = f"not strict{': ' + not_strict if not_strict else ''}; within the near-tie margin {tie_margin:g}"
    elif margin is not None:
        v.why = f"the gap is wider than the near-tie margin {tie_margin:g}"
    return v


def _end_text(ids: Sequence[int], i: int, stop: str, decode: Callable[[Sequence[int]], str]) -> str:
    return decode([ids[i]]) if i < len(ids) else f"<{stop}>"


def judge_text(ref: str, other: str) -> Verdict:
    """Fallback for backends that return no token ids (e.g. a remote server without logprobs)."""
    i = first_divergence(ref, other)
    if i is None:
        return Verdict(IDENTICAL, compared=min(len(ref), len(other)), by="text", complete=len(ref) == len(other))
    return Verdict(MISMATCH, i, ref[i:i + 12], other[i:i + 12], None, min(len(ref), len(other)), by="text")
