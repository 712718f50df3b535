"""Drafters that propose with a head fed the target's hidden states: the MTP drafter (the head:
backends/native/mtp.py) and, on the same bookkeeping, EAGLE-3 (speculative/eagle3.py).

Bookkeeping: after a pass the committed sequence is x[0..n-1] and the target has handed over its
hidden states h[0..n-2] (the last token is fed at the start of the next verify block). The head's
real entries are the pairs (h[t], x[t+1]) for t = 0..n-2, cached; the last one predicts x[n].
Deeper drafts feed the head's own output back in place of h, in entries past the real ones,
which the next pass overwrites.
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Sequence

import torch

from ..base import Sampling
from ..native.model import FINAL
from ..native.mtp import MtpHead
from ..native.sampling import probs, sample
from .loop import Draft, Drafter, common_prefix

HIDDEN_SOURCES = ("post_norm", "pre_norm")


class HeadDrafter(Drafter):
    """Drafts with a head that pairs a state per committed position with the next token (the
    bookkeeping above): MTP heads and EAGLE-3 heads. A subclass says which target layers it needs
    (`hidden_layers`) and what state it keeps per position (`features`)."""

    def __init__(self, head, eos_ids: frozenset[int], want_q: bool = False):
        self.head, self.eos_ids, self.want_q = head, eos_ids, want_q
        self.states = torch.empty(head.max_len, head.target.cfg.dim, device=head.target.device)
        self.n_states = 0  # states held, for positions 0..n_states-1
        self.entries = 0  # real head entries in the cache
        self.tokens: Sequence[int] = []  # the committed sequence the states belong to
        self.sampling = Sampling()

    @abstractmethod
    def features(self, hidden: dict[int, torch.Tensor], tokens: Sequence[int]) -> torch.Tensor:
        """The state the head pairs with each of some committed positions, from the target's hidden
        states there and the tokens at them."""

    def reusable(self, prompt_ids) -> int:
        return common_prefix(self.tokens[:self.n_states], prompt_ids)

    def start(self, prompt_ids, hidden, sampling: Sampling, reused: int = 0) -> None:
        """Keeps the states of positions before `reused` and the head entries made only of them
        (entry t pairs h[t] with x[t+1])."""
        if reused > self.n_states:
            raise RuntimeError(f"{self.name} drafter asked to reuse {reused} positions, holding {self.n_states}")
        self.sampling = sampling
        self.n_states, self.entries = reused, min(self.entries, max(reused - 1, 0))
        if not self.entries:
            self.head.reset()
        self.tokens = prompt_ids
        self._add(hidden)

    def commit(self, tokens, hidden) -> None:
        self.tokens = tokens
        self._add(hidden)

    def _add(self, hidden: dict[int, torch.Tensor]) -> None:
        rows = len(next(iter(hidden.values())))
        h = self.features(hidden, self.tokens[self.n_states:self.n_states + rows])
        self.states[self.n_states:self.n_states + len(h)] = h
        self.n_states += len(h)

    def _choose(self, g: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None]:
        if self.sampling.greedy and not self.want_q:
            return int(self.head.greedy(g)[0]), None
        if not self.want_q:  # noise for the draft vocabulary's tokens only, not all 49,152
            logits, ids = self.head.vocab_logits(g)
            return int(sample(logits, [position], self.sampling, token_ids=ids)[0]), None
        logits = self.head.logits(g)
        q = probs(logits, self.sampling)[0] if self.want_q else None
        # the target's own position-keyed sampler: at temperature > 0 the guess shares the target's noise
        return int(sample(logits, [position], self.sampling)[0]), q

    def propose(self, tokens: Sequence[int], depth: int) -> Draft:
        n = len(tokens)
        real = min(self.n_states, n - 1)  # entries whose hidden state is the target's
        if real < 1 or depth < 1:
            return Draft([])
        new = range(self.entries, real)
        if len(new):
            g = self.head.forward(self.states[new.start:new.stop],
                                  torch.tensor(tokens[new.start + 1:new.stop + 1], device=self.states.device),
                                  new.start)
            last = g[-1:]
        else:  # nothing new committed since the last proposal: recompute the last real entry
            last = self.head.forward(self.states[real - 1:real],
                                     torch.tensor([tokens[real]], device=self.states.device), real - 1)
        self.entries = real
        out, qs = [], []
        for i in range(depth):
            token, q = self._choose(last, n + i)
            out.append(token)
            if q is not None:
                qs.append(q)
            if i + 1 == depth or token in self.eos_ids:
                break
            last = self.head.forward(last, torch.tensor([token], device=last.device), real + i)
        return Draft(out, torch.stack(qs) if qs else None)


class MtpDrafter(HeadDrafter):
    name = "mtp"

    def __init__(self, head: MtpHead, eos_ids: frozenset[int], hidden_source: str = "post_norm",
                 want_q: bool = False):
        if hidden_source not in HIDDEN_SOURCES:
            raise ValueError(f"hidden_source must be one of {HIDDEN_SOURCES}")
        super().__init__(head, eos_ids, want_q)
        self.hidden_source = hidden_source
        # post_norm: the target's final hidden state after its norm; pre_norm: the last layer's output
        self.key = FINAL if hidden_source == "post_norm" else head.target.cfg.n_layers - 1
        self.hidden_layers = (self.key,)

    def features(self, hidden: dict[int, torch.Tensor], tokens: Sequence[int]) -> torch.Tensor:
        return hidden[self.key]
