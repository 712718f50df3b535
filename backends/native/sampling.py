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

from ..base import Sampling

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


def uniform_noise(seed: int, positions: Sequence[int], ids: int | Tensor, device=None) -> Tensor:
    """Uniforms in (0, 1), float64, keyed by (seed, position, token id): [len(positions), vocab]
    for ids = vocab size, or the shape of `ids` ([len(positions), C] token ids per position)."""
    keys = torch.tensor([_position_key(seed, int(p)) for p in positions], dtype=torch.int64, device=device)
    if isinstance(ids, int):
        ids = torch.arange(ids, dtype=torch.int64, device=device)[None, :]
    h = _mix32((keys[:, None] ^ _mix32(ids.long() + 0x632BE5AB)) & _M32)
    h = _mix32((h + 0x68E31DA4) & _M32)  # a second round decorrelates neighbouring ids and keys
    return ((h >> 8).double() + 0.5) / (1 << 24)


def gumbel_noise(seed: int, positions: Sequence[int], ids: int | Tensor, device=None) -> Tensor:
    u = uniform_noise(seed, positions, ids, device)
    return (-torch.log(-torch.log(u))).float()


def argmax_over_vocabulary(s: Sampling) -> bool:
    """Whether the choice is an argmax over every token's score (greedy: the logits; plain
    temperature sampling: logits / T + noise), with no top-k or top-p cut that needs the exact
    distribution."""
    return s.greedy or _unfiltered(s)


def _unfiltered(s: Sampling) -> bool:
    """No top-k or top-p cut: every token is a candidate."""
    return s.top_k <= 0 and s.top_p >= 1.0


_NUCLEUS_GUESS = 1024  # top-p first looks for the nucleus among this many best tokens


def candidates(logits: Tensor, s: Sampling) -> tuple[Tensor, Tensor]:
    """The tokens sampling may pick and their tempered logits, best first: (ids [K, C],
    logits / T [K, C]) with -inf where top-p drops a token. C = V without top-k / top-p."""
    x = logits.float() / s.temperature
    K, V = x.shape
    if _unfiltered(s):
        return torch.arange(V, device=x.device).expand(K, V), x
    if s.top_k > 0:
        vals, ids = torch.topk(x, min(s.top_k, V), dim=-1)
        log_total = torch.logsumexp(vals, dim=-1, keepdim=True)  # top-p renormalises over the top-k
    else:
        log_total = torch.logsumexp(x, dim=-1, keepdim=True)
        vals, ids = torch.topk(x, min(_NUCLEUS_GUESS, V), dim=-1)
        if (torch.exp(vals - log_total).sum(-1) < s.top_p).any():  # nucleus larger: sort everything
            vals, ids = torch.sort(x, dim=-1, descending=True)
    if s.top_p < 1.0:
        p = torch.exp(vals - log_total)
        mass_before = torch.cumsum(p, dim=-1) - p
        vals = vals.masked_fill(mass_before >= s.top_p, float("-inf"))  # keeps at least the best token
    return ids, vals


def filtered_logits(logits: Tensor, s: Sampling) -> Tensor:
    """logits / T with everything outside top-k and top-p set to -inf (float32, [K, V])."""
    ids, vals = candidates(logits, s)
    return torch.full(logits.shape, float("-inf"), device=logits.device).scatter(-1, ids, vals)


def probs(logits: Tensor, s: Sampling) -> Tensor:
    """The distribution `sample` draws from: one-hot argmax when greedy, else the filtered softmax."""
    if s.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(filtered_logits(logits, s), dim=-1)


def sample(logits: Tensor, positions: Sequence[int] | Tensor, s: Sampling, token_ids: Tensor | None = None) -> Tensor:
    """One token per row of logits [K, V]; row i is the token for absolute position positions[i].
    token_ids: the token id of each column, when the logits cover a sub-vocabulary (a drafter's
    head); it samples as from full-vocabulary logits that are -inf outside it."""
    if logits.dim() == 1:
        logits = logits[None]
    if s.greedy:
        best = logits.argmax(-1)
        return best if token_ids is None else token_ids[best]
    if isinstance(positions, Tensor):
        positions = positions.tolist()
    if len(positions) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows but {len(positions)} positions")
    if logits.shape[0] > 1 and s.top_p < 1.0:
        # Row by row, as target-only decoding samples: CPU reductions over a batch of rows (the
        # logsumexp behind top-p) can round differently from the same reduction over one row.
        return torch.cat([sample(logits[i:i + 1], positions[i:i + 1], s, token_ids) for i in range(len(positions))])
    ids, vals = candidates(logits, s)
    if token_ids is not None:
        ids = token_ids[ids]
    g = gumbel_noise(s.seed, positions, ids, logits.device)
    return ids.gather(-1, (vals + g).argmax(-1, keepdim=True)).squeeze(-1)
