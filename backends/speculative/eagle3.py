"""The EAGLE-3 drafter: the head's bookkeeping is the MTP drafter's (mtp.py), its state per
position the fused features of three target layers (the head itself: backends/native/eagle3.py)."""
from __future__ import annotations

from typing import Sequence

import torch

from ..native.eagle3 import Eagle3Head
from .mtp import HeadDrafter


class Eagle3Drafter(HeadDrafter):
    name = "eagle3"

    def __init__(self, head: Eagle3Head, eos_ids: frozenset[int], want_q: bool = False):
        super().__init__(head, eos_ids, want_q)
        self.hidden_layers = head.hidden_layers

    def features(self, hidden: dict[int, torch.Tensor], tokens: Sequence[int]) -> torch.Tensor:
        return self.head.fuse(hidden, torch.tensor(tokens, dtype=torch.long, device=self.states.device))
