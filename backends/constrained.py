"""Decoding on the torch engine under a constraint (constraint.py): target-only decoding, and the
verify rows of the speculative loop, each with the mask of its own prefix.

The mask applies to the target's own choice: a forbidden token's logit is -inf before any argmax,
top-k or top-p (engine.choose's `allowed`), in one-token passes and in every verify row alike, so
constrained speculative decoding picks what constrained target-only decoding picks, token for token.
End-of-sequence is allowed only where the constraint may end, and is all that is allowed once it is
complete (the reply then ends as ever, `eos`); where no token at all may follow, the reply stops
with STOP_CONSTRAINT.
"""
from __future__ import annotations

import threading
from typing import Iterator, Optional, Sequence

import torch

from .base import STOP_CONSTRAINT, Constraint, Event, Sampling, Summary, decode_stream
from .constraint import TokenMatcher, matcher_for


def target_matcher(target, constraint: Constraint) -> TokenMatcher:
    """A matcher at the start of a reply, over the target's vocabulary (its logits' width)."""
    return matcher_for(constraint, target.tokenizer.hf, target.model.cfg.vocab_size, target.eos_ids)


def target_only_stream(engine, prompt: Sequence[int], sampling: Sampling, cancel: Optional[threading.Event],
                       constraint: Optional[Constraint] = None) -> Iterator[Event]:
    """The torch engine's target-only stream: a prefill, then one single-token pass per token,
    each token chosen under the constraint's mask where there is one."""
    matcher = target_matcher(engine, constraint) if constraint is not None else None
    reused: list[int] = []
    dead_end: list[bool] = []

    def tokens() -> Iterator[int]:
        state, _, start = engine.prefill_with_hidden(prompt, head=False)
        reused.append(start)
        pos = len(prompt)  # position of the token being chosen
        while True:
            allowed = None
            if matcher is not None:
                allowed = matcher.allowed()
                if allowed is None:
                    dead_end.append(True)
                    return
                allowed = allowed[None]
            token = int(engine.choose(state, [pos], sampling, allowed)[0])
            yield token
            if matcher is not None and token not in engine.eos_ids and matcher.advance([token]) != 1:
                raise RuntimeError(f"the engine chose token {token}, which the constraint's mask forbade")
            state, _ = engine.forward([token], pos, all_logits=False, head=False)
            pos += 1

    # every pass is a prefill (as the reference computes it) or a single-token pass
    for event in decode_stream(tokens(), prompt_tokens=len(prompt), sampling=sampling,
                               context_length=engine.context_length, is_eos=engine.eos_ids.__contains__,
                               detokenize=engine.detokenize, cancel=cancel, row_exact=True,
                               prefill_start=lambda: reused[0]):
        if isinstance(event, Summary) and dead_end:
            event.stop_reason = STOP_CONSTRAINT
        yield event


class RowMasks:
    """A verify block's masks, each row's from its own prefix: row i's is the constraint's state
    after the committed tokens and drafts d_0 .. d_{i-1}. Building them advances the matcher through
    the drafts it allows; `settle` rolls it back to the accepted ones (as the KV cache is truncated)
    and advances it by the target's own token.

    The block is cut where rows past it cannot matter: after the first draft the constraint forbids
    (kept, to be rejected at its row: its mask cannot hold it), before an end-of-sequence draft (the
    target's own row chooses end-of-sequence where it would), and before a draft that leads where no
    token may follow (the next pass meets that dead end at its first row, as target-only decoding)."""

    def __init__(self, matcher: TokenMatcher, draft: Sequence[int], eos_ids: frozenset[int]):
        self.matcher = matcher
        masks: list[torch.Tensor] = []
        self.advanced = 0
        self.draft = list(draft)
        for i, token in enumerate(draft):
            mask = matcher.allowed()
            if mask is None:  # the drafts so far lead nowhere: verify the block without the last of them
                if i == 0:
                    break
                matcher.rollback(1)
                self.advanced -= 1
                self.draft, masks = self.draft[:i - 1], masks[:i]
                break
            masks.append(mask)
            if token in eos_ids:
                self.draft = self.draft[:i]
                break
            if token >= len(mask) or not mask[token]:  # forbidden: rejected at this row, the rest never read
                self.draft = self.draft[:i + 1]
                masks.append(mask)  # a stand-in for the row after it, which no verdict can reach
                break
            matcher.advance([token])
            self.advanced += 1
        else:
            mask = matcher.allowed()
            if mask is None and self.draft:
                matcher.rollback(1)
                self.advanced -= 1
                self.draft = self.draft[:-1]
            elif mask is not None:
                masks.append(mask)
        self.dead_end = not masks  # no token may follow the committed sequence
        self.allowed = torch.stack(masks) if masks else None  # [len(draft) + 1, vocab]

    def settle(self, accepted: int, token: int, eos_ids: frozenset[int]) -> None:
        """The block's verdict: `accepted` drafts kept, then the target's own `token`."""
        self.matcher.rollback(self.advanced - accepted)
        if token not in eos_ids:
            if self.matcher.advance([token]) != 1:
                raise RuntimeError(f"the target chose token {token}, which the constraint's mask forbade")


def masked_probs(target, states: torch.Tensor, allowed: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution the target samples from at each row under its mask (rejection acceptance)."""
    from .native.sampling import probs

    logits = target.head_logits(states).masked_fill(~allowed, float("-inf"))
    return probs(logits, sampling)
