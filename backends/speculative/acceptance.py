"""Verification: which drafted tokens the target keeps. The only place acceptance is decided.

`exact`: the target's own choice at every position (greedy, or the seeded position-keyed
sample) is computed from the verify logits; drafts are kept while they equal it. The emitted
tokens are then exactly the tokens target-only decoding picks with the same seed.

`rejection`: the standard speculative-sampling rule (Leviathan et al. 2023): keep draft x with
probability min(1, p(x)/q(x)); at the first rejection emit a sample of norm(max(0, p - q));
when all are kept, a bonus sample of p. Lossless in distribution, higher acceptance at
temperature > 0 when the drafter samples, but not seed-identical to target-only output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass
class Verdict:
    accepted: int  # how many drafts were kept
    token: int  # the target's own token after them (correction or bonus)

    def tokens(self, draft: Sequence[int]) -> list[int]:
        return list(draft[:self.accepted]) + [self.token]


def accept_exact(draft: Sequence[int], target_choice: Sequence[int]) -> Verdict:
    """`target_choice[i]` is the target's token at draft position i (len(draft) + 1 entries)."""
    n = 0
    while n < len(draft) and draft[n] == target_choice[n]:
        n += 1
    return Verdict(n, int(target_choice[n]))


def accept_rejection(draft: Sequence[int], p: torch.Tensor, q: torch.Tensor, uniforms: torch.Tensor,
                     sample_from: Callable[[torch.Tensor, int], int]) -> Verdict:
    """`p`: target probabilities at each draft position plus the bonus one ([k+1, V]);
    `q`: the drafter's probabilities its drafts were sampled from ([k, V]);
    `uniforms[i]`: the U(0,1) draw for position i; `sample_from(dist, i)` samples a token from an
    (unnormalised) distribution with the noise of position i.

    p and q may differ in width (a draft model whose head is padded to another size than the
    target's, e.g. Qwen2.5-0.5B's 151,936 rows against 7B's 152,064): past its own rows a
    distribution is zero."""
    V = p.shape[-1]
    for i, x in enumerate(draft):
        px, qx = (float(p[i, x]) if x < V else 0.0), float(q[i, x])
        # accept with probability px / qx: u < px / qx for u in [0, 1), so px == 0 never accepts (u can be 0)
        if qx > 0 and float(uniforms[i]) * qx < px:
            continue
        residual = torch.clamp(p[i] - _width(q[i], V), min=0.0)
        if float(residual.sum()) <= 0:  # p == q: any rejection is a numerical accident; fall back to p
            residual = p[i]
        return Verdict(i, sample_from(residual, i))
    return Verdict(len(draft), sample_from(p[len(draft)], len(draft)))


def _width(row: torch.Tensor, width: int) -> torch.Tensor:
    """row cut or zero-padded to `width` entries."""
    n = row.shape[-1]
    return row[:width] if n >= width else torch.nn.functional.pad(row, (0, width - n))
