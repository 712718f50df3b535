"""The one speculative loop: a drafter proposes, the target verifies in one pass, `acceptance`
decides, both roll back to what was committed. Every method (draft model, n-gram, MTP, DFlash)
differs only in the drafter, which can never change what is emitted under `exact` acceptance.

Conventions: a token's position is its index in the whole sequence (prompt + reply). The
target's KV cache holds every committed token but the last one, which is fed at the start of
the next verify block: block = [last committed, d_0 … d_{k-1}] at positions N-1 … N-1+k, and
its logits choose the tokens at positions N … N+k.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator, Optional, Protocol, Sequence

import torch

from ..base import (STOP_CANCELLED, STOP_CONSTRAINT, STOP_CONTEXT_FULL, STOP_EOS, STOP_MAX_TOKENS, Constraint, Event,
                    Sampling, Step, StreamStats)
from ..constrained import RowMasks, masked_probs, target_matcher
from ..detok import IncrementalDetokenizer
from ..native.sampling import probs
from .acceptance import accept_exact, accept_rejection
from .gate import ALL, DraftGate


@dataclass
class Draft:
    tokens: list[int]
    q: Optional[torch.Tensor] = None  # [len(tokens), V] distributions the drafts were sampled from
    source: str = ""  # who guessed (see Drafter.sources); "" for the drafter itself


class Drafter(ABC):
    """Proposes tokens. It sees the committed sequence and, if it asks for them
    (`hidden_layers`), the target's hidden states of the committed positions; it keeps its own
    state in step with the committed sequence (rolling back whatever was rejected)."""

    name = "drafter"
    hidden_layers: tuple[int, ...] = ()  # target layers to return from every pass (-1: final, after norm)
    max_depth: Optional[int] = None  # most tokens it can propose per pass (None: no limit)
    paused: frozenset[str] = frozenset()  # sources the loop wants left out of the next proposal (gate.py)

    @property
    def sources(self) -> tuple[str, ...]:
        """Who may guess in a proposal, by the names `Draft.source` carries."""
        return (self.name,)

    def plan_depth(self, depth: int) -> int:
        """A new request will ask for drafts of up to `depth` tokens (the profile's depth): the
        most this drafter may propose in one pass, which a drafter whose drafts vary in length
        (prompt lookup in a copying run) may set higher. The loop caps every proposal at it."""
        return depth

    def reusable(self, prompt_ids: Sequence[int]) -> int:
        """How many leading positions of a new request's prompt this drafter still holds state for,
        from the requests before (a chat's next turn shares the conversation so far); the loop then
        computes and hands over the target's hidden states from there on only. 0: none."""
        return 0

    def start(self, prompt_ids: Sequence[int], hidden: dict[int, torch.Tensor], sampling: Sampling,
              reused: int = 0) -> None:
        """A new request; `hidden` holds the target's states for the prompt positions from `reused`
        on (at most `reusable(prompt_ids)`); the drafter keeps its state for the ones before."""

    @abstractmethod
    def propose(self, tokens: Sequence[int], depth: int) -> Draft:
        """Up to `depth` tokens to follow `tokens` (the committed sequence)."""

    def commit(self, tokens: Sequence[int], hidden: dict[int, torch.Tensor]) -> None:
        """`tokens` is the committed sequence after a pass; `hidden` the target's states for the
        positions this pass committed into its cache (the block's accepted prefix)."""

    def close(self) -> None:
        pass


def keyed_generator(seed: int, position: int, salt: str) -> torch.Generator:
    """Randomness that depends only on (seed, position, purpose)."""
    digest = hashlib.blake2b(f"{seed}:{position}:{salt}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def _sample_dist(dist: torch.Tensor, seed: int, position: int) -> int:
    dist = dist.float().cpu()
    return int(torch.multinomial(dist / dist.sum(), 1, generator=keyed_generator(seed, position, "residual")))


class Target(Protocol):
    """What the loop needs from the target engine (`backends.native.engine.TorchBackend`)."""

    eos_ids: frozenset[int]
    context_length: int
    cached: list[int]  # token ids whose keys/values are in the cache

    def verify_chunk(self, sampling: Sampling) -> int | None:
        """Rows of a verify block per `choose` call that keep each row's bits and cost least
        (None: all rows in one call)."""

    def forward(self, tokens: Sequence[int], start_pos: int, hidden_layers: tuple[int, ...] = (),
                all_logits: bool = True, row_exact: bool = False,
                head: bool = True) -> tuple[torch.Tensor, dict[int, torch.Tensor]]: ...

    def head_logits(self, states: torch.Tensor) -> torch.Tensor: ...

    def choose(self, states: torch.Tensor, positions: Sequence[int], sampling: Sampling,
               allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
        """sample(head_logits(states), positions, sampling), as cheaply as the engine can; `allowed`
        (bool [rows, vocab]): a constraint's mask, every other token's logit -inf first."""

    def prefill_with_hidden(self, prompt: Sequence[int], hidden_layers: tuple[int, ...] = (), head: bool = True,
                            reuse_at_most: int | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor], int]:
        """The cache brought to `prompt` (reusing at most `reuse_at_most` cached positions): the last
        position's state, the hidden states of the positions computed, and where they start."""

    def truncate(self, length: int) -> None: ...

    def restart_point(self, n: int) -> int:
        """The longest prefix of at most n cached positions the target can truncate to (a hybrid's
        recurrent state returns only to its last pass's positions)."""

    def sample(self, logits: torch.Tensor, positions: Sequence[int], sampling: Sampling) -> torch.Tensor: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...


def target_choices(target: Target, states: torch.Tensor, draft: Sequence[int], positions: Sequence[int],
                   sampling: Sampling, allowed: Optional[torch.Tensor] = None) -> list[int]:
    """The target's own token at each block position, as far as `accept_exact` will look: the LM
    head (a full-vocabulary matmul, the largest single cost of a verify row on CPU) runs on
    `target.verify_chunk(sampling)` rows at a time and stops after the first chunk holding a
    rejected draft. `allowed`: each row's constraint mask (RowMasks), or None."""
    chunk = target.verify_chunk(sampling) or len(positions)
    chosen: list[int] = []
    for lo in range(0, len(positions), chunk):
        hi = lo + chunk
        chosen += choose(target, states[lo:hi], positions[lo:hi], sampling,
                         None if allowed is None else allowed[lo:hi]).tolist()
        if any(a != b for a, b in zip(draft[lo:hi], chosen[lo:hi])):
            break
    return chosen


def choose(target: Target, states: torch.Tensor, positions: Sequence[int], sampling: Sampling,
           allowed: Optional[torch.Tensor]) -> torch.Tensor:
    """target.choose, with the constraint's mask only where there is one."""
    if allowed is None:
        return target.choose(states, positions, sampling)
    return target.choose(states, positions, sampling, allowed)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return len(os.path.commonprefix([list(a), list(b)]))


def speculative_stream(target: Target, drafter: Drafter, prompt: Sequence[int], sampling: Sampling, depth: int,
                       acceptance: str = "exact", cancel: Optional[threading.Event] = None,
                       strict: bool = False, gate: Optional[DraftGate] = None,
                       constraint: Optional[Constraint] = None) -> Iterator[Event]:
    """`strict`: verify blocks with the arithmetic of single-token decoding, row by row
    (the engine's row-exact passes), so that not even a floating-point near-tie can flip a token.
    `gate`: draft from a source only while its passes are faster than plain ones (gate.py).
    `constraint`: every token the target chooses, in every row, keeps it (constrained.py): each
    row gets the mask of its own prefix, and the matcher rolls back with the cache."""
    depth = drafter.plan_depth(depth)
    detok = IncrementalDetokenizer(target.detokenize)
    layers = drafter.hidden_layers
    drafter.paused = frozenset()  # no source sits out unless the gate says so
    use_rejection = acceptance == "rejection" and not sampling.greedy
    matcher = target_matcher(target, constraint) if constraint is not None else None
    stats = StreamStats(prompt_tokens=len(prompt))
    if cancel is not None and cancel.is_set():  # as target-only decoding: nothing is run
        yield stats.finish(STOP_CANCELLED, "")
        return

    # Prefill as target-only decoding's: the cached prefix reused, as far as the drafter still holds
    # what it needs of it, and the last prompt token a single-token pass of its own.
    state, hidden, start = target.prefill_with_hidden(prompt, layers, head=False,
                                                      reuse_at_most=drafter.reusable(prompt) if layers else None)
    stats.summary.prefill_start = start
    masks = RowMasks(matcher, [], target.eos_ids) if matcher is not None else None
    if masks is not None and masks.dead_end:
        yield stats.finish(STOP_CONSTRAINT, "")
        return
    first = int(choose(target, state[-1:], [len(prompt)], sampling, masks and masks.allowed)[0])
    if masks is not None:
        masks.settle(0, first, target.eos_ids)
    tokens = list(prompt) + [first]
    drafter.start(prompt, hidden, sampling, start)

    def emit(new: list[int], draft: list[int], accepted: int, row_exact: bool,
             source: str = "", paused: str = "") -> tuple[Optional[Step], bool]:
        """The pass's tokens up to any end-of-sequence token; a pass that only ends the reply
        is not counted, as in target-only decoding."""
        cut = next((i for i, t in enumerate(new) if t in target.eos_ids), None)
        kept = new if cut is None else new[:cut]
        step = stats.add(Step(kept, detok.add(kept), len(draft), min(accepted, len(kept)), draft=list(draft),
                              row_exact=row_exact, source=source, paused=paused)) if kept else None
        return step, cut is not None

    step, hit_eos = emit([first], [], 0, True)
    if hit_eos:
        yield stats.finish(STOP_EOS, detok.flush())
        return
    yield step
    reason = STOP_MAX_TOKENS
    while True:
        produced = len(tokens) - len(prompt)
        if produced >= sampling.max_tokens:
            break
        if cancel is not None and cancel.is_set():
            reason = STOP_CANCELLED
            break
        n = len(tokens)
        # as in target-only decoding, no token at position context_length or beyond: the block
        # [last, d_0 .. d_{k-1}] chooses tokens at positions n .. n+k, so k <= context_length - 1 - n
        room = target.context_length - 1 - n
        if room < 0:
            reason = STOP_CONTEXT_FULL
            break
        k = max(0, min(depth, sampling.max_tokens - produced - 1, room))
        why = ""
        if gate is not None:
            drafter.paused = gate.plan()
            every = ALL in drafter.paused or all(source in drafter.paused for source in drafter.sources)
            why = gate.why_paused(drafter.paused, every)
            if every:
                k = 0
        started = time.perf_counter()
        draft = drafter.propose(tokens, k) if k else Draft([])
        d = draft.tokens[:k]
        masks = RowMasks(matcher, d, target.eos_ids) if matcher is not None else None
        if masks is not None:
            if masks.dead_end:
                reason = STOP_CONSTRAINT
                break
            d = masks.draft
        states, hidden = target.forward([tokens[-1]] + d, n - 1, layers, row_exact=strict, head=False)
        positions = list(range(n, n + len(d) + 1))
        if use_rejection and draft.q is not None and d:
            p = (probs(target.head_logits(states), sampling) if masks is None
                 else masked_probs(target, states, masks.allowed, sampling))
            u = torch.stack([torch.rand((), generator=keyed_generator(sampling.seed, pos, "accept"))
                             for pos in positions[:-1]])
            verdict = accept_rejection(d, p, draft.q[:len(d)], u,
                                       lambda dist, i: _sample_dist(dist, sampling.seed, positions[i]))
        else:
            verdict = accept_exact(d, target_choices(target, states, d, positions, sampling,
                                                     masks and masks.allowed))
        new = verdict.tokens(d)
        target.truncate(n + verdict.accepted)
        if masks is not None:
            masks.settle(verdict.accepted, verdict.token, target.eos_ids)
        tokens.extend(new)
        drafter.commit(tokens, {layer: h[:verdict.accepted + 1] for layer, h in hidden.items()})
        source = (draft.source or drafter.name) if d else ""
        if gate is not None:
            gate.record(source or None, len(new), time.perf_counter() - started)
        # a block of one row is a single-token pass; more rows are one only with strict verification
        step, hit_eos = emit(new, d, verdict.accepted, strict or not d, source, why)
        if step is not None:
            yield step
        if hit_eos:
            reason = STOP_EOS
            break
    yield stats.finish(reason, detok.flush())
