"""How often the UI may redraw while an engine streams.

The engine shares the CPU (and, in-process, the GIL) with the UI thread, so every redraw costs
decode speed. The drain timer still runs at ~30 Hz (events are taken off the queue and counted
every tick), but a redraw happens only when the UI thread's own CPU time stays under `share`
of the wall clock: the cost of the last redraw (layout, Markdown, compositing, measured with
`time.thread_time`) decides how long to wait before the next. A fast terminal redraws at 30 Hz;
a slow one drops to a few frames a second instead of slowing the model down.
"""
from __future__ import annotations

import time


class RenderBudget:
    def __init__(self, share: float = 0.05, min_interval: float = 1 / 30, max_interval: float = 1.0):
        self.share = share
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.reset()

    def reset(self) -> None:
        self.next_at = 0.0
        self._drew_at: float | None = None
        self._cpu_at_draw = 0.0
        self.interval = self.min_interval

    def due(self) -> bool:
        """Call once per tick; True when this tick may redraw."""
        now = time.perf_counter()
        if self._drew_at is not None:
            # the UI thread's CPU since the last redraw is that redraw's cost (and the ticks since)
            cost = time.thread_time() - self._cpu_at_draw
            self.interval = min(self.max_interval, max(self.min_interval, cost / self.share))
            self.next_at = self._drew_at + self.interval
        return now >= self.next_at

    def drew(self) -> None:
        self._drew_at = time.perf_counter()
        self._cpu_at_draw = time.thread_time()

    @property
    def fps(self) -> float:
        return 1 / self.interval
