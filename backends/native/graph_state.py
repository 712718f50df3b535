"""Compiled decode graphs on a hybrid model (Gated DeltaNet layers between attention layers).

A linear-attention layer's recurrent state (conv, ssm) is a graph input, and the state after the
row a graph output: a graph never writes it in place, so the states a rollback returns to
(recurrent_state.py's snapshots, turn checkpoints) stay as they were. Inside the graph the layers
read the state through `GraphState`, which has the pass interface of RecurrentState
(begin / state_before / record / end) over the explicit tensors.

Only the one-row graph is compiled: a row's recurrence is a loop over the rows, which an exported
graph dynamic in the number of rows cannot unroll. A row-exact verify block therefore runs its
rows through the one-row graph one after another (`hybrid_rows`): each row is by construction
the single-token pass at its position, so strict verification keeps target-only decoding's bits,
at the cost of a pass per row (the weights are read once per row, not once per block).

Rolling back a compiled hybrid takes the snapshots (the state after each row, graph outputs);
replay would recompute the state with the eager scan, whose bits the compiled graph need not
share, so `compile` asks for `rollback: snapshot` (engine.py).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .exact_rows import CompiledRowGraphs, RowGroup, all_layers, key_mask, key_span


class GraphState:
    """RecurrentState's pass interface over explicit (conv, ssm) lists, one per linear layer, for a
    compiled graph: it reads the states given and keeps those the layers leave, with their input rows."""

    keeps_snapshots = True  # the layers' scan keeps the state after each row (the graph's one row)

    def __init__(self, conv: list[Tensor], ssm: list[Tensor]):
        self.conv, self.ssm = list(conv), list(ssm)
        self.rows: list[Tensor | None] = [None] * len(self.conv)

    def begin(self, start: int, rows: int, window: bool, turn: bool = False) -> None:
        pass

    def end(self, length: int) -> None:
        pass

    def state_before(self, j: int, layer) -> tuple[Tensor, Tensor]:
        return self.conv[j], self.ssm[j]

    def record(self, j: int, conv: Tensor, ssm: Tensor, rows: Tensor, after_rows: list | None) -> None:
        self.conv[j], self.ssm[j], self.rows[j] = conv, ssm, rows


def hybrid_layers(model, x: Tensor, pos: int, n_keys: int, mask: Tensor, keep_hidden: bool,
                  conv: list[Tensor], ssm: list[Tensor]) -> tuple:
    """The compiled function of a hybrid: `all_layers` with the recurrent state (conv, ssm) given;
    returns (output, {layer: output}, conv after, ssm after, input rows), the last three per linear layer."""
    state, saved = GraphState(conv, ssm), model.cache.recurrent
    model.cache.recurrent = state
    try:
        out, every = all_layers(model, x, pos, n_keys, mask, keep_hidden)
    finally:
        model.cache.recurrent = saved
    return out, every, state.conv, state.ssm, state.rows


def zero_states(model) -> tuple[list[Tensor], list[Tensor]]:
    """A fresh recurrent state, as (conv, ssm) lists: a graph's example input."""
    rec = model.cache.recurrent
    s, n = rec.shape, rec.n_layers
    conv = [torch.zeros(s.conv_kernel - 1, s.conv_dim, device=model.device) for _ in range(n)]
    return conv, [torch.zeros(s.v_heads, s.k_dim, s.v_dim, device=model.device) for _ in range(n)]


class HybridRowGraphs(CompiledRowGraphs):
    """CompiledRowGraphs of a hybrid: `hybrid_layers` compiled, its one-row graph called row by row."""

    function = staticmethod(hybrid_layers)
    hybrid = True

    def __call__(self, x: Tensor, start_pos: int, groups: list[RowGroup], layers: list[int]
                 ) -> tuple[Tensor, dict[int, Tensor]]:
        return hybrid_rows(self.model, self._run, x, start_pos, layers)

    def example_states(self) -> tuple[list[Tensor], list[Tensor]]:
        return zero_states(self.model)


def hybrid_rows(model, run_row: Callable, x: Tensor, start_pos: int, layers: list[int]
                ) -> tuple[Tensor, dict[int, Tensor]]:
    """Rows x [K, dim] at start_pos.. through the one-row graph, one after another (`run_row(rows,
    pos, n_keys, mask, keep_hidden, states)`), carrying the recurrent state from row to row and
    recording it in the model's RecurrentState as an eager pass does (each row's state kept for
    rolling back). Returns the last layer's output and the outputs of `layers`."""
    rec = model.cache.recurrent
    K = x.shape[0]
    rec.begin(start_pos, K, window=True, turn=model.prefilling)
    states = tuple(zip(*(rec.state_before(j, None) for j in range(rec.n_layers))))
    after: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(rec.n_layers)]
    inputs: list[list[Tensor]] = [[] for _ in range(rec.n_layers)]
    outs, hiddens = [], []
    dtype = model.cache_dtype
    for i in range(K):
        pos = start_pos + i
        n_keys = key_span(pos + 1, model.max_len)
        mask = key_mask(torch.tensor([pos + 1], device=model.device), n_keys, dtype)
        rows = x if K == 1 else x[i:i + 1].clone()  # whole inputs, not views (see CompiledRowGraphs)
        out, every, conv, ssm, fed = run_row(rows, pos, n_keys, mask, bool(layers), states)
        states = (list(conv), list(ssm))
        for j in range(rec.n_layers):
            after[j].append((conv[j], ssm[j]))
            inputs[j].append(fed[j])
        outs.append(out)
        hiddens.append(every)
    for j in range(rec.n_layers):
        rec.record(j, states[0][j], states[1][j], torch.cat(inputs[j]), after[j])
    rec.end(start_pos + K)
    x = outs[0] if K == 1 else torch.cat(outs)
    return x, {i: torch.cat([h[i] for h in hiddens]) if K > 1 else hiddens[0][i] for i in layers}

