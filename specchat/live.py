"""Between a backend's stream and a front end: a feeder thread and live statistics.

The feeder runs `Backend.stream` in its own thread and puts every event on a `queue.Queue`
stamped with the time it arrived; the front end drains the queue at its own pace (the TUI on
a ~30 Hz timer), so rendering never holds the engine back. Nothing here imports Textual.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from specchat.backends.base import NO_SPEC_METRICS, Backend, BackendError, Request, Sampling, Step, Summary, tally_positions


@dataclass
class Failed:
    """The stream raised: one line for the user."""

    message: str


@dataclass
class Item:
    tag: Any  # which stream (e.g. "spec" / "ref" in the A/B view)
    event: Step | Summary | Failed
    at: float  # perf_counter when the worker received it
    draft_chars: int = 0  # for a speculative Step: characters of step.text that were accepted drafts


def one_line(e: BaseException) -> str:
    if isinstance(e, BackendError):
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}".rstrip(": ")


def draft_chars_of(backend: Backend, step: Step) -> int:
    """How many characters at the start of `step.text` the confirmed drafts account for."""
    if not step.accepted or not step.text:
        return 0
    try:
        return min(len(step.text), len(backend.detokenize(step.token_ids[:step.accepted])))
    except Exception:
        return 0


def pump(backend: Backend, request: Request, sampling: Sampling, cancel: threading.Event,
         out: "queue.Queue[Item]", tag: Any = None, gate: Optional[threading.Lock] = None) -> Optional[Summary]:
    """Run one stream to its end on the calling thread, putting every event on `out`; it starts
    once `gate` is free (held while the backend switches to what it prepared in the background).

    Always ends with exactly one Summary or Failed item for `tag`."""
    summary = None
    if gate is not None:
        with gate:
            pass
    try:
        gen = backend.stream(request, sampling, cancel)
        try:
            for ev in gen:
                now = time.perf_counter()
                if isinstance(ev, Summary):
                    summary = ev
                    out.put(Item(tag, ev, now))
                else:
                    out.put(Item(tag, ev, now, draft_chars_of(backend, ev)))
        finally:
            gen.close()
        if summary is None:
            out.put(Item(tag, Failed("the backend ended its stream without a summary"), time.perf_counter()))
    except Exception as e:  # one line to the user, never a traceback
        out.put(Item(tag, Failed(one_line(e)), time.perf_counter()))
    return summary


def background_note(backend: Backend) -> Optional[str]:
    """What a one-shot command says, as it ends, of faster passes its backend prepares in the
    background, started now that its reply is out (None: nothing to say)."""
    backend.prepare_in_background()
    line = backend.background_status() or ""
    if "unavailable" in line:
        return backend.switch_if_ready()  # why, in one line
    if "compiling" in line:  # the process outlives the command
        return f"this reply ran on {line}; the next start uses them"
    return None


def start_thread(target: Callable[[], Any], name: str) -> threading.Thread:
    t = threading.Thread(target=target, name=name, daemon=True)
    t.start()
    return t


@dataclass
class LiveStats:
    """Figures for one reply as its steps arrive (times are the worker's arrival stamps)."""

    started: float = field(default_factory=time.perf_counter)
    first_at: Optional[float] = None
    last_at: Optional[float] = None
    tokens: int = 0
    passes: int = 0
    per_pass: list[int] = field(default_factory=list)  # tokens each target pass produced
    drafts_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    speculative_passes: int = 0
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # accepted drafts by who guessed them
    paused: str = ""  # why the gate holds drafting back now (the latest pass's Step.paused)
    summary: Optional[Summary] = None

    def add(self, step: Step, at: float) -> None:
        if step.n_tokens and self.first_at is None:
            self.first_at = at
        self.last_at = at
        self.tokens += step.n_tokens
        self.passes += 1
        self.per_pass.append(step.n_tokens)
        self.paused = step.paused
        if step.drafted:
            self.speculative_passes += 1
            tally_positions(self.drafts_per_position, self.accepted_per_position, step)
            if step.source:
                self.accepted_by_source[step.source] = self.accepted_by_source.get(step.source, 0) + step.accepted

    def finish(self, summary: Summary) -> None:
        self.summary = summary

    @property
    def ttft_s(self) -> Optional[float]:
        if self.summary is not None:
            return self.summary.ttft_s
        return self.first_at - self.started if self.first_at is not None else None

    @property
    def tok_s(self) -> float:
        if self.summary is not None:
            return self.summary.decode_tok_s
        if self.first_at is None or self.last_at is None or self.tokens < 2 or self.last_at <= self.first_at:
            return 0.0
        return (self.tokens - 1) / (self.last_at - self.first_at)

    @property
    def current_per_pass(self) -> int:
        return self.per_pass[-1] if self.per_pass else 0

    @property
    def mean_per_pass(self) -> float:
        """Tokens per target pass (accepted drafts + the target's own token): Summary.tokens_per_pass."""
        if self.summary is not None and self.summary.passes:
            return self.summary.tokens_per_pass
        return self.tokens / self.passes if self.passes else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        if self.summary is not None and self.summary.drafts_per_position:
            return self.summary.acceptance_by_position  # a server's own figures arrive with the summary
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafts_per_position)]

    @property
    def speculative(self) -> bool:
        return self.speculative_passes > 0 or (self.summary is not None and self.summary.drafts > 0)


def format_rate(x: Optional[float]) -> str:
    return "–" if not x else f"{x:.1f}"


def positions_line(rates: Sequence[float], limit: int = 8) -> str:
    return " ".join(f"{r:.0%}" for r in rates[:limit]) + (" …" if len(rates) > limit else "")


def speculation_note(s: Summary, acceptance: bool = True) -> str:
    """A reply's speculation in a few words: tokens per pass (over every target pass, the figure
    the status bar shows too) and, with `acceptance`, tokens per drafted pass and the share of
    drafts accepted; empty for target-only decoding; for a remote server that reported nothing,
    that it reported nothing."""
    if not s.spec_reported:
        return NO_SPEC_METRICS
    if not s.drafts:
        return ""
    note = f"{s.tokens_per_pass:.2f} tok/pass"
    if acceptance:
        note += f" · {s.mean_accepted:.2f} tok/drafted pass"
        if s.draft_tokens:
            note += f" · acceptance {s.acceptance_rate:.0%}"
    return note


def reply_stats(s: Summary, method: Optional[str] = None) -> dict:
    """A reply's figures as history keeps them (the chat, the REPL and `run` alike): tokens per pass
    over every pass, and per drafted pass (`mean_accepted`) only where a pass drafted."""
    d = {"tokens": s.tokens, "passes": s.passes, "ttft_s": round(s.ttft_s, 4),
         "decode_tok_s": round(s.decode_tok_s, 2), "stop_reason": s.stop_reason}
    if method is not None:
        d["method"] = method
    if s.spec_reported and s.passes:
        d["tokens_per_pass"] = round(s.tokens_per_pass, 3)
    if s.drafts:
        d.update(mean_accepted=round(s.mean_accepted, 3), acceptance_rate=round(s.acceptance_rate, 3))
    if s.spec_source or not s.spec_reported:
        d["spec_metrics"] = s.spec_source or "none reported"
    return d


def stats_line(s: Summary, passes: bool = False, acceptance: bool = True, stop: bool = False) -> str:
    """One reply's figures, written the same wherever they are shown: tokens, TTFT, decode tok/s,
    the target passes (`passes`), speculation, and how the reply stopped (unless it ended on its
    own; always with `stop`)."""
    parts = [f"{s.tokens} tok", f"TTFT {s.ttft_s:.2f}s", f"{s.decode_tok_s:.1f} tok/s"]
    if passes:
        parts.append(f"{s.passes} passes")
    spec = speculation_note(s, acceptance=acceptance)
    if spec:
        parts.append(spec)
    if s.paused_passes:
        parts.append(paused_line(s))
    if stop or s.stop_reason != "eos":
        parts.append(f"stop: {s.stop_reason}")
    return " · ".join(parts)


def speculation_figures(live: LiveStats, remote: bool, positions: int = 8) -> str:
    """The status-bar segment on speculation: tokens per target pass (and this pass's) with the
    acceptance by draft position. A remote server's figures come with the end of the reply."""
    summary = live.summary
    if remote and summary is None:
        return " │ tok/pass: when the reply ends"
    if summary is not None and not summary.spec_reported:
        return f" │ {NO_SPEC_METRICS}"
    text = f" │ {live.mean_per_pass:.2f} tok/pass" + ("" if remote else f" (now {live.current_per_pass})")
    if live.acceptance_by_position:
        text += f" │ by pos {positions_line(live.acceptance_by_position, positions)}"
    if summary is None and live.paused:
        text += f" │ {live.paused}"
    elif summary is not None and summary.paused_passes:
        text += f" │ {paused_line(summary)}"
    return text


def paused_line(s: Summary) -> str:
    """How much of a reply the gate held drafting back, and its last reason (speculative/gate.py)."""
    return f"paused {s.paused_passes} of {s.passes} passes ({s.paused_note})"


# Fewer decoded tokens than this on either side and a speed-up is noise (a 10-token reply read
# x1.80, then x2.80 for the same prompt): it is shown as too short to time instead.
MIN_TIMED_TOKENS = 32


def speedup_line(spec: Summary, ref: Summary) -> Optional[str]:
    """The speculative run's decode speed-up over the reference, once both decoded enough to time."""
    if not (spec.decode_tok_s and ref.decode_tok_s):
        return None
    fewest = min(spec.tokens, ref.tokens) - 1  # decode speed counts the tokens after the first
    if fewest < MIN_TIMED_TOKENS:
        return f"speed-up: too short to time ({fewest} decoded tokens, {MIN_TIMED_TOKENS} needed)"
    return (f"speed-up ×{spec.decode_tok_s / ref.decode_tok_s:.2f} "
            f"(decode tok/s {spec.decode_tok_s:.1f} vs {ref.decode_tok_s:.1f})")


def peak_rss_bytes() -> int:
    """This process's peak resident memory (the weights, caches and everything else it holds)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


def memory_note(reference: Backend) -> Optional[str]:
    """Peak memory and whether a torch reference shared the target's weights (None: not a torch engine)."""
    shares = getattr(reference, "shares_weights", None)
    if shares is None:
        return None
    shared = "the reference shares the target's weights" if shares else "the reference holds weights of its own"
    return f"peak memory {peak_rss_bytes() / 2**30:.2f} GiB · {shared}"
