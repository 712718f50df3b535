"""When drafting pays: the loop drafts from a source only while its drafted passes bring tokens
faster than plain passes would.

A source is a drafter (`mtp`, `draft`, `ngram`, `dflash`), or one half of prompt lookup in front
of a model drafter (`lookup` and the model's name). Per source the gate keeps moving averages of
tokens per drafted pass and seconds per drafted pass (proposal, verification and acceptance), and
overall the seconds of the latest plain passes (no draft), by their median. A source drafts only
while its drafted passes bring at least `1 + margin` times the tokens per second of plain passes: one
at break-even buys nothing, and one that only seems to break even over a few passes costs speed (the
chat prompts' `smollm2-replayssm` ran at 0.94x its target-only while judged within 3% of it;
docs/results.md). A source below that after its warm-up (or far below it after three drafts) is
paused, and tried again after `probe` passes, then after twice as many each time a probe leaves it
paused (up to `max_probe`: a drafter that never pays costs a probe in 64 passes, not one in 8), and
comes back at `1 + 2 margin` when the text turns its way; a probe counts for its tokens only, since
it also pays for catching the drafter up on the passes it sat out. What the gate learns stays with
the backend from one reply to the next (backend.py). The first passes are plain, and every
`baseline_every`-th one whatever the sources do, so the plain rate stays measured as the context grows.

The gate only decides how much is drafted, which never changes what is emitted: under exact
acceptance every pass emits the target's own tokens, drafted or not.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from statistics import median


@dataclass
class _Average:
    tokens: float = 0.0
    seconds: float = 0.0
    passes: int = 0

    def add(self, tokens: float, seconds: float | None, alpha: float) -> None:
        if self.passes == 0:
            self.tokens, self.seconds = tokens, seconds or 0.0
        else:
            self.tokens += alpha * (tokens - self.tokens)
            if seconds is not None:
                self.seconds += alpha * (seconds - self.seconds)
        self.passes += 1

    @property
    def rate(self) -> float:
        """Tokens per second."""
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


class _Recent:
    """The latest `window` plain passes: their seconds by the median, so that one pass slowed by
    something else (the first after a load, another process's burst) cannot stand for all of them.
    A moving average took a slow first pass for the plain rate for hundreds of passes: a drafter that
    never paid drafted through nineteen chat replies (`smollm2-dspark`, 0.72x; docs/results.md)."""

    def __init__(self, window: int = 9):
        self.times: deque[float] = deque(maxlen=window)
        self.counts: deque[float] = deque(maxlen=window)
        self.passes = 0

    def add(self, tokens: float, seconds: float | None, alpha: float = 0.0) -> None:
        self.counts.append(tokens)
        if seconds is not None:
            self.times.append(seconds)
        self.passes += 1

    @property
    def tokens(self) -> float:
        return sum(self.counts) / len(self.counts) if self.counts else 0.0

    @property
    def seconds(self) -> float:
        return median(self.times) if self.times else 0.0

    @property
    def rate(self) -> float:
        """Tokens per second."""
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


ALL = "*"  # in a `plan`: no source drafts (a baseline pass)
# after this many drafted passes, a source below this share of the plain rate sits out at once: a
# block drafter's warm-up (eight passes, each some two plain passes' time for one or two tokens) was
# most of what it cost a short reply that it does not pay on
EARLY_PASSES, EARLY_BELOW = 3, 0.8


class DraftGate:
    def __init__(self, alpha: float = 0.08, warmup: int = 8, probe: int = 8, baseline_every: int = 32,
                 margin: float = 0.02, max_probe: int = 64, first_plain: int = 3):
        """`first_plain`: plain passes before any source drafts, so that the plain rate is a median of
        several from the start."""
        self.alpha, self.warmup, self.probe, self.baseline_every = alpha, warmup, probe, baseline_every
        self.margin, self.max_probe, self.first_plain = margin, max_probe, first_plain
        self.plain = _Recent()
        self.sources: dict[str, _Average] = {}
        self._paused_passes: dict[str, int] = {}  # passes a source has sat out since its last probe
        self._interval: dict[str, int] = {}  # passes between a paused source's probes
        self._passes = 0

    def plan(self) -> frozenset[str]:
        """The sources not to draft from in the next pass (ALL: none drafts)."""
        self._passes += 1
        if self.plain.passes < self.first_plain or self._passes % self.baseline_every == 0:
            return frozenset({ALL})
        paused = set()
        for name, avg in self.sources.items():
            was_paused = name in self._paused_passes
            floor = self.plain.rate * (1.0 + (2 * self.margin if was_paused else self.margin))
            # a source far below plain passes after a few drafts needs no full warm-up to tell
            clearly_slower = avg.passes >= EARLY_PASSES and avg.rate < self.plain.rate * EARLY_BELOW
            if (avg.passes < self.warmup and not clearly_slower) or avg.rate >= floor:
                self._paused_passes.pop(name, None)
                self._interval.pop(name, None)
                continue
            waited = self._paused_passes.get(name, 0) + 1
            interval = self._interval.get(name, self.probe)
            if waited < interval:
                self._paused_passes[name] = waited
                paused.add(name)
            else:  # a probe; each one that leaves the source paused doubles the wait for the next
                self._paused_passes[name] = 0
                self._interval[name] = min(2 * interval, self.max_probe)
        return frozenset(paused)

    def record(self, source: str | None, tokens: int, seconds: float) -> None:
        """A pass drafted by `source` (None: a plain pass) emitted `tokens` in `seconds`."""
        avg = self.plain if source is None else self.sources.setdefault(source, _Average())
        probe = source is not None and source in self._paused_passes
        if probe and self.plain.seconds > 0 and tokens >= avg.seconds / self.plain.seconds * self.plain.tokens:
            self._interval[source] = self.probe  # a probe that paid: the next ones come soon again
        avg.add(tokens, None if probe else seconds, self.alpha)

    def why_paused(self, paused: frozenset[str], every: bool = True) -> str:
        """The line a person sees while the gate holds sources back (empty when none is, or for a
        baseline pass): per paused source, the tokens its drafted passes bring and the tokens a
        drafted pass must bring to be as fast as plain passes, which cost `plain.seconds` each
        (`every`: no source drafts this pass, else the others still do)."""
        if ALL in paused or not paused or self.plain.seconds <= 0:
            return ""
        parts = []
        for name in sorted(paused):
            avg = self.sources.get(name)
            if avg is None or avg.seconds <= 0:
                continue
            # what a drafted pass must bring, in plain passes' tokens, to keep drafting
            needed = avg.seconds / self.plain.seconds * self.plain.tokens * (1 + self.margin)
            parts.append(f"{name} {avg.tokens:.2f} tok/drafted pass, {needed:.2f} needed to pay")
        return ("drafting paused: " if every else "paused: ") + "; ".join(parts) if parts else ""
