"""Routed-expert MLPs (mixture of experts): Qwen3-MoE, GLM-4.5, Qwen3-Next / Qwen3.5-MoE.

Per row: a router scores every expert and picks `top_k` of them with weights (config.MoeShape
says how); the row's output is the weighted sum of those experts' SwiGLU outputs, plus a shared
expert (behind a sigmoid gate on Qwen's) that every row runs.

How rows are computed, so that a verify block is exact and not wasteful:
- the router's scores are a float32 matmul, on CPU in row pairs (`Linear(pairwise=True)`, as the
  LM head), and its elementwise steps run on rows padded to a multiple of ROW_PAD values, so a
  row's scores, and so its choice, never depend on the other rows of the pass;
- a pass runs only the experts its rows chose, each once, on the rows that chose it
  (`group_rows`): a one-token pass reads top_k experts' weights, a k-row verify block each chosen
  expert's weights once however many of its rows chose it;
- each expert's matmuls are the dense layers' (`Linear(exact=...)`), so with row-invariant
  kernels (bfloat16 / int4 on CPU: exact_rows.py) a row gets the bits of running alone;
- a row's expert outputs are summed in the row's own top-k order (best score first), by the
  same elementwise steps in a one-token pass and in a block.
Where the kernels are not row-invariant (float32 / float16, CUDA), a block's rows may round
differently from one-token passes, as for dense layers; strict verification is then off and
`specchat verify` says so per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import MoeShape
from .layers import GatedMLP, frozen
from .linear import Linear

# Elementwise steps on router outputs run over rows padded to a multiple of this many values:
# ATen runs a contiguous tensor's values in vector blocks (2 x 16 floats with AVX-512) and its tail
# with scalar code, whose transcendental functions round differently; padded, no value of any row
# is ever in a tail, however many rows the pass has.
ROW_PAD = 32


def rowwise(fn, x: Tensor) -> Tensor:
    """fn (elementwise) on x [T, n], every value on the vector path whatever T is (see ROW_PAD)."""
    n = x.shape[-1]
    pad = (-n) % ROW_PAD
    return fn(F.pad(x, (0, pad)))[..., :n] if pad else fn(x)


def add_columns(x: Tensor) -> Tensor:
    """x [T, k] summed over k left to right, one elementwise add at a time (a reduction kernel
    may block a row differently with other row counts)."""
    total = x[:, 0]
    for j in range(1, x.shape[1]):
        total = total + x[:, j]
    return total


class Router(nn.Module):
    """Scores [T, experts] from h [T, dim] and each row's top-k experts and their weights.
    `weight` [experts, dim]; `bias`: GLM's `e_score_correction_bias`, used to choose, not to weigh;
    `shared_gate` [1, dim]: Qwen's shared-expert gate, computed in the same matmul."""

    def __init__(self, shape: MoeShape, weight: Tensor, bias: Tensor | None = None,
                 shared_gate: Tensor | None = None):
        super().__init__()
        self.shape = shape
        rows = weight if shared_gate is None else torch.cat([weight, shared_gate])
        # in row pairs on CPU, where strict verification needs a row's scores alone (on CUDA it never
        # applies, and a prefill's rows would cost a kernel launch a pair)
        self.scores = Linear(rows.float().contiguous(), pairwise=rows.device.type == "cpu")
        self.bias = frozen(None if bias is None else bias.float().to(weight.device))
        self.gated = shared_gate is not None

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """(weights [T, k] float32, experts [T, k] int64 best first, shared-expert gate [T, 1] or None)."""
        s = self.shape
        logits = self.scores(h.float())
        gate = None
        if self.gated:
            gate = rowwise(torch.sigmoid, logits[:, s.experts:].contiguous())
            logits = logits[:, :s.experts].contiguous()
        if s.scoring == "softmax":
            probs = F.softmax(logits, dim=-1)  # row by row over the last dim
            weights, experts = probs.topk(s.top_k, dim=-1)
        else:
            scores = rowwise(torch.sigmoid, logits)
            choice = scores if self.bias is None else scores + self.bias
            experts = self._grouped_top_k(choice)
            weights = scores.gather(1, experts)
        if s.renormalise:
            total = add_columns(weights)[:, None]
            weights = weights / (total + 1e-20 if s.scoring == "sigmoid" else total)
        if s.scaling != 1.0:
            weights = weights * s.scaling
        return weights, experts, gate

    def _grouped_top_k(self, choice: Tensor) -> Tensor:
        """GLM-4.5 / DeepSeek-V3: each group of experts scored by the sum of its best two, only the
        `topk_group` best groups' experts eligible; the top-k of those, best first."""
        s = self.shape
        if s.n_group > 1:
            T = choice.shape[0]
            per_group = choice.view(T, s.n_group, -1)
            best = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0]
            group_scores = add_columns(best.reshape(-1, best.shape[-1])).view(T, s.n_group)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(s.topk_group, dim=-1)[1], True)
            choice = per_group.masked_fill(~keep[:, :, None], float("-inf")).view(T, -1)
        return choice.topk(s.top_k, dim=-1)[1]


def group_rows(experts: Tensor) -> dict[int, tuple[list[int], list[int]]]:
    """expert -> (the rows that chose it, at which of their top-k slots), from experts [T, k]."""
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for row, chosen in enumerate(experts.tolist()):
        for slot, expert in enumerate(chosen):
            rows, slots = groups.setdefault(expert, ([], []))
            rows.append(row)
            slots.append(slot)
    return groups


class RoutedExperts(nn.Module):
    """A mixture-of-experts MLP: router, experts (SwiGLU each, as GatedMLP), optional shared expert."""

    def __init__(self, router: Router, experts: list[GatedMLP], shared: GatedMLP | None = None):
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.shared = shared

    def forward(self, h: Tensor, exact: bool = False) -> Tensor:
        """h [T, dim] (normed, compute dtype) -> float32 [T, dim]."""
        weights, experts, gate = self.router(h)
        T, k = experts.shape
        outputs = torch.empty(T, k, h.shape[-1], dtype=torch.float32, device=h.device)
        for expert, (rows, slots) in group_rows(experts).items():
            x = h if len(rows) == T else h[rows]  # rows in order, each once
            outputs[rows, slots] = self.experts[expert](x, exact).float()
        out = weights[:, 0, None] * outputs[:, 0]
        for slot in range(1, k):  # the row's own top-k order, in a block as in a one-token pass
            out = out + weights[:, slot, None] * outputs[:, slot]
        if self.shared is not None:
            shared = self.shared(h, exact).float()
            out = out + (shared if gate is None else gate * shared)
        return out

    def expert_linears(self) -> tuple[Linear, ...]:
        """One expert's matrices and the shared expert's (what a row-invariance probe needs)."""
        mlps = [self.experts[0]] + ([self.shared] if self.shared is not None else [])
        return tuple(lin for mlp in mlps for lin in (mlp.gate_up, mlp.down))
