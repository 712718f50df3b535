"""The recurrent layers' state for one sequence, and how it rolls back after a verify block.

A KV cache rolls back by shortening it; a recurrent state cannot: after a block of T rows of which
only the first j are kept, every linear-attention layer must hold its state as if only those j
rows had been fed. Two ways, selectable (`rollback`), both exact:

- snapshot: keep the state after every row of the last pass (vLLM's state slots, SGLang's
  intermediate states, llama.cpp's per-token snapshots); rolling back picks one. Memory per row of
  a block: every layer's whole state.
- replay (ReplaySSM): keep one checkpoint, the state before the pass, and the pass's inputs
  (each row's projected q|k|v|b|a); rolling back is a cursor move, and the next pass first replays
  the kept rows from the checkpoint with the same one-token arithmetic. Memory per row: one input
  row per layer, a few hundredths of a state.

`block_bytes` states the memory of either; scripts/bench_recurrent.py measures their time.
Positions this state can return to: its length, 0 (empty), the window `start`..length: the last
pass, or with `span`, consecutive passes without a rollback between them covering at most `span`
positions (a draft model's own one-token passes, which its next proposal rolls back into), and its
turn checkpoints.

Turn checkpoints: the state where a prefill starts (the end of the previous reply) and where it ends
(a reply starts), kept for the last MAX_CHECKPOINTS such positions. A chat whose earlier text changes
(a template that re-renders the last assistant turn, an edited reply) then restarts from the last
boundary before the change instead of position 0. States are replaced, never written in place, so a
checkpoint holds references: memory `checkpoint_bytes` each, only while no later pass replaced them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .config import LinearAttentionShape

ROLLBACK_MODES = ("snapshot", "replay")
# Turn checkpoints kept (the newest): a turn adds two (its prefill's start and end), so the last two
# turns' boundaries. Each holds every linear layer's state (`checkpoint_bytes`).
MAX_CHECKPOINTS = 4


class RecurrentState:
    """State of `n_layers` Gated DeltaNet layers: conv [K-1, conv_dim] and ssm [Hv, dk, dv] each, float32."""

    def __init__(self, shape: LinearAttentionShape, n_layers: int, mode: str, device: torch.device, span: int = 0):
        if mode not in ROLLBACK_MODES:
            raise ValueError(f"unknown rollback '{mode}' (expected {', '.join(ROLLBACK_MODES)})")
        self.shape, self.n_layers, self.mode, self.device, self.span = shape, n_layers, mode, device, span
        self.reset()

    def reset(self) -> None:
        s, dev = self.shape, self.device
        zeros_conv = torch.zeros(s.conv_kernel - 1, s.conv_dim, device=dev)
        zeros_ssm = torch.zeros(s.v_heads, s.k_dim, s.v_dim, device=dev)
        self.conv = [zeros_conv] * self.n_layers  # tensors are replaced, never written in place
        self.ssm = [zeros_ssm] * self.n_layers
        self.length = self.start = 0
        self.window = self.extending = self.rolled_back = False
        self.snapshots: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(self.n_layers)]  # positions start..
        self.checkpoint = list(zip(self.conv, self.ssm))  # replay: the state at `start`
        self.inputs: list[Tensor | None] = [None] * self.n_layers  # replay: rows start..length-1
        self.pending: int | None = None  # replay: rows of `inputs` to replay before the next pass
        self.turns: dict[int, list[tuple[Tensor, Tensor]]] = {}  # turn checkpoints: position -> every layer's state
        self.turn = False  # this pass is a prefill: its start and end become turn checkpoints (begin)
        self.before: list[tuple[Tensor, Tensor]] = []  # such a pass's state at its start, per layer

    # ---- rolling back ----

    def in_window(self, n: int) -> bool:
        """Whether n is a position of the last pass's window (start..length-1) it can return to."""
        if not self.start <= n < self.length:
            return False
        return self.mode == "replay" or n - self.start < len(self.snapshots[0])

    def restorable(self, n: int) -> bool:
        """Whether `rollback(n)` can bring the state to position n."""
        return n in (0, self.length) or self.in_window(n) or n in self.turns

    def restart_point(self, n: int) -> int:
        """The longest prefix of at most n positions this state can return to."""
        if n >= self.length:
            return self.length
        if self.in_window(n):
            return n
        window_end = self.start + len(self.snapshots[0]) - 1 if self.mode == "snapshot" else self.length - 1
        below = [p for p in self.turns if p <= n]
        if self.start <= n and window_end >= self.start:  # the window's last position below n
            below.append(min(n, window_end))
        return max(below, default=0)

    def rollback(self, n: int) -> None:
        if n == self.length:
            return
        if not self.restorable(n):
            raise ValueError(f"the recurrent state at position {self.length} cannot return to {n} "
                             f"(it keeps positions {self.start}..{self.length}); restart from 0")
        if n == 0:
            self.reset()
            return
        # the text after n may change: checkpoints beyond it are no longer on this sequence
        self.turns = {p: states for p, states in self.turns.items() if p <= n}
        if not self.in_window(n):
            self.restore_turn(n)
            return
        rows = n - self.start
        self.rolled_back = True
        if self.mode == "snapshot":
            for j in range(self.n_layers):
                self.conv[j], self.ssm[j] = self.snapshots[j][rows]
                del self.snapshots[j][rows + 1:]
        else:
            self.pending = rows
            self.inputs = [x[:rows] for x in self.inputs]
        self.length = n

    def restore_turn(self, n: int) -> None:
        """Return to the turn checkpoint at n: the window starts there, empty."""
        states = self.turns[n]
        self.conv, self.ssm = [c for c, _ in states], [s for _, s in states]
        self.length = self.start = n
        self.window, self.extending, self.rolled_back = False, False, True
        self.snapshots = [[] for _ in range(self.n_layers)]
        self.checkpoint, self.inputs, self.pending = list(states), [None] * self.n_layers, None

    def keep_turn(self, position: int, states: list[tuple[Tensor, Tensor]]) -> None:
        """A turn checkpoint at `position`, the oldest dropped beyond MAX_CHECKPOINTS."""
        if position == 0:
            return  # 0 is always a restart point
        self.turns.pop(position, None)
        self.turns[position] = states
        while len(self.turns) > MAX_CHECKPOINTS:
            del self.turns[min(self.turns)]

    # ---- a pass ----

    def begin(self, start: int, rows: int, window: bool, turn: bool = False) -> None:
        """A pass of `rows` rows starts at `start` (== length). `window`: the pass keeps what rolling
        back into it needs (a verify block); without (a long prefill), only its end can be returned
        to. The window starts at this pass, or, within `span`, goes on from the passes before.
        `turn`: a prefill, whose start and end are kept as turn checkpoints."""
        if start != self.length:
            raise ValueError(f"a pass at position {start} on a recurrent state of length {self.length}")
        self.turn, self.before = turn, []
        self.extending = (window and self.window and not self.rolled_back and start + rows - self.start <= self.span)
        if not self.extending:
            self.start = start
        self.window, self.rolled_back = window, False

    @property
    def keeps_snapshots(self) -> bool:
        """Whether this pass keeps the state after each of its rows (snapshot mode, in a window)."""
        return self.window and self.mode == "snapshot"

    def state_before(self, j: int, layer) -> tuple[Tensor, Tensor]:
        """Layer j's (conv, ssm) at the pass's start: in replay mode, after replaying what a rollback
        left pending (with `layer`'s own one-token arithmetic)."""
        if self.mode == "replay" and self.pending is not None:
            conv, ssm = self.checkpoint[j]
            if self.pending:
                _, conv, ssm, _ = layer.scan(conv, ssm, self.inputs[j], outputs=False)
            self.conv[j], self.ssm[j] = conv, ssm
            if j == self.n_layers - 1:
                self.pending = None
        return self.conv[j], self.ssm[j]

    def record(self, j: int, conv: Tensor, ssm: Tensor, rows: Tensor, after_rows: list | None) -> None:
        """Layer j's pass is done: its new state, its input rows [T, state_width] and (from a
        token-by-token scan) the state after each row, for the rollback window."""
        if self.turn:
            self.before.append((self.conv[j], self.ssm[j]))  # the state at the pass's start (after any replay)
        if self.keeps_snapshots:  # positions start.. : the state before the window, then after each row
            kept = self.snapshots[j] if self.extending else [(self.conv[j], self.ssm[j])]
            self.snapshots[j] = kept + after_rows
        elif self.window:  # replay: the checkpoint at `start` and every input row since
            if self.extending:
                self.inputs[j] = torch.cat([self.inputs[j], rows])
            else:
                self.checkpoint[j], self.inputs[j] = (self.conv[j], self.ssm[j]), rows
        self.conv[j], self.ssm[j] = conv, ssm

    def end(self, length: int) -> None:
        start = self.length
        self.length = length
        self.pending = None
        if self.turn:
            if len(self.before) == self.n_layers:
                self.keep_turn(start, self.before)
            self.keep_turn(length, list(zip(self.conv, self.ssm)))
        self.turn, self.before = False, []
        if not self.window:
            self.start = length
            self.snapshots = [[] for _ in range(self.n_layers)]
            self.inputs = [None] * self.n_layers

    # ---- memory ----

    def checkpoint_bytes(self) -> int:
        """Memory of one turn checkpoint (every linear layer's state), while it is the only reference."""
        s = self.shape
        return self.n_layers * ((s.conv_kernel - 1) * s.conv_dim + s.v_heads * s.k_dim * s.v_dim) * 4

    def block_bytes(self, rows: int, mode: str | None = None) -> int:
        """Extra memory a verify block of `rows` rows keeps for rolling back, over all layers."""
        s = self.shape
        state = ((s.conv_kernel - 1) * s.conv_dim + s.v_heads * s.k_dim * s.v_dim) * 4
        if (mode or self.mode) == "snapshot":
            return self.n_layers * rows * state  # the state after each row (the one before is the live one)
        return self.n_layers * (state + rows * (s.conv_dim + 2 * s.v_heads) * 4)  # checkpoint + input rows
