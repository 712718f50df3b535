"""The LM head for argmax choices on CPU: the float32 head's choice at an int8 head's cost.

A float32 head over a 50k-token vocabulary is a large share of a small model's decode step. Greedy
decoding only needs its argmax, and temperature sampling (Gumbel-max, see sampling.py) the
argmax of logits / T plus noise, so:

1. an int8 copy of the head (one scale per row) gives approximate logits A: on specchat's kernel
   (q4_kernel.py: int8 activations in blocks of 32, float32 out) where it is built, else on
   torch's int8 kernel with bfloat16 activations; several times faster either way;
2. a rigorous bound E on |A - float32 logits| per entry (Cauchy-Schwarz on the weight and
   activation rounding, plus float32 accumulation and, on torch's kernel, its bfloat16 output);
3. every token whose score could still be the best ((A + E) / T + noise >= max((A - E) / T +
   noise): about ten per row when greedy, several hundred at T = 0.7) gets its float32 logit
   computed, and its score with the sampler's own arithmetic; the best of those is the choice.

The float32 logits are each token's dot product summed in one fixed order (kernels/q4.h's
head_dot on specchat's kernel, else torch's product-then-sum of that token alone), never a GEMM's,
whose order can change with the number of rows. So the choice is the argmax of well-defined
float32 logits, and a row's choice is a function of that row alone: a verify block's rows choose
what single-token passes choose, with no near-tie left to settle. (Top-k and top-p need every
logit, and take the float32 head's GEMM.)
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from ..base import Sampling
from . import sampling as sampler

_BF16_ROUNDING = 2.0 ** -8  # relative error of rounding to bfloat16, doubled for slack
_SLACK = 1.001  # the bound's own float32 arithmetic
_CHUNK = 4096  # rows prepared at a time
_SCORE_SLACK = 1e-5  # relative margin in score comparisons


def for_head(weight: Tensor, final_norm: Tensor) -> "ArgmaxHead | None":
    """An ArgmaxHead for this float32 head, if an int8 kernel is here (specchat's or torch's) and it
    keeps to the arithmetic the bound assumes on states like the model's (random, after its final norm)."""
    from . import q4_kernel

    own = weight.device.type == "cpu" and q4_kernel.head_fits(weight) and q4_kernel.available()
    if not own and not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return None
    head = ArgmaxHead(weight, own)
    probe = torch.randn(8, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device)
    return head if head.within_bound(probe * final_norm.float()) else None


class ArgmaxHead:
    def __init__(self, weight: Tensor, own_kernel: bool = False):
        """weight: the float32 head [vocab, dim] on CPU (kept by reference, not copied);
        own_kernel: the int8 logits from specchat's kernel (q4_kernel.py), else torch's."""
        w = weight.float()
        self.weight = w.contiguous()
        self.scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(torch.bfloat16)
        self.q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        # per token: ||w - w_int8|| and max(||w||, ||w_int8||), as rows of one [2, vocab] matrix,
        # so that a state's bound terms for every token come from one small matmul
        self.norms = torch.empty(2, w.shape[0], device=w.device)
        for lo in range(0, w.shape[0], _CHUNK):  # a chunk at a time: no full-size float32 temporaries
            rows = slice(lo, lo + _CHUNK)
            part, scale = w[rows], self.scale[rows].float()[:, None]
            self.q[rows] = (part / scale).round_().clamp_(-127, 127).to(torch.int8)
            approx = self.q[rows].float() * scale
            self.norms[0, rows] = (part - approx).norm(dim=1) * _SLACK
            self.norms[1, rows] = torch.maximum(part.norm(dim=1), approx.norm(dim=1)) * _SLACK
        # float32 accumulation over `dim` products, once in the kernel and once in the recomputation
        self.gamma = 2 * w.shape[1] * torch.finfo(torch.float32).eps
        self.tiles = None
        if own_kernel:
            from .q4_kernel import pack_head

            self.tiles, self.scale32 = pack_head(self.q), self.scale.float()
            self.q = None  # the tiles hold the same int8 weights
            # specchat's kernel sums a row's blocks in float32 (one fma a block) and scales once
            self.own_gamma = (w.shape[1] // 32 + 2) * torch.finfo(torch.float32).eps

    def choose(self, states: Tensor, positions: Sequence[int], s: Sampling, allowed: Tensor | None = None) -> Tensor:
        """The token `sampling.sample` picks from the float32 logits (`exact`), for greedy decoding
        (their argmax) or temperature sampling without top-k / top-p (argmax of logits / T plus the
        position-keyed noise): only tokens whose score could still be the best are computed.
        `allowed`: bool [rows, vocab], the only tokens each row may choose (a constraint's mask);
        every row has at least one."""
        x = states.float()
        if allowed is not None:
            # where the free choice is allowed it is the best allowed token too (the first best of
            # all, so of the allowed); only the other rows are chosen again among allowed tokens
            free = self.choose(x, positions, s)
            again = ~allowed.gather(1, free[:, None]).squeeze(1)
            if bool(again.any()):
                rows = again.nonzero().squeeze(1)
                free[rows] = self._choose(x[rows], [positions[i] for i in rows.tolist()], s, allowed[rows])
            return free
        if s.greedy and self.tiles is not None:  # every step in one call of specchat's kernel
            return torch.ops.specchat.head_choose(x, self.tiles, self.scale32, self.norms, self.weight, self.gamma,
                                                  self.own_gamma, _SLACK, _SCORE_SLACK)
        return self._choose(x, positions, s)

    def _choose(self, x: Tensor, positions: Sequence[int], s: Sampling, allowed: Tensor | None = None) -> Tensor:
        """`choose` through the int8 logits' bounds: only tokens whose score could be the best (and
        that `allowed` allows) get their float32 logits computed."""
        approx, bound = self._approx(x)
        high, low = approx + bound, approx - bound  # each token's logit lies in between
        if allowed is not None:  # a forbidden token is never a candidate: -inf at both ends
            forbidden = ~allowed
            high.masked_fill_(forbidden, -torch.inf)
            low.masked_fill_(forbidden, -torch.inf)
        noise = None
        if not s.greedy:  # scores are logits / T + noise: the same shift for both ends
            noise = sampler.gumbel_noise(s.seed, positions, approx.shape[1], x.device)
            high = torch.add(noise, high, alpha=1 / s.temperature)
            low = torch.add(noise, low, alpha=1 / s.temperature)
        best_low = low.amax(1, keepdim=True)
        # a candidate's bounds lie between best_low and the best upper end, so a slack relative to
        # those two is far above the rounding of the few operations behind them
        margin = (best_low.abs() + high.amax(1, keepdim=True).abs() + 1) * _SCORE_SLACK
        rows, ids = (high >= best_low - 2 * margin).nonzero(as_tuple=True)
        exact = self.exact(x, rows, ids)
        # the sampler's own arithmetic on them (x / T + noise), so ties break as it breaks them
        scores = exact if noise is None else exact / s.temperature + noise[rows, ids]
        # per row the best score, and of equal ones the first token (ids ascend within a row), as the sampler
        best = torch.full((len(x),), -torch.inf).scatter_reduce(0, rows, scores, "amax")
        top = (scores == best[rows]).nonzero().squeeze(1)
        first = torch.full((len(x),), len(ids)).scatter_reduce(0, rows[top], top, "amin")
        return ids[first]

    def exact(self, x: Tensor, rows: Tensor, ids: Tensor) -> Tensor:
        """The float32 logits of token ids[i] for row rows[i] of x, each summed in one fixed order."""
        if self.tiles is not None:
            return torch.ops.specchat.head_dots(x, self.weight, rows, ids)
        return (self.weight[ids] * x[rows]).sum(-1)

    def _approx(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self._approx_own(x) if self.tiles is not None else self._approx_torch(x)

    def _approx_own(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """specchat's kernel: x quantized to x8 (int8 blocks), so the logits' distance from the
        float32 logits is, per token, at most ||x8|| ||w - w_int8|| (weight rounding) +
        (||x - x8|| + gamma ||x|| + own_gamma ||x8||) max(||w||, ||w_int8||) (activation rounding,
        the float32 head's accumulation, the kernel's own); every row on its own, its bits
        independent of the others'."""
        logits, norms = torch.ops.specchat.q8_head(x, self.tiles, self.scale32)  # norms: ||x8||, ||x - x8||
        x_norm = x.norm(dim=1) * _SLACK
        weight_term = torch.maximum(norms[:, 0], x_norm)
        act = norms[:, 1] + self.gamma * x_norm + self.own_gamma * norms[:, 0]
        coeff = torch.stack([weight_term, act], 1) * _SLACK
        return logits, coeff @ self.norms

    def _approx_torch(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The int8 head's logits and the bound on their distance from the float32 logits: per token,
        ||x|| ||w - w_int8|| (weight rounding) + (||x - x_bf16|| + gamma max(||x||, ||x_bf16||)) ||w||
        (activation rounding, float32 accumulation) + 2^-8 |logit| (the kernel's bfloat16 output)."""
        xb = x.to(torch.bfloat16)
        logits = torch.ops.aten._weight_int8pack_mm(xb, self.q, self.scale).float()
        x_norm = x.norm(dim=1) * _SLACK
        xb_norm = xb.float().norm(dim=1)
        act = (x - xb.float()).norm(dim=1) * _SLACK + self.gamma * torch.maximum(x_norm, xb_norm)
        coeff = torch.stack([x_norm, act], 1) * _SLACK  # [rows, 2]; the slack covers this matmul's rounding
        bound = torch.add(coeff @ self.norms, logits.abs(), alpha=_BF16_ROUNDING)
        return logits, bound

    def within_bound(self, states: Tensor) -> bool:
        """Whether the int8 kernel's logits for `states` lie within the bound of the float32 ones
        (they do unless a torch build changes the kernel's arithmetic)."""
        x = states.float()
        logits, bound = self._approx(x)
        return bool(((logits - x @ self.weight.T).abs() <= bound).all())
