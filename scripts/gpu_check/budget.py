"""Time budgets: the whole check has one, and each part its own share of it.

A part checks `allows(seconds)` before each step it can skip; a step that does not fit is not
started, and the part says what it left out (`skip`), so a slow machine gets a shorter report
rather than none.
"""
from __future__ import annotations

import time


class Clock:
    def __init__(self, total_s: float):
        self.start = time.perf_counter()
        self.total_s = total_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.total_s - self.elapsed()


class Part:
    """One part's budget and its record: results, what was skipped and why, and its wall time."""

    def __init__(self, clock: Clock, name: str, budget_s: float):
        self.clock, self.name, self.budget_s = clock, name, budget_s
        self.start = time.perf_counter()
        self.skipped: list[str] = []

    def left(self) -> float:
        own = self.budget_s - (time.perf_counter() - self.start)
        return min(own, self.clock.left())

    def allows(self, seconds: float) -> bool:
        return self.left() >= seconds

    def skip(self, what: str) -> None:
        self.skipped.append(f"{what}: skipped, {max(self.left(), 0):.0f} s of the part's "
                            f"{self.budget_s:.0f} s budget left")

    def seconds(self) -> float:
        return time.perf_counter() - self.start
