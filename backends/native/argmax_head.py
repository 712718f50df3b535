"""The LM head for argmax choices on CPU: the float32 head's choice at an int8 head's cost.

A float32 head over SmolLM2's 49,152 tokens is a fifth of a decode step on 2 cores. Greedy
decoding only needs its argmax, and temperature sampling (Gumbel-max, see sampling.py) the
argmax of logits / T plus noise, so:

1. an int8 copy of the head (one scale per row, torch's int8 kernel with bfloat16 activations,
   about 3x faster) gives approximate logits A;
2. a rigorous bound E on |A - float32 logits| per entry (Cauchy-Schwarz on the weight and
   activation rounding, plus float32 accumulation and the kernel's bfloat16 output);
3. every token whose score could still be the best ((A + E) / T + noise >= max((A - E) / T +
   noise): about ten per row when greedy, several hundred at T = 0.7) gets its logit recomputed in
   float32 from the exact weights, and its score with the sampler's own arithmetic.

The choice is the one `sampling.sample` makes from float32 logits (top-k and top-p still need
every logit, and take the float32 head). Every step works row by row (the int8 kernel is
row-invariant), so a verify block's rows choose what single-token passes choose.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from backends.base import Sampling
from backends.native import sampling as sampler

_BF16_ROUNDING = 2.0 ** -8  # relative error of rounding to bfloat16, doubled for slack
_SLACK = 1.001  # the bound's own float32 arithmetic
_CHUNK = 4096  # rows prepared at a time
_SCORE_SLACK = 1e-5  # relative margin in score comparisons


def for_head(weight: Tensor, final_norm: Tensor) -> "ArgmaxHead | None":
    """An ArgmaxHead for this float32 head, if this torch has the int8 kernel and the kernel keeps
    to the arithmetic the bound assumes on states like the model's (random, after its final norm)."""
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return None
    head = ArgmaxHead(weight)
    probe = torch.randn(8, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device)
    return head if head.within_bound(probe * final_norm.float()) else None


class ArgmaxHead:
    def __init__(self, weight: Tensor):
        """weight: the float32 head [vocab, dim] on CPU (kept by reference, not copied)."""
        w = weight.float()
        self.weight = w
        self.scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(torch.bfloat16)
        self.q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        self.err_norm = torch.empty(w.shape[0], device=w.device)  # ||w - w_int8|| per row
        self.w_norm = torch.empty(w.shape[0], device=w.device)  # max(||w||, ||w_int8||) per row
        for lo in range(0, w.shape[0], _CHUNK):  # a chunk at a time: no full-size float32 temporaries
            rows = slice(lo, lo + _CHUNK)
            part, scale = w[rows], self.scale[rows].float()[:, None]
            self.q[rows] = (part / scale).round_().clamp_(-127, 127).to(torch.int8)
            approx = self.q[rows].float() * scale
            self.err_norm[rows] = (part - approx).norm(dim=1) * _SLACK
            self.w_norm[rows] = torch.maximum(part.norm(dim=1), approx.norm(dim=1)) * _SLACK
        # float32 accumulation over `dim` products, once in the kernel and once in the recomputation
        self.gamma = 2 * w.shape[1] * torch.finfo(torch.float32).eps

    def choose(self, states: Tensor, positions: Sequence[int], s: Sampling) -> Tensor:
        """The token `sampling.sample` picks from the float32 logits, for greedy decoding (argmax of
        the logits) or temperature sampling without top-k / top-p (argmax of logits / T plus the
        position-keyed noise): only tokens whose score could still be the best are recomputed."""
        x = states.float()
        approx, bound = self._approx(x)
        t = 1.0 if s.greedy else s.temperature
        low, high = (approx - bound) / t, (approx + bound) / t  # each token's score lies in between
        noise = None
        if not s.greedy:
            noise = sampler.gumbel_noise(s.seed, positions, approx.shape[1], x.device)
            low, high = low + noise, high + noise
        margin = (low.abs() + high.abs() + 1) * _SCORE_SLACK  # far above the rounding of these few operations
        rows, ids = (high + margin >= (low - margin).amax(1, keepdim=True)).nonzero(as_tuple=True)
        exact = (self.weight[ids] * x[rows]).sum(-1)  # the float32 logits of the tokens that could win
        scores = torch.full_like(approx, float("-inf"))
        # the sampler's own arithmetic on them (x / T + noise), so ties break as it breaks them
        scores[rows, ids] = exact if noise is None else exact / s.temperature + noise[rows, ids]
        return scores.argmax(-1)

    def _approx(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The int8 head's logits and the bound on their distance from the float32 logits."""
        xb = x.to(torch.bfloat16)
        logits = torch.ops.aten._weight_int8pack_mm(xb, self.q, self.scale).float()
        x_norm = x.norm(dim=1, keepdim=True) * _SLACK
        bound = (self.err_norm * x_norm + self.w_norm * (x - xb.float()).norm(dim=1, keepdim=True) * _SLACK
                 + self.gamma * self.w_norm * torch.maximum(x_norm, xb.float().norm(dim=1, keepdim=True))
                 + _BF16_ROUNDING * logits.abs())
        return logits, bound

    def within_bound(self, states: Tensor) -> bool:
        """Whether the int8 kernel's logits for `states` lie within the bound of the float32 ones
        (they do unless a torch build changes the kernel's arithmetic)."""
        x = states.float()
        logits, bound = self._approx(x)
        return bool(((logits - x @ self.weight.T).abs() <= bound).all())
