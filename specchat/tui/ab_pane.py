"""One side of the A/B view: the reply as it streams, with its live figures."""
from __future__ import annotations

import os
from typing import Optional

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.widgets import Label, Sparkline, Static

from specchat.backends.base import Summary
from specchat.live import LiveStats, format_rate, speculation_figures
from specchat.tui.widgets import TokenText


class ABPane(Vertical):
    def __init__(self, side: str, title: str):
        super().__init__(id=f"pane-{side}", classes="ab-pane")
        self.side = side
        self.title_text = title
        self.tokens = TokenText()
        self.live: Optional[LiveStats] = None
        self.summary: Optional[Summary] = None
        self.failed: Optional[str] = None
        self.diverge_at: Optional[int] = None
        self.state = "idle"
        self.remote = False  # its profile runs on a server: speculative figures arrive with the summary
        self.memory_line = ""  # how warm its suffix memory was when this reply started ("" without one)

    def compose(self) -> ComposeResult:
        yield Label(self.title_text, classes="ab-title", markup=False)
        with VerticalScroll(classes="ab-body"):
            yield Static("", classes="ab-text", markup=False)
        yield Static("", classes="ab-stats", markup=False)
        if self.side == "spec":
            yield Sparkline([], classes="ab-spark")

    def reset(self, state: str) -> None:
        self.tokens = TokenText()
        self.live = LiveStats()
        self.summary = self.failed = self.diverge_at = None
        self.state = state
        self.render_text()
        self.render_stats()

    def render_text(self) -> None:
        body = self.query_one(".ab-body", VerticalScroll)
        follow = body.max_scroll_y - body.scroll_y <= 2
        self.query_one(".ab-text", Static).update(
            self.tokens.content(origin=self.side == "spec", diverge_at=self.diverge_at))
        if follow:
            body.scroll_end(animate=False)

    def char_offset(self, backend, index: int, by: str) -> int:
        """Where token (or character) `index` of this pane's reply starts in its streamed text."""
        text = self.tokens.text
        if by == "text":
            return min(index, len(text))
        try:
            prefix = backend.detokenize(self.summary.token_ids[:index])
        except Exception:
            return len(text)
        if text.startswith(prefix):
            return len(prefix)
        # the streamed text may differ in leading whitespace: fall back to the common prefix
        return len(os.path.commonprefix([prefix, text]))

    def render_stats(self) -> None:
        live = self.live
        if self.failed:
            self.query_one(".ab-stats", Static).update(Content.assemble(("failed: ", "bold red"), self.failed))
            return
        if live is None:
            self.query_one(".ab-stats", Static).update(self.state)
            return
        ttft = live.ttft_s
        passes = self.summary.passes if self.summary else live.passes
        parts = [f"{self.state} │ TTFT {ttft:.2f}s" if ttft is not None else f"{self.state} │ TTFT –",
                 f" │ {format_rate(live.tok_s)} tok/s │ {passes} passes"]
        if self.side == "spec" or self.remote:
            parts.append(speculation_figures(live, self.remote, 5))
        if self.memory_line:
            parts.append(f" │ {self.memory_line}")
        self.query_one(".ab-stats", Static).update(Content.assemble(*parts))
        if self.side == "spec" and not self.remote:
            self.query_one(".ab-spark", Sparkline).data = live.per_pass[-60:]
