"""A/B split view: the same conversation, speculative on the left, reference on the right.

By default the two run one after the other so their timings don't contend for the machine
(both panes still stream, in turn); Ctrl+G switches to a race where they run at once. Replies
are aligned by token ids and judged with `specchat.compare`, the module behind `specchat verify`;
a reference on another engine is judged as `verify` judges one, and Ctrl+F (or `specchat ab -p P
-r P` with a target-only P) shows the target's own floor (ab_sides.py).
"""
from __future__ import annotations

import queue
import threading
import time
from functools import partial
from typing import TYPE_CHECKING, Optional

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Footer, Label, Static

from specchat.backends.base import Backend, BackendError, Summary
from specchat.compare import IDENTICAL, Verdict
from specchat.context_window import fit_ab_requests
from specchat import suffix_memory
from specchat.live import Failed, Item, LiveStats, memory_note, one_line, pump
from specchat.loading import sampling_of
from specchat.profiles import Profile, ProfileError, load_profiles
from specchat.session_constraint import replies_line
from specchat.verify import fresh
from specchat.tui.budget import RenderBudget
from specchat.tui.ab_pane import ABPane
from specchat.tui.ab_sides import Sides, where_replies_part
from specchat.tui.widgets import ChatInput

if TYPE_CHECKING:
    from specchat.tui.host import HostApp

FRAME_S = 1 / 30
SEQUENTIAL_NOTE = "sequential: timings don't contend (Ctrl+G: race)"
RACE_NOTE = "race: both run at once, timings contend (Ctrl+G: sequential)"


class ABScreen(Screen):
    app: "HostApp"

    BINDINGS = [
        Binding("escape", "stop_or_close", "Stop / back", priority=True),
        Binding("ctrl+g", "toggle_race", "Race"),
        Binding("ctrl+l", "use_other", "Use other reply"),
        Binding("ctrl+f", "toggle_floor", "Floor"),
    ]

    def __init__(self, reference: Optional[str] = None, prompt: Optional[str] = None):
        super().__init__(id="ab")
        self.reference_name = reference
        self.events: "queue.Queue[Item]" = queue.Queue()
        self.race = False
        self.running = False
        self.run_id = 0
        self.cancel: Optional[threading.Event] = None
        self.spec_profile: Profile = None  # type: ignore[assignment]
        self.ref_profile: Optional[Profile] = None
        self.spec_backend: Optional[Backend] = None
        self.ref_backend: Optional[Backend] = None
        self.sides: Optional[Sides] = None  # what each side runs, once the reference loaded
        self.run_floor = False  # whether the run on screen was the floor
        self.verdict: Optional[Verdict] = None
        self.using = "reference"
        self.can_choose = False
        self.budget = RenderBudget()
        self.left_backend: Optional[Backend] = None  # what the left pane's run on screen ran on
        self.pending_prompt = prompt  # sent before the reference loaded: runs once it has
        self.context_start = 0  # where the conversation's cut lies once the running turn is added
        self.constraint_line: Optional[str] = None  # whether the run's replies keep their constraint

    def compose(self) -> ComposeResult:
        self.spec_profile = self.app.profile
        self.spec_backend = self.app.backend
        spec = self.spec_profile
        yield Label(f"A/B  ·  conversation so far: {len(self.app.conv.messages)} messages", id="ab-header")
        with Horizontal(id="ab-panes"):
            spec_pane = ABPane("spec", f"speculative: {spec.name} ({spec.method_label})")
            spec_pane.remote = spec.remote
            yield spec_pane
            yield ABPane("ref", f"reference: {self.reference_name or spec.name + ':target-only'} (loading…)")
        yield Static("", id="ab-verdict", markup=False)
        yield Label(SEQUENTIAL_NOTE, id="ab-mode")
        yield ChatInput(id="ab-prompt")
        yield Footer()

    def on_mount(self) -> None:
        self._timer = self.set_interval(FRAME_S, self._drain, pause=True)
        self.query_one("#ab-prompt").focus()
        self._show_pending()
        self.run_worker(self._load_reference, thread=True, group="ab-load", exit_on_error=False)

    def _show_pending(self) -> None:
        shown = " ".join((self.pending_prompt or "").split())
        shown = shown if len(shown) <= 60 else shown[:59] + "…"
        line = "" if self.pending_prompt is None else (
            f"waiting for the reference to load: “{shown}” runs as soon as it is ready · Esc withdraws it")
        self.query_one("#ab-verdict", Static).update(line)

    def _withdraw_pending(self, why: str) -> None:
        """The waiting prompt back into the input, ahead of anything typed since."""
        text, self.pending_prompt = self.pending_prompt, None
        self._show_pending()
        self.query_one("#ab-prompt", ChatInput).put_back(text)
        self.app.notify(why, timeout=6)

    def on_unmount(self) -> None:
        if self.cancel is not None:
            self.cancel.set()
        if self.sides is not None:
            self.sides.close(keep=self.app.backend)

    # -------------------------------------------------------------- reference load
    def _load_reference(self) -> None:
        try:
            ref = load_profiles().get(self.reference_name) if self.reference_name else self.spec_profile.target_only()
            sides = Sides.load(self.spec_profile, self.spec_backend, ref, self.app.reference_loader)
        except (ProfileError, BackendError) as e:
            self.app.call_from_thread(self._ref_loaded, None, str(e))
            return
        except Exception as e:
            self.app.call_from_thread(self._ref_loaded, None, one_line(e))
            return
        self.app.call_from_thread(self._ref_loaded, sides, None)

    def _ref_loaded(self, sides: Optional[Sides], error: Optional[str]) -> None:
        if error:
            self.app.notify(f"reference failed to load: {error}", severity="error", timeout=12)
            self.query_one("#pane-ref .ab-title", Label).update(f"reference: failed to load: {error}")
            if self.pending_prompt is not None and self.is_mounted:
                self._withdraw_pending("your prompt is back in the input")
            return
        if not self.is_mounted:
            sides.close(keep=self.app.backend)
            return
        self.sides = sides
        self.ref_profile, self.ref_backend = sides.ref_profile, sides.ref_backend
        self.query_one("#pane-ref", ABPane).remote = sides.ref_profile.remote
        self.query_one("#pane-ref .ab-title", Label).update(sides.ref_title())
        self._show_mode()
        self._show_header()
        if self.pending_prompt is not None:
            prompt, self.pending_prompt = self.pending_prompt, None
            self.start(prompt)
        for warning in sides.warnings():
            self.app.notify(warning, severity="warning", timeout=12)

    def _show_mode(self) -> None:
        floor = self.sides is not None and self.sides.floor
        note = self.sides.floor_note() if floor else RACE_NOTE if self.race else SEQUENTIAL_NOTE
        self.query_one("#ab-mode", Label).update(note)
        if self.sides is not None:
            self.query_one("#pane-spec .ab-title", Label).update(self.sides.left_title())

    def _show_header(self) -> None:
        parts = [f"A/B  ·  conversation so far: {len(self.app.conv.messages)} messages"]
        note = self.sides.header_note() if self.sides is not None else None
        memory = memory_note(self.ref_backend) if self.ref_backend is not None else None
        notes = [n for n in (self.app.constraint_label(), note, memory) if n]  # the constraint: both sides keep it
        self.query_one("#ab-header", Label).update("  ·  ".join(parts + notes))

    @property
    def ready(self) -> bool:
        return self.ref_backend is not None and self.spec_backend is not None

    # ------------------------------------------------------------------------ run
    @on(ChatInput.Submitted, "#ab-prompt")
    def _submitted(self, event: ChatInput.Submitted) -> None:
        if self.running:
            self.app.notify("still running: Esc stops both", severity="warning")
            return
        if not self.ready:
            if self.pending_prompt is not None:
                self.app.notify("a prompt already waits for the reference: Esc withdraws it", severity="warning")
                return
            event.input.clear()
            self.pending_prompt = event.value.strip("\n")
            self._show_pending()
            return
        if self.start(event.value.strip("\n")):
            event.input.clear()

    def start(self, prompt: str) -> bool:
        try:  # the oldest turns left out if the turn would not fit (the cut is the conversation's once it is added)
            spec_req, ref_req, self.context_start, note = fit_ab_requests(
                self.spec_backend, self.ref_backend, self.spec_profile, self.ref_profile, self.app.conv, prompt)
            spec_req.constraint = ref_req.constraint = self.app.constraints.current(self.spec_profile)  # both sides
        except (BackendError, ProfileError) as e:  # a profile's: its constraint file went bad
            self.app.notify(str(e), severity="error", timeout=10)
            return False
        if note:
            self.app.notify(note, timeout=8)
        left_b = self.left_backend = self.sides.left_backend
        if left_b is self.ref_backend:  # the floor by Ctrl+F: the reference's own request again
            spec_req = ref_req
        self.run_floor = self.sides.floor
        self.prompt = prompt
        sampling = sampling_of(self.spec_profile)  # both sides: same seed, same budget
        self.run_id += 1
        self.cancel = threading.Event()
        self.verdict = None
        self.can_choose = False
        self.panes = {p.side: p for p in self.query(ABPane)}
        memory = suffix_memory.memory_of(left_b)
        self.panes["spec"].memory_line = f"suffix memory held {suffix_memory.describe(memory)}" if memory else ""
        self.panes["spec"].reset("running")
        self.panes["ref"].reset("running" if self.race else "waiting")
        self.query_one("#ab-verdict", Static).update("")
        self.running = True
        rid, cancel, q = self.run_id, self.cancel, self.events
        spec_b, ref_b = left_b, self.ref_backend

        def spec():
            pump(fresh(spec_b), spec_req, sampling, cancel, q, (rid, "spec"), self.app.between_replies)

        def ref():
            pump(fresh(ref_b), ref_req, sampling, cancel, q, (rid, "ref"), self.app.between_replies)
        self.requests = (spec_req, ref_req, sampling)
        if self.race:
            self.run_worker(spec, thread=True, group="ab", exit_on_error=False)
            self.run_worker(ref, thread=True, group="ab", exit_on_error=False)
        else:
            def sequential():
                spec()
                if not cancel.is_set():
                    q.put(Item((rid, "ref-start"), None, time.perf_counter()))
                    ref()
                else:
                    ref_cancelled = Failed("not run: stopped")
                    q.put(Item((rid, "ref"), ref_cancelled, 0.0))
            self.run_worker(sequential, thread=True, group="ab", exit_on_error=False)
        self._timer_active = True
        self._touched: set = set()
        self.budget.reset()
        self._timer.resume()

    async def _drain(self) -> None:
        touched, ended = set(), False
        while True:
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                break
            rid, side = item.tag
            if rid != self.run_id:
                continue
            if side == "ref-start":
                pane = self.panes["ref"]
                pane.live = LiveStats(started=item.at)
                pane.state = "running"
                touched.add("ref")
                continue
            pane = self.panes[side]
            ev = item.event
            touched.add(side)
            if isinstance(ev, Summary):
                pane.summary = ev
                pane.live.finish(ev)
                pane.state = "stopped" if ev.stop_reason == "cancelled" else "done"
                if ev.text and ev.text != pane.tokens.text and ev.text.startswith(pane.tokens.text):
                    pane.tokens.add(ev.text[len(pane.tokens.text):])
                ended = True
            elif isinstance(ev, Failed):
                pane.failed = ev.message
                pane.state = "failed"
                ended = True
            else:
                pane.live.add(ev, item.at)
                if ev.text:
                    pane.tokens.add(ev.text, item.draft_chars, ev.source)
        self._touched |= touched
        if not ended and not self.budget.due():
            return
        for side in self._touched:
            self.panes[side].render_text()
            self.panes[side].render_stats()
        self._touched = set()
        self.budget.drew()
        if self.running and self._timer_active and all(p.state in ("done", "stopped", "failed")
                                                       for p in self.panes.values()):
            self._timer_active = False
            self._finish()

    def _finish(self) -> None:
        self._timer.pause()
        spec, ref = self.panes["spec"], self.panes["ref"]
        if spec.summary is None or ref.summary is None:
            self.running = False
            msg = spec.failed or ref.failed or "stopped"
            self.query_one("#ab-verdict", Static).update(f"no verdict: {msg}")
            return
        # continue the conversation with the reference reply (identical: either one)
        conv = self.app.conv
        conv.add("user", self.prompt)
        conv.context_start = self.context_start
        saved = conv.add("assistant", ref.tokens.text, profile=self.ref_profile.name)
        if spec.summary.text == ref.summary.text and not self.run_floor:  # the speculative side's: its memory
            suffix_memory.remember(self.spec_backend, conv.id, saved, spec.summary.token_ids)
        self.using = "reference"
        self.query_one("#ab-verdict", Static).update(self.sides.judging_line(self.run_floor))
        # judging may run reference forward passes (margins): never on the UI thread
        rid = self.run_id
        self.run_worker(partial(self._judge_thread, rid, ref.summary, spec.summary), thread=True,
                        group="ab-judge", exit_on_error=False)

    def _judge_thread(self, rid: int, ref: Summary, spec: Summary) -> None:
        try:
            v = self.judge(ref, spec)
            self.constraint_line = replies_line(self.requests[0].constraint, spec, ref)
            offsets = (None, None)
            if v.kind != IDENTICAL:  # both panes highlighted from where the replies on screen part
                where = where_replies_part(ref, spec)
                offsets = (self.panes["ref"].char_offset(self.ref_backend, *where),
                           self.panes["spec"].char_offset(self.left_backend, *where))
        except Exception as e:
            self.app.call_from_thread(self._judged, rid, None, (None, None), one_line(e))
            return
        self.app.call_from_thread(self._judged, rid, v, offsets, None)

    def _judged(self, rid: int, v: Optional[Verdict], offsets, error: Optional[str]) -> None:
        if rid != self.run_id or not self.is_attached:
            return
        self.running = False  # the backends are free again only now
        if v is None:
            self.query_one("#ab-verdict", Static).update(f"no verdict: {error}")
            return
        self.verdict = v
        ref, spec = self.panes["ref"], self.panes["spec"]
        ref.diverge_at, spec.diverge_at = offsets
        ref.render_text()
        spec.render_text()
        self.can_choose = v.kind != IDENTICAL
        self._show_header()
        self.show_verdict()

    def judge(self, ref: Summary, spec: Summary) -> Verdict:
        """The run on screen judged (Sides.judge): may run the speculative profile's own target-only."""
        return self.sides.judge(ref, spec, self.requests, self.run_floor, self.cancel, self.app.between_replies)

    def show_verdict(self) -> None:
        spec, ref = self.panes["spec"].summary, self.panes["ref"].summary
        items = self.sides.verdict_items(self.verdict, spec, ref, self.run_floor, self.constraint_line,
                                         self.using if self.can_choose else None)
        self.query_one("#ab-verdict", Static).update(Content.assemble(*items))

    # ------------------------------------------------------------------------ keys
    def action_stop_or_close(self) -> None:
        if self.running:
            self.cancel.set()
            self.app.notify("stopping both sides", timeout=2)
        elif self.pending_prompt is not None:
            self._withdraw_pending("withdrawn: the prompt is back in the input")
        else:
            self.app.pop_screen()

    def action_toggle_race(self) -> None:
        if self.sides is not None and self.sides.floor:
            self.app.notify("the floor runs one after the other: its two runs must not contend", severity="warning")
            return
        self.race = not self.race
        self._show_mode()

    def action_toggle_floor(self) -> None:
        """The left pane runs the reference again (a fresh cache) instead of the speculative profile, or
        back: the target's own run-to-run floor, seen before a drafter is judged against it."""
        if self.sides is None or self.running:
            self.app.notify("the reference is still loading" if self.sides is None else "still running: Esc stops both",
                            severity="warning")
            return
        said, switched = self.sides.toggle_floor()
        if switched and self.sides.floor:
            self.race = False  # its two runs share one engine
        self._show_mode()
        self._show_header()
        self.app.notify(said, severity="information" if switched else "warning", timeout=4)

    def action_use_other(self) -> None:
        if not self.can_choose:
            self.app.notify("nothing to choose: the replies are identical or none ran yet", severity="warning")
            return
        self.using = "speculative" if self.using == "reference" else "reference"
        pane = self.panes["spec" if self.using == "speculative" else "ref"]
        conv = self.app.conv
        conv.pop_assistant()
        left = self.ref_profile if self.run_floor else self.spec_profile
        conv.add("assistant", pane.tokens.text, profile=(left if self.using == "speculative" else self.ref_profile).name)
        self.show_verdict()
