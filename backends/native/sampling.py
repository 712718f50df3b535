"""Position-keyed sampling: the same logits at the same position always give the same token.

Sampling at temperature T is Gumbel-max: argmax(logits / T + G) over the tokens that survive
top-k and top-p, which draws exactly from the filtered softmax. The noise G for the token at
absolute position p comes from a counter-based hash of (seed, p, token id) computed with integer
tensor ops, so it is deterministic, independent of platform and of how many positions are
sampled at once. That is what lets a speculative run reproduce target-only output for a seed:
any path that computes the same logits for position p picks the same token there.

Convention: `positions[i]` is the absolute position the chosen token will occupy (the logits
row that produced it came from position positions[i] - 1).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from backends.base import Sampling

_M32 = 0xFFFFFFFF


def _mix32(x: Tensor | int) -> Tensor | int:
    """A 32-bit integer finaliser (Wellons' lowbias32), on Python ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _position_key(seed: int, position: int) -> int:
    return _mix32((_mix32((seed & _M32) ^ 0x5BD1E995) + position * 0x9E3779B9) & _M32)


def uniform_noise(seed: int, positions: Sequence[int], vocab: int, device=None) -> Tensor:
    """Uniforms in (0, 1), float64 [len(positions), vocab], keyed by (seed, position, token id)."""
    keys = torch.tensor([_position_key(seed, int(p)) for p in positions], dtype=torch.int64, device=device)
    ids = torch.arange(vocab, dtype=torch.int64, device=device)
    h = _mix32((keys[:, None] ^ _mix32(ids + 0x632BE5AB)[None, :]) & _M32)
    h = _mix32((h + 0x68E31DA4) & _M32)  # a second round decorrelates neighbouring ids and keys
    return ((h >> 8).double() + 0.5) / (1 << 24)


def gumbel_noise(seed: int, positions: Sequence[int], vocab: int, device=None) -> Tensor:
    u = uniform_noise(seed, positions, vocab, device)
    return (-torch.log(-torch.log(u))).float()


def filtered_logits(logits: Tensor, s: Sampling) -> Tensor:
    """logits / T with everything outside top-k and top-p set to -inf (float32, [K, V])."""
    x = logits.float() / s.temperature
    if s.top_k > 0 and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(p, dim=-1) - p
        drop_sorted = mass_before >= s.top_p  # keeps the smallest prefix reaching top_p (at least one)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def probs(logits: Tensor, s: Sampling) -> Tensor:
    """The distribution `sample` draws from: one-hot argmax when greedy, else the filtered softmax."""
    if s.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(filtered_logits(logits, s), dim=-1)


def sample(logits: Tensor, positions: Sequence[int] | Tensor, s: Sampling) -> Tensor:
    """One token per row of logits [K, V]; row i is the token for absolute position positions[i]."""
    if logits.dim() == 1:
        logits = logits[None]
    if s.greedy:
        return logits.argmax(-1)
    if isinstance(positions, Tensor):
        positions = positions.tolist()
    if len(positions) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows but {len(positions)} positions")
    g = gumbel_noise(s.seed, positions, logits.shape[-1], logits.device)
    return (filtered_logits(logits, s) + g).argmax(-1)
