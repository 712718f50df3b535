"""The speculative run's own verify row, recomputed: what tells a floating-point flip from a bug.

When a speculative reply parts from its target-only reference at token i, either the arithmetic
of a multi-row verify pass rounded a near-tie the other way (its own verify row chose the
speculative token: a flip, possible only where verification is not strict), or the speculative
code emitted a token its verify row did not choose (a bug). `verify_row_choice` replays the run
on the target, independently of the loop: the same prefill, then every verify block at its
position with the drafts it verified, in the same arithmetic, each time keeping only what the
run emitted, up to the pass that emitted token i; and returns the token that row chooses.
`reference_scores` recomputes the other side: what target-only decoding maximised at a token.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..base import Constraint, Sampling
from ..constrained import target_matcher
from ..native import sampling as sampler


def verify_row_choice(target, prompt: Sequence[int], reply: Sequence[int], pass_log: Sequence[tuple[list[int], int]],
                      index: int, sampling: Sampling, row_exact: bool, constraint: Optional[Constraint] = None) -> int:
    """The token the row that emitted reply[index] chooses, recomputed on `target` (a TorchBackend
    whose cache this empties). `pass_log`: the run's (drafts, tokens emitted) per pass, the first
    being its prefill, which must have computed the whole prompt (Summary.prefill_start == 0);
    `row_exact`: whether its verify passes were row-exact (strict verification); `constraint`: the
    run's, whose mask after reply[:index] the row chose under."""
    if not 0 <= index < sum(n for _, n in pass_log):
        raise ValueError(f"token {index} is not in a reply of {sum(n for _, n in pass_log)} tokens")
    allowed = None
    if constraint is not None:
        matcher = target_matcher(target, constraint)
        matcher.advance(list(reply[:index]))
        allowed = matcher.allowed()
        allowed = None if allowed is None else allowed[None]
    choose = (lambda states, pos: target.choose(states, [pos], sampling) if allowed is None
              else target.choose(states, [pos], sampling, allowed))
    target.truncate(0)
    state, _, _ = target.prefill_with_hidden(list(prompt), head=False)  # the run's own prefill
    if index == 0:
        return int(choose(state[-1:], len(prompt))[0])
    emitted = pass_log[0][1]
    for draft, count in pass_log[1:]:
        n = len(prompt) + emitted  # the committed tokens before this pass; the last one opens the block
        last = reply[emitted - 1]
        states, _ = target.forward([last] + list(draft), n - 1, row_exact=row_exact, head=False)
        if index < emitted + count:
            row = index - emitted
            return int(choose(states[row:row + 1], n + row)[0])
        emitted += count
        target.truncate(n + count - 1)  # the cache holds every committed token but the last
    raise AssertionError("unreachable: the index lies in the reply")


def reference_scores(engine, prompt: Sequence[int], reply: Sequence[int], sampling: Sampling):
    """What target-only decoding maximised when it chose the token after prompt + reply: the
    logits (greedy), or tempered, filtered logits plus that position's Gumbel noise. Recomputed
    with exactly the arithmetic of target-only decoding: the prompt in one pass from an empty
    cache, then one token per pass."""
    engine.truncate(0)
    logits = engine.prefill(list(prompt))
    for pos, token in enumerate(reply, start=len(prompt)):
        logits, _ = engine.forward([token], pos, all_logits=False)
    position = len(prompt) + len(reply)
    if sampling.greedy:
        return logits[-1]
    noise = sampler.gumbel_noise(sampling.seed, [position], logits.shape[-1], logits.device)
    return (sampler.filtered_logits(logits[-1:], sampling) + noise)[0]
