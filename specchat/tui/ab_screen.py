"""A/B split view: the same conversation, speculative on the left, reference on the right.

By default the two run one after the other so their timings don't contend for the machine
(both panes still stream, in turn); Ctrl+G switches to a race where they run at once. Replies
are aligned by token ids and judged with `specchat.compare`, the module behind `specchat verify`.
"""
from __future__ import annotations

import os
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
from specchat.compare import IDENTICAL, Verdict, mark_and_colour, near_tie_margin
from specchat.context_window import fit_ab_requests
from specchat import suffix_memory
from specchat.live import Failed, Item, LiveStats, memory_note, one_line, pump, speedup_line
from specchat.loading import load_reference, sampling_of
from specchat.profiles import Profile, ProfileError, load_profiles
from specchat.verify import fresh, judge_replies, tie_margin_of, torch_engine_of
from specchat.tui.budget import RenderBudget
from specchat.tui.ab_pane import ABPane
from specchat.tui.widgets import ChatInput

if TYPE_CHECKING:
    from specchat.tui.app import SpecChatApp

FRAME_S = 1 / 30
SEQUENTIAL_NOTE = "sequential: timings don't contend (Ctrl+G: race)"
RACE_NOTE = "race: both run at once, timings contend (Ctrl+G: sequential)"


class ABScreen(Screen):
    app: "SpecChatApp"

    BINDINGS = [
        Binding("escape", "stop_or_close", "Stop / back", priority=True),
        Binding("ctrl+g", "toggle_race", "Race"),
        Binding("ctrl+l", "use_other", "Use other reply"),
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
        self.verdict: Optional[Verdict] = None
        self.using = "reference"
        self.can_choose = False
        self.budget = RenderBudget()
        self.pending_prompt = prompt  # sent before the reference loaded: runs once it has
        self.context_start = 0  # where the conversation's cut lies once the running turn is added

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
        if self.ref_backend is not None and self.ref_backend is not self.app.backend:
            try:
                self.ref_backend.close()
            except Exception:
                pass

    # -------------------------------------------------------------- reference load
    def _load_reference(self) -> None:
        try:
            ref = load_profiles().get(self.reference_name) if self.reference_name else self.spec_profile.target_only()
            backend = load_reference(self.spec_profile, self.spec_backend, ref, self.app.reference_loader)
        except (ProfileError, BackendError) as e:
            self.app.call_from_thread(self._ref_loaded, None, None, str(e))
            return
        except Exception as e:
            self.app.call_from_thread(self._ref_loaded, None, None, one_line(e))
            return
        self.app.call_from_thread(self._ref_loaded, ref, backend, None)

    def _ref_loaded(self, profile: Optional[Profile], backend: Optional[Backend], error: Optional[str]) -> None:
        if error:
            self.app.notify(f"reference failed to load: {error}", severity="error", timeout=12)
            self.query_one("#pane-ref .ab-title", Label).update(f"reference: failed to load: {error}")
            if self.pending_prompt is not None and self.is_mounted:
                self._withdraw_pending("your prompt is back in the input")
            return
        if not self.is_mounted:
            backend.close()
            return
        self.ref_profile, self.ref_backend = profile, backend
        self.query_one("#pane-ref", ABPane).remote = profile.remote
        shared = " · on the target's weights" if getattr(backend, "shares_weights", False) else ""
        self.query_one("#pane-ref .ab-title", Label).update(
            f"reference: {profile.name} ({profile.method_label}, {profile.backend}){shared}")
        if self.pending_prompt is not None:
            prompt, self.pending_prompt = self.pending_prompt, None
            self.start(prompt)
        if self.spec_profile.method == "none" and not self.spec_profile.remote:
            self.app.notify(f"{self.spec_profile.name} is not speculative: both sides decode target-only",
                            severity="warning")

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
        except BackendError as e:
            self.app.notify(str(e), severity="error", timeout=10)
            return False
        if note:
            self.app.notify(note, timeout=8)
        self.prompt = prompt
        sampling = sampling_of(self.spec_profile)  # both sides: same seed, same budget
        self.run_id += 1
        self.cancel = threading.Event()
        self.verdict = None
        self.can_choose = False
        self.panes = {p.side: p for p in self.query(ABPane)}
        memory = suffix_memory.memory_of(self.spec_backend)
        self.panes["spec"].memory_line = f"suffix memory held {suffix_memory.describe(memory)}" if memory else ""
        self.panes["spec"].reset("running")
        self.panes["ref"].reset("running" if self.race else "waiting")
        self.query_one("#ab-verdict", Static).update("")
        self.running = True
        rid, cancel, q = self.run_id, self.cancel, self.events
        spec_b, ref_b = self.spec_backend, self.ref_backend

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
        if spec.summary.text == ref.summary.text:  # the reply the speculative side wrote joins its memory
            suffix_memory.remember(self.spec_backend, conv.id, saved, spec.summary.token_ids)
        self.using = "reference"
        self.query_one("#ab-verdict", Static).update("judging…")
        # judging may run reference forward passes (margins): never on the UI thread
        rid = self.run_id
        self.run_worker(partial(self._judge_thread, rid, ref.summary, spec.summary), thread=True,
                        group="ab-judge", exit_on_error=False)

    def _judge_thread(self, rid: int, ref: Summary, spec: Summary) -> None:
        try:
            v = self.judge(ref, spec)
            offsets = (None, None)
            if v.index is not None:
                offsets = (self._char_offset(self.ref_backend, self.panes["ref"], v),
                           self._char_offset(self.spec_backend, self.panes["spec"], v))
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
        memory = memory_note(self.ref_backend)
        self.query_one("#ab-header", Label).update(
            f"A/B  ·  conversation so far: {len(self.app.conv.messages)} messages" + (f"  ·  {memory}" if memory else ""))
        self.show_verdict()

    def judge(self, ref: Summary, spec: Summary) -> Verdict:
        """Token alignment with `specchat.compare` (as `specchat verify`); text when a side has no ids."""
        spec_req, ref_req, sampling = self.requests
        backend = self.ref_backend
        tie = tie_margin_of(backend) if torch_engine_of(backend) is not None else near_tie_margin(self.ref_profile.dtype)
        return judge_replies(backend, ref_req, ref, spec, sampling, tie, other_backend=self.spec_backend)

    @staticmethod
    def _char_offset(backend: Backend, pane: ABPane, v: Verdict) -> int:
        text = pane.tokens.text
        if v.by == "text":
            return min(v.index, len(text))
        ids = pane.summary.token_ids
        try:
            prefix = backend.detokenize(ids[:v.index])
        except Exception:
            return len(text)
        if text.startswith(prefix):
            return len(prefix)
        # the streamed text may differ in leading whitespace: fall back to the common prefix
        return len(os.path.commonprefix([prefix, text]))

    def show_verdict(self) -> None:
        v = self.verdict
        spec, ref = self.panes["spec"].summary, self.panes["ref"].summary
        mark, colour = mark_and_colour(v)
        items = [(f"{mark} {v.line()}", f"bold {colour}".strip())]
        speedup = speedup_line(spec, ref)
        if speedup:
            items.append(f"  │ {speedup}")
        if self.can_choose:
            items.append(f"\ncontinuing with the {self.using} reply (Ctrl+L: use the "
                         f"{'speculative' if self.using == 'reference' else 'reference'} one) · Esc: back to chat")
        else:
            items.append("\nreply added to the conversation · Esc: back to chat")
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
        self.race = not self.race
        self.query_one("#ab-mode", Label).update(RACE_NOTE if self.race else SEQUENTIAL_NOTE)

    def action_use_other(self) -> None:
        if not self.can_choose:
            self.app.notify("nothing to choose: the replies are identical or none ran yet", severity="warning")
            return
        self.using = "speculative" if self.using == "reference" else "reference"
        pane = self.panes["spec" if self.using == "speculative" else "ref"]
        conv = self.app.conv
        conv.pop_assistant()
        conv.add("assistant", pane.tokens.text,
                 profile=(self.spec_profile if self.using == "speculative" else self.ref_profile).name)
        self.show_verdict()
