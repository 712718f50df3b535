"""The chat: a streamed multi-turn conversation with live speculative-decoding figures."""
from __future__ import annotations

import queue
import threading
from functools import partial
from typing import TYPE_CHECKING, Optional

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Footer, LoadingIndicator

from specchat import suffix_memory
from specchat.backends.base import BackendError, Request, Summary
from specchat.context_window import fit_request
from specchat.live import Failed, Item, LiveStats, format_rate, pump, reply_stats, speculation_figures, stats_line
from specchat.loading import sampling_of
from specchat.model_flag import flagged_engine_line
from specchat.profiles import ProfileError
from specchat.tui.budget import RenderBudget
from specchat.tui.widgets import AssistantMessage, ChatInput, StatusBar, UserMessage, draft_sources, origin_legend

if TYPE_CHECKING:
    from specchat.tui.host import HostApp

FRAME_S = 1 / 30  # the UI drains engine events at this rate, never per token


def summary_note(s: Summary) -> str:
    """The closing note under a finished reply."""
    return stats_line(s, acceptance=False)


class ChatScreen(Screen):
    app: "HostApp"

    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("f2", "app.pick_profile", "Profile"),
        Binding("f3", "ab", "A/B"),
        Binding("f4", "system_prompt", "System"),
        Binding("f5", "app.show_history", "History"),
        Binding("f8", "app.export_current", "Export"),
        Binding("ctrl+t", "toggle_origin", "Token colours"),
        Binding("ctrl+o", "copy_reply", "Copy reply"),
        Binding("ctrl+b", "copy_code", "Copy code"),
    ]

    def __init__(self):
        super().__init__(id="chat")
        self.events: "queue.Queue[Item]" = queue.Queue()
        self.cancel: Optional[threading.Event] = None
        self.live: Optional[LiveStats] = None
        self.reply: Optional[AssistantMessage] = None
        self.generation = 0
        self.generating = False
        self._shown_version = -1
        self.budget = RenderBudget()
        # a prompt sent while a profile loads: kept (shown as waiting) and sent once the engine is ready
        self.waiting: Optional[str] = None
        self._waiting_message: Optional[UserMessage] = None

    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="conversation")
        yield StatusBar(id="status")
        yield ChatInput(id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self._timer = self.set_interval(FRAME_S, self._drain, pause=True)
        self.query_one("#prompt").focus()
        self.refresh_status()

    async def on_screen_resume(self) -> None:
        if self._shown_version != self.app.conv.version and not self.generating:
            await self.rebuild()
        self.refresh_status()

    # ----------------------------------------------------------------- conversation view
    async def rebuild(self) -> None:
        box = self.query_one("#conversation", VerticalScroll)
        await box.remove_children()
        widgets = []
        for m in self.app.conv.messages:
            if m["role"] == "user":
                widgets.append(UserMessage(m["content"]))
            else:
                widgets.append(AssistantMessage(m["content"], show_origin=self.app.show_origin))
        if self.waiting is not None:  # a prompt still waits for the load: it stays in view
            self._waiting_message = UserMessage(self.waiting, self._waiting_line())
            widgets.append(self._waiting_message)
        if widgets:
            await box.mount_all(widgets)
        box.scroll_end(animate=False)
        self._shown_version = self.app.conv.version

    # ------------------------------------------------------------------------ status
    def refresh_status(self) -> None:
        app = self.app
        if not self.query(StatusBar):
            return  # not composed yet
        # the spinner exists only while a model loads: hidden, it would still tick 16 times a second
        spinner = self.query("#loading")
        if app.loading and not spinner:
            self.mount(LoadingIndicator(id="loading"), before=self.query_one(StatusBar))
        elif not app.loading and spinner:
            spinner.remove()
        parts: list = []
        if app.loading:
            parts.append(f"loading {app.loading}… ")
        if app.profile is None:
            parts.append("a prompt sent now waits for it" if app.loading_profile else
                          "no model loaded: F2 picks a profile")
            self.query_one(StatusBar).show(Content.assemble(*parts))
            return
        p = app.profile
        engine = flagged_engine_line(p)  # -m's file: which engine runs it and why, in place of backend · method
        parts += [(p.name, "bold"), f" · {engine}" if engine else f" · {p.backend} · {p.method_label}"]
        parts += [(f" · {app.constraint_label()}", "bold #ffaf00")] if app.constraint_label() else []
        if app.background_line:
            parts.append(f" · {app.background_line}")
        per_pass = None
        live = self.live
        if live is not None:
            ttft = live.ttft_s
            parts.append(f" │ TTFT {ttft:.2f}s" if ttft is not None else " │ TTFT –")
            parts.append(f" │ {format_rate(live.tok_s)} tok/s")
            if live.speculative or p.method != "none" or p.remote:
                parts.append(speculation_figures(live, p.remote))
                per_pass = None if p.remote else live.per_pass
        memory = suffix_memory.memory_of(app.backend)
        if memory is not None:
            parts.append(f" │ suffix memory {suffix_memory.describe(memory)}")
        if app.show_origin:
            parts += [" │ ", *origin_legend(draft_sources(p), live.accepted_by_source if live else None)]
        self.query_one(StatusBar).show(Content.assemble(*parts), per_pass)

    # -------------------------------------------------------------------- generation
    @on(ChatInput.Submitted, "#prompt")
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        if self.app.constraint_command(event.value):  # /schema FILE|off and its kin: for the next replies
            event.input.clear()
            return
        if self.generating:
            self.app.notify("a reply is still streaming: Esc stops it", severity="warning")
            return
        text = event.value.strip("\n")
        if self.app.loading_profile:
            await self._keep_waiting(event.input, text)
            return
        if self.app.backend is None:
            self.app.notify("no model loaded: F2 picks a profile", severity="warning")
            return
        if not await self.send(text):
            return
        event.input.clear()

    async def send(self, text: str) -> bool:
        """Add the user's turn and start its reply; False (the turn taken back) when it cannot fit."""
        self.app.conv.add("user", text)
        request = self._fit()
        if request is None:  # refused: the turn does not stay, its text stays in the input
            self.app.conv.pop_user()
            return False
        await self.query_one("#conversation").mount(UserMessage(text))
        await self.start_reply(request)
        return True

    # ------------------------------------------------------- a prompt waiting for a load
    def _waiting_line(self) -> str:
        return f"waiting for {self.app.loading_profile} to load… (Esc withdraws it)"

    async def _keep_waiting(self, prompt: ChatInput, text: str) -> None:
        if self.waiting is not None:
            self.app.notify("a prompt already waits for the load: Esc withdraws it", severity="warning")
            return
        self.waiting = text
        prompt.clear()
        self._waiting_message = UserMessage(text, self._waiting_line())
        box = self.query_one("#conversation", VerticalScroll)
        await box.mount(self._waiting_message)
        box.scroll_end(animate=False)

    async def take_waiting(self) -> Optional[str]:
        """The waiting prompt, out of the view (it is sent elsewhere or given back)."""
        text, self.waiting = self.waiting, None
        message, self._waiting_message = self._waiting_message, None
        if message is not None and message.is_attached:
            await message.remove()
        return text

    async def give_back_waiting(self, why: str) -> None:
        """The waiting prompt back into the input, ahead of anything typed since: nothing is lost."""
        text = await self.take_waiting()
        if text is not None:
            self.query_one("#prompt", ChatInput).put_back(text)
            self.app.notify(why, timeout=6)

    async def send_waiting(self) -> None:
        """The engine is ready: the waiting prompt goes now (back to the input if it cannot fit)."""
        text = await self.take_waiting()
        if text is not None and not await self.send(text):  # _fit said why
            self.query_one("#prompt", ChatInput).put_back(text)

    def _fit(self) -> Optional[Request]:
        """The request for the next reply, the oldest turns left out if it would not fit (said in a
        notification); None, with the reason shown, when it cannot be made to fit."""
        app = self.app
        try:
            request, note = fit_request(app.backend, app.profile, app.conv)
            request.constraint = app.constraints.current(app.profile)
        except (BackendError, ProfileError) as e:  # a profile's: its constraint file went bad
            app.notify(str(e), severity="error", timeout=10)
            return None
        if note:
            app.notify(note, timeout=8)
        return request

    async def start_reply(self, request: Request) -> None:
        app = self.app
        profile, backend = app.profile, app.backend
        self.generation += 1
        self.cancel = threading.Event()
        self.live = LiveStats()
        self.reply = AssistantMessage(show_origin=app.show_origin)
        await self.query_one("#conversation").mount(self.reply)
        self.query_one("#conversation").scroll_end(animate=False)
        self.generating = True
        self._reply_profile = profile.name
        self._reply_method = profile.method_label
        self._reply_backend = backend  # whose suffix memory learns the reply
        self.run_worker(partial(pump, backend, request, sampling_of(profile), self.cancel, self.events,
                                self.generation, app.between_replies),
                        thread=True, group="generate", exit_on_error=False, name="generate")
        self.budget.reset()
        self._timer.resume()
        self.refresh_status()

    async def _drain(self) -> None:
        """Take everything the engine produced since the last tick; redraw when the budget allows."""
        end = None
        reply = self.reply
        while True:
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                break
            if item.tag != self.generation:
                continue  # a stale stream
            ev = item.event
            if isinstance(ev, (Summary, Failed)):
                end = ev
                break
            self.live.add(ev, item.at)
            if ev.text and reply is not None:
                reply.record(ev.text, item.draft_chars, ev.source)
        if end is None and not self.budget.due():
            return
        if reply is not None:
            box = self.query_one("#conversation", VerticalScroll)
            follow = box.max_scroll_y - box.scroll_y <= 3  # the user has not scrolled up
            await reply.flush()
            if follow:
                box.scroll_end(animate=False)
        if end is not None:
            await self._finish(end)
        self.refresh_status()
        self.budget.drew()

    async def _finish(self, end) -> None:
        self._timer.pause()
        try:
            await self._complete(end)
        finally:
            self.reply = None
            self.generating = False  # only now: new chat / regenerate must not race the final render

    async def _complete(self, end) -> None:
        reply = self.reply
        app = self.app
        if isinstance(end, Failed):
            app.notify(end.message, severity="error", timeout=10)
            if reply is not None and not reply.text:  # nothing came: the turn does not stay
                await reply.remove()
                await self._withdraw_turn()
                return
            app.conv.add("assistant", reply.text, profile=self._reply_profile, stats={"error": end.message})
            self._shown_version = app.conv.version
            await reply.finish(note="stopped by an error")
            return
        self.live.finish(end)
        app.last_summary = end
        text = end.text or reply.text
        if text:  # saved before the final render: a crash now loses nothing
            saved = app.conv.add("assistant", text, profile=self._reply_profile, stats=reply_stats(end, self._reply_method))
            suffix_memory.remember(self._reply_backend, app.conv.id, saved, end.token_ids)
            self._shown_version = app.conv.version
            await reply.finish(text, note=summary_note(end))
        else:
            await reply.remove()

    async def _withdraw_turn(self) -> None:
        """Take back a user turn that got no reply, its text into the input to send again."""
        text = self.app.conv.pop_user()
        if text is None:
            return
        users = self.query(UserMessage)
        if users:
            await users.last().remove()
        self._shown_version = self.app.conv.version
        self.query_one("#prompt", ChatInput).put_back(text)

    # ----------------------------------------------------------------------- actions
    async def action_stop(self) -> None:
        if self.generating and self.cancel is not None:
            self.cancel.set()
            self.app.notify("stopping: the reply so far is kept", timeout=2)
        elif self.waiting is not None:
            await self.give_back_waiting("withdrawn: the prompt is back in the input")

    async def action_regenerate(self) -> None:
        if self.generating or self.app.backend is None or self.app.loading_profile:
            return
        conv = self.app.conv
        if not conv.messages:
            return
        if conv.messages[-1]["role"] == "assistant":
            suffix_memory.forget(self.app.backend, conv.id, conv.ids[-1])  # replaced: not drafted from again
            conv.pop_assistant()
            replies = self.query(AssistantMessage)
            if replies:
                await replies.last().remove()
        request = self._fit()
        if request is not None:
            await self.start_reply(request)

    async def action_new_chat(self) -> None:
        if self.generating:
            await self.action_stop()
            return
        self.app.conv.reset()
        self.live = None
        await self.rebuild()
        self.refresh_status()

    def action_system_prompt(self) -> None:
        from specchat.tui.widgets import SystemPromptModal

        conv = self.app.conv
        current = conv.system if conv.system is not None else (self.app.profile.system if self.app.profile else "")

        def done(text: Optional[str]) -> None:
            if text is not None:
                conv.set_system(text.strip())
                self.app.notify("system prompt set" if text.strip() else "system prompt cleared")
        self.app.push_screen(SystemPromptModal(current or ""), done)

    async def action_toggle_origin(self) -> None:
        app = self.app
        app.show_origin = not app.show_origin
        for w in self.query(AssistantMessage):
            await w.set_origin_mode(app.show_origin)
        self.refresh_status()

    def action_copy_reply(self) -> None:
        text = self.reply.text if self.reply is not None and self.reply.text else self.app.conv.last_reply
        if not text:
            self.app.notify("no reply to copy yet", severity="warning")
            return
        self.app.copy_to_clipboard(text)
        self.app.notify(f"copied the reply ({len(text)} characters)")

    def action_copy_code(self) -> None:
        code = self.app.conv.last_code()
        if code is None:
            self.app.notify("no code block in the replies", severity="warning")
            return
        self.app.copy_to_clipboard(code)
        self.app.notify(f"copied the last code block ({len(code.splitlines())} lines)")

    def action_ab(self) -> None:
        if self.generating:
            self.app.notify("a reply is still streaming: Esc stops it", severity="warning")
            return
        self.app.open_ab()
