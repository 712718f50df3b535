"""A drafter's output head over a draft vocabulary: a smaller matmul per drafted token, mapped
back to target ids (lossless: the target verifies every guess). MTP heads and EAGLE-3 heads
both end in one."""
from __future__ import annotations

import torch
from torch import Tensor

from .linear import Linear


class VocabHead:
    """`head` maps states to logits over `ids` (target ids of the draft vocabulary, ascending or
    not), or over the whole vocabulary of `vocab_size` tokens when `ids` is None."""

    def __init__(self, head: Linear, ids: Tensor | None, vocab_size: int, dtype: torch.dtype):
        self.head, self.ids, self.vocab_size, self.dtype = head, ids, vocab_size, dtype

    def _logits(self, x: Tensor) -> Tensor:
        return self.head(x.to(self.head.weight.dtype if self.head.weight is not None else self.dtype)).float()

    def vocab_logits(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Logits over the draft vocabulary and its token ids (None: the full vocabulary)."""
        return self._logits(x), self.ids

    def greedy(self, x: Tensor) -> Tensor:
        """The most likely token per row, without spreading logits over the full vocabulary."""
        best = self._logits(x).argmax(-1)
        return best if self.ids is None else self.ids[best]

    def logits(self, x: Tensor) -> Tensor:
        """Logits over the full vocabulary (-inf outside the draft vocabulary, if there is one)."""
        out = self._logits(x)
        if self.ids is None:
            return out
        full = torch.full((x.shape[0], self.vocab_size), float("-inf"), device=x.device)
        full[:, self.ids] = out
        return full
