"""The specchat TUI: chat, profile switching, A/B split view and history."""
from __future__ import annotations

import datetime
import sys
import threading
from functools import partial
from typing import Callable, Iterable, Optional

from textual.app import App, SystemCommand
from textual.screen import Screen

from specchat.backends.base import Backend, BackendError, Constraint, Summary
from specchat import availability, loading
from specchat.availability import Availability
from specchat.conversation import Conversation
from specchat.history import History, HistoryError
from specchat.live import one_line
from specchat.constraints import ConstraintError
from specchat.profiles import Profile, ProfileError, ProfileSet, load_profiles
from specchat.session_constraint import COMMANDS as CONSTRAINT_COMMANDS, SessionConstraint, label
from specchat.tui.chat_screen import ChatScreen
from specchat.tui.profile_choice import ProfileCommands, availability_of, picker_rows, profile_line

BackendLoader = Callable[[Profile], Backend]
ENGINE_SWITCH_INTERVAL_S = 0.0005


# how often the chat looks at a background preparation (a file check; the status bar shows it)
BACKGROUND_POLL_S = 2.0


class SpecChatApp(App):
    """The screens see it only as a ChatHost (host.py): they never import this module."""

    CSS_PATH = "app.tcss"
    TITLE = "specchat"
    COMMANDS = App.COMMANDS | {ProfileCommands}

    def __init__(self, profile_name: str, *, loader: Optional[BackendLoader] = None,
                 history: History | None | bool = True, ab_reference: Optional[str] = None,
                 start_ab: bool = False, constraint: Optional[Constraint] = None):
        super().__init__()
        self.constraints = SessionConstraint(constraint)  # a flag's or /schema's, else the profile's
        self.initial_profile = profile_name
        self.loader: BackendLoader = loader or (lambda p: loading.load_backend(p, progress=self._news,
                                                                               background=True))
        # a reference of its own never prepares in the background: only the chat's backend switches
        self.reference_loader: BackendLoader = loader or (lambda p: loading.load_backend(p, progress=self._news))
        self.profile: Optional[Profile] = None
        self.backend: Optional[Backend] = None
        self.loading: Optional[str] = None
        self.loading_profile: Optional[str] = None  # the profile whose load a sent prompt waits for
        # held while the backend moves to what it prepared in the background; replies start once it is free
        self.between_replies = threading.Lock()
        self.background_line: Optional[str] = None  # the backend's background_status, as last shown
        self._told_failure: Optional[str] = None  # the status line whose failure was already said
        self.show_origin = False
        self.last_summary: Optional[Summary] = None
        self.start_ab = start_ab
        self.ab_reference = ab_reference
        self._history_error: Optional[str] = None
        if history is True:
            try:
                history = History()
            except HistoryError as e:
                history, self._history_error = None, str(e)
        self.history: Optional[History] = history or None
        self.conv = Conversation(self.history, profile_name, on_error=self._history_failed)

    # ------------------------------------------------------------------ lifecycle
    def on_mount(self) -> None:
        # The engine thread needs the GIL briefly between native passes; with Python's default
        # 5 ms switch interval a busy render can hold it that long every pass. A short interval
        # hands it over within ~0.5 ms (measured by scripts/tui_throughput.py).
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
        self.push_screen(ChatScreen())
        if self._history_error:
            self.notify(self._history_error, severity="warning", timeout=10)
        self.switch_profile(self.initial_profile, then_ab=self.start_ab)
        self.set_interval(BACKGROUND_POLL_S, self._background_tick)

    def on_unmount(self) -> None:
        sys.setswitchinterval(self._switch_interval)
        if self.backend is not None:
            try:
                self.backend.close()
            except Exception:
                pass

    def _history_failed(self, msg: str) -> None:
        self.notify(msg, severity="warning", timeout=10)

    @property
    def chat(self) -> ChatScreen:
        return next(s for s in self.screen_stack if isinstance(s, ChatScreen))

    def _news(self, line: str) -> None:
        """A long first-time step of a load (building llama-server), from the loading thread."""
        self.call_from_thread(self.notify, line, timeout=8)

    def _refresh_status(self) -> None:
        for s in self.screen_stack:
            if hasattr(s, "refresh_status"):
                s.refresh_status()

    # ------------------------------------------------- preparation in the background
    @property
    def busy(self) -> bool:
        """Whether a reply (chat or A/B) is running or a profile is loading."""
        return bool(self.loading) or self.chat.generating or any(getattr(s, "running", False)
                                                                 for s in self.screen_stack)

    def _background_tick(self) -> None:
        """Show how the backend's background preparation stands; once it is ready (or has failed),
        let the backend switch while no reply runs. A reply asked for meanwhile waits for it."""
        backend = self.backend
        line = backend.background_status() if backend is not None else None
        if line != self.background_line:
            self.background_line = line
            self._refresh_status()
        if line is None or "compiling" in line or self.busy or line == self._told_failure:
            return
        if not self.between_replies.acquire(blocking=False):
            return
        self.loading = "compiled decode graphs" if "ready" in line else None
        self._refresh_status()
        self.run_worker(partial(self._switch_thread, backend, line), thread=True, group="switch",
                        exit_on_error=False, name="switch to prepared passes")

    def _switch_thread(self, backend: Backend, line: str) -> None:
        try:
            said = backend.switch_if_ready()
        except Exception as e:  # the backend stays as it was: say so, never take the app down
            said = f"could not switch to compiled decode graphs: {one_line(e)}"
        finally:
            self.between_replies.release()
        self.call_from_thread(self._switched, backend, line, said)

    def _switched(self, backend: Backend, line: str, said: Optional[str]) -> None:
        if "ready" in line:
            self.loading = None
        if "unavailable" in (said or line):
            self._told_failure = backend.background_status()
        if said:
            self.notify(said, severity="warning" if "unavailable" in said or "could not" in said else "information",
                        timeout=12)
        self._background_tick()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Switch profile", "Pick a profile (F2)", self.action_pick_profile)
        yield SystemCommand("A/B split view", "Speculative vs target-only, side by side (F3)", self.open_ab)
        yield SystemCommand("History", "Reopen a saved conversation (F5)", self.action_show_history)
        yield SystemCommand("Export conversation", "Write it as Markdown (F8)", self.action_export_current)
        yield SystemCommand("Toggle token colours", "Accepted drafts vs target tokens (Ctrl+T)",
                            lambda: self.run_action("screen.toggle_origin"))
        yield SystemCommand("New chat", "Start over (Ctrl+N)", lambda: self.run_action("screen.new_chat"))
        yield SystemCommand("JSON schema", "Every reply JSON valid against a schema file, or off (/schema FILE|off)",
                            self.action_schema)

    # ---------------------------------------------------------------- constraint
    def constraint_label(self) -> Optional[str]:
        """The status line's word on the constraint replies keep (None: none)."""
        constraint = self.constraints.current_or_none(self.profile)
        return f"{label(constraint)} on" if constraint is not None else None

    def constraint_command(self, text: str) -> bool:
        """`/schema FILE|off`, `/regex R|off`, `/grammar FILE|off` typed as a message: run (True), said in a
        notification; anything else is a message (False)."""
        name, _, arg = text.strip().partition(" ")
        if name not in CONSTRAINT_COMMANDS:
            return False
        try:
            self.notify(self.constraints.command(name, arg, self.profile), timeout=8)
        except ConstraintError as e:
            self.notify(str(e), severity="error", timeout=10)
        self._refresh_status()
        return True

    def action_schema(self) -> None:
        from specchat.tui.widgets import PathModal

        chosen = self.constraints.current_or_none(self.profile)
        now = chosen.origin if chosen is not None and chosen.kind == "json_schema" else ""
        self.push_screen(PathModal("JSON schema file (Enter: set · off: none · Esc: cancel)", now),
                         lambda path: path is not None and self.constraint_command(f"/schema {path.strip() or 'off'}"))

    # ------------------------------------------------------------------- profiles
    def profile_set(self) -> ProfileSet:
        try:
            return load_profiles()
        except Exception as e:  # never let a profile problem take the app down
            return ProfileSet({}, {"profiles": one_line(e)})

    def action_pick_profile(self) -> None:
        from specchat.tui.widgets import ProfilePicker

        ps = self.profile_set()
        picker = ProfilePicker(picker_rows(availability.classify(ps, probe_servers=False)),
                               self.profile.name if self.profile else None)
        self.push_screen(picker, lambda name: name and self.switch_profile(name))
        if any(p.remote for p in ps.profiles.values()):  # ask the servers without holding the picker up
            self.run_worker(partial(self._probe_thread, picker, ps), thread=True, group="probe",
                            exit_on_error=False, name="probe servers")

    def _probe_thread(self, picker, ps: ProfileSet) -> None:
        rows = picker_rows(availability.classify(ps))
        self.call_from_thread(picker.show_rows, rows)

    def choose_profile(self, name: str) -> None:
        """A profile named outside the picker (the command palette): checked as the picker checks it,
        its server asked, in a thread; switched to only when it can run now."""
        self.run_worker(partial(self._choose_thread, name), thread=True, group="probe", exit_on_error=False,
                        name=f"check {name}")

    def _choose_thread(self, name: str) -> None:
        self.call_from_thread(self._chosen, availability_of(self.profile_set(), name))

    def _chosen(self, a: Availability) -> None:
        if not a.choosable:
            self.notify(a.reason, title=f"{a.name} cannot run now", severity="warning", timeout=10)
            return
        if a.group == "download":
            self.notify(a.reason, title=a.name, timeout=8)
        self.switch_profile(a.name)

    def switch_profile(self, name: str, then_ab: bool = False) -> None:
        """Load a profile's backend in a thread worker; the previous one stays usable until it works."""
        if self.loading:
            self.notify(f"still loading {self.loading}", severity="warning")
            return
        chat = self.chat
        if chat.generating:
            self.notify("a reply is still streaming: Esc stops it, then switch", severity="warning")
            return
        if not then_ab and any(s.id == "ab" for s in self.screen_stack):  # it holds the current backend
            self.notify("close the A/B view (Esc) first, then switch", severity="warning")
            return
        self.loading = self.loading_profile = name
        self.notify(f"loading {name}…", timeout=3)
        self._refresh_status()
        self.run_worker(partial(self._load_thread, name, then_ab), thread=True, group="load",
                        exit_on_error=False, name=f"load {name}")

    def _load_thread(self, name: str, then_ab: bool) -> None:
        profile = backend = None
        error = None
        try:
            profile = load_profiles().get(name)
            backend = self.loader(profile)
        except (ProfileError, BackendError) as e:
            error = str(e)
        except Exception as e:
            error = f"cannot load profile '{name}': {one_line(e)}"
        if backend is not None:
            self._warm_memory(profile, backend)
        self.call_from_thread(self._loaded, name, profile, backend, error, then_ab)

    def _warm_memory(self, profile: Profile, backend: Backend) -> None:
        """Earlier replies into a suffix drafter's memory (suffix_memory.py), in the loading thread;
        whatever goes wrong there leaves the memory empty and is said in one line."""
        from specchat import suffix_memory

        def say(line: str) -> None:
            self.call_from_thread(self.notify, line, timeout=4)
        try:
            line = suffix_memory.warm(backend, profile, self.history.path if self.history else None, progress=say)
        except Exception as e:
            line = f"suffix memory starts empty: {one_line(e)}"
        if line:
            say(line)

    def _loaded(self, name: str, profile: Optional[Profile], backend: Optional[Backend],
                error: Optional[str], then_ab: bool) -> None:
        self.loading = self.loading_profile = None
        if error is not None:
            keep = f" (still on {self.profile.name})" if self.profile else ""
            self.notify(error + keep, title=f"profile {name} failed", severity="error", timeout=12)
            self._refresh_status()
            self.call_later(self.chat.give_back_waiting, "your prompt is back in the input")
            return
        old = self.backend
        self.profile, self.backend = profile, backend
        self.conv.set_profile(profile.name, keep=profile.history)
        self.last_summary = self.chat.live = None  # the previous profile's figures are not this one's
        if old is not None and old is not backend:
            try:
                old.close()
            except Exception:
                pass
        self.notify(f"{profile.name}: {profile_line(profile)}", title="profile loaded", timeout=4)
        self._refresh_status()
        self.call_later(self._after_load, then_ab)

    async def _after_load(self, then_ab: bool) -> None:
        """A prompt sent during the load goes now: in the chat, or as the A/B view's first run."""
        if then_ab:
            self.open_ab(await self.chat.take_waiting())
        else:
            await self.chat.send_waiting()

    # ------------------------------------------------------------------------ A/B
    def open_ab(self, prompt: Optional[str] = None) -> None:
        from specchat.tui.ab_screen import ABScreen

        if self.loading_profile:  # the view would hold the backend the load is about to replace
            self.notify(f"still loading {self.loading_profile}: open the A/B view once it is ready",
                        severity="warning")
            return
        if self.profile is None:
            self.notify("no model loaded: F2 picks a profile", severity="warning")
            return
        self.push_screen(ABScreen(self.ab_reference, prompt))

    # -------------------------------------------------------------------- history
    def action_show_history(self) -> None:
        from specchat.tui.widgets import HistoryScreen

        if self.history is None:
            self.notify("history is off for this session", severity="warning")
            return
        rows = []
        for c in self.history.list_conversations():
            when = datetime.datetime.fromtimestamp(c.updated).strftime("%Y-%m-%d %H:%M")
            rows.append((c.id, f"{when}  {c.title or '(untitled)'}  · {c.profile} · {c.messages} msgs"))

        def opened(cid: Optional[int]) -> None:
            if cid is None:
                return
            if self.chat.generating:
                self.notify("a reply is still streaming: Esc stops it", severity="warning")
                return
            try:
                self.conv.open(cid)
            except HistoryError as e:
                self.notify(str(e), severity="error")
                return
            self.call_later(self.chat.rebuild)
            self.notify(f"opened conversation {cid}")
        self.push_screen(HistoryScreen(rows), opened)

    def export_conversation(self, cid: int, path: Optional[str] = None) -> None:
        if self.history is None:
            self.notify("history is off for this session: nothing to export", severity="warning")
            return
        try:
            out = self.history.export_markdown(cid, path)
        except HistoryError as e:
            self.notify(str(e), severity="error")
            return
        self.notify(f"exported to {out}", timeout=8)

    def action_export_current(self) -> None:
        from specchat import paths
        from specchat.tui.widgets import PathModal

        if self.conv.id is None:
            self.notify("nothing to export yet", severity="warning")
            return
        default = str(paths.data_dir() / "exports" / f"conversation-{self.conv.id}.md")
        cid = self.conv.id
        self.push_screen(PathModal("Export to Markdown (Enter: write · Esc: cancel)", default),
                         lambda p: p and self.export_conversation(cid, p))


def _check_profile(name: str) -> Profile:
    return load_profiles().get(name)  # raises ProfileError: one line, exit 2 via the CLI


def run_chat(profile_name: str, constraint: Optional[Constraint] = None) -> int:
    _check_profile(profile_name)
    SpecChatApp(profile_name, constraint=constraint).run()
    return 0


def run_ab(spec: str, ref: Optional[str] = None, constraint: Optional[Constraint] = None) -> int:
    profile = _check_profile(spec)
    if ref:
        _check_profile(ref)
    else:
        profile.target_only()  # a remote profile needs a named reference: say so before the TUI starts
    SpecChatApp(spec, ab_reference=ref, start_ab=True, constraint=constraint).run()
    return 0
