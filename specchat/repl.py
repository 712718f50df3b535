"""`specchat repl`: a plain line REPL on prompt-toolkit.

One PromptSession with a FileHistory at an absolute path; slash commands with completion;
replies are written straight to stdout while no prompt is active (prompt-toolkit's
patch_stdout would hold text back until a newline); stats live in the bottom toolbar.
Ctrl-C stops a reply and stays; Ctrl-D exits. Standard input that is a pipe or a file is read as
plain lines instead (no prompt, no echo, no terminal warning): `printf 'hi\n' | specchat repl`.
"""
from __future__ import annotations

import queue
import sys
import threading
from typing import Callable, Iterator, Optional, TextIO

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import WordCompleter
from prompt_toolkit.history import FileHistory, InMemoryHistory

from specchat.backends.base import Backend, BackendError, Constraint, Request, Summary
from specchat import loading, paths, suffix_memory
from specchat.constraints import ConstraintError
from specchat.compare import near_tie_margin
from specchat.context_window import fit_request
from specchat.conversation import Conversation
from specchat.history import History, HistoryError
from specchat.live import Failed, Item, one_line, pump, reply_stats, speedup_line, stats_line
from specchat.model_flag import flagged_engine_line
from specchat.profiles import Profile, ProfileError, load_profiles
from specchat.session_constraint import COMMANDS as CONSTRAINT_COMMANDS, HELP as CONSTRAINT_HELP, SessionConstraint, label
from specchat.stdin_text import StdinText
from specchat.verify import fresh, judge_replies, tie_margin_of, torch_engine_of

COMMANDS = {
    "/profile": "/profile NAME   switch profile (the conversation carries over)",
    "/ab": "/ab             toggle A/B: after each reply, run the reference and print the verdict",
    "/system": "/system TEXT    set the system prompt (no text: clear it)",
    "/clear": "/clear          start a new conversation",
    "/save": "/save [PATH]    export the conversation as Markdown",
    "/stats": "/stats          figures of the last reply",
    "/verify": "/verify         re-run the last prompt target-only and print the verdict",
    **CONSTRAINT_HELP,
    "/help": "/help           this list",
    "/exit": "/exit           leave (Ctrl-D too)",
}


class Repl:
    def __init__(self, profile_name: str, *, loader: Optional[Callable[[Profile], Backend]] = None,
                 input=None, output=None, out: Optional[TextIO] = None, history: History | None | bool = True,
                 history_file: Optional[str] = None, lines: Optional[Iterator[str]] = None,
                 constraint: Optional[Constraint] = None):
        self.loader = loader or (lambda p: loading.load_backend(p, background=True))
        # a reference of its own never prepares in the background: only the chat's backend switches
        self.reference_loader = loader or loading.load_backend
        self.out = out or sys.stdout
        self.profile: Optional[Profile] = None
        self.backend: Optional[Backend] = None
        self.ref_profile: Optional[Profile] = None
        self.ref_backend: Optional[Backend] = None
        self.ab = False
        self.constraints = SessionConstraint(constraint)  # a flag's or /schema's, else the profile's
        self.last: Optional[Summary] = None
        self.last_request: Optional[Request] = None
        if history is True:
            try:
                history = History()
            except HistoryError as e:
                self.say(f"note: {e}")
                history = None
        self.conv = Conversation(history or None, profile_name, on_error=lambda m: self.say(f"note: {m}"))
        if lines is None and input is None and not sys.stdin.isatty():
            lines = StdinText().lines()
        self.lines = lines  # plain lines from a pipe or a file; None: an interactive prompt
        self.initial = profile_name
        self.session: Optional[PromptSession] = None
        if lines is not None:
            return
        hist_path = history_file or str((paths.data_dir() / "repl_history").resolve())
        try:
            line_history = FileHistory(hist_path)
        except OSError:
            line_history = InMemoryHistory()
        self.session = PromptSession(
            history=line_history,
            completer=WordCompleter(self._words, WORD=True, sentence=False),
            complete_while_typing=True,
            bottom_toolbar=self.toolbar,
            input=input, output=output)

    # -------------------------------------------------------------------- output
    def say(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def _words(self) -> list[str]:
        words = list(COMMANDS)
        try:
            words += sorted(load_profiles().profiles)
        except Exception:
            pass
        return words

    def toolbar(self) -> str:
        if self.profile is None:
            return " no model loaded: /profile NAME"
        p = self.profile
        bar = f" {p.name} · {p.method_label}" + (" · A/B on" if self.ab else "")
        constraint = self.constraints.current_or_none(p)
        if constraint is not None:
            bar += f" · {label(constraint)}"
        if self.last is not None:
            bar += " │ " + stats_line(self.last, passes=True)
        return bar

    # ------------------------------------------------------------------- loading
    def load(self, name: str) -> bool:
        try:
            profile = load_profiles().get(name)
            backend = self.loader(profile)
        except (ProfileError, BackendError) as e:
            self.say(f"error: {e}" + (f" (still on {self.profile.name})" if self.profile else ""))
            return False
        except Exception as e:
            self.say(f"error: cannot load '{name}': {one_line(e)}")
            return False
        if self.backend is not None:
            self.backend.close()
        self._drop_reference()
        self.profile, self.backend = profile, backend
        self.last = self.last_request = None  # the previous profile's figures are not this one's
        self.conv.set_profile(profile.name, keep=profile.history)
        self.say(f"[{profile.name}: {profile.method_label} · {profile.model}]")
        if engine := flagged_engine_line(profile):  # -m's file: which engine runs it and why
            self.say(f"[{engine}]")
        history = self.conv.history
        memory = suffix_memory.warm(backend, profile, history.path if history else None,
                                    progress=lambda line: self.say(f"[{line}]"))
        if memory:
            self.say(f"[{memory}]")
        background = backend.background_status()
        if background:
            self.say(f"[{background}; moved to between replies]")
        if self.constraints.current_or_none(profile) is not None or getattr(profile, "constraint", None):
            self.say(f"[{self.constraints.describe(profile)}]")
        return True

    def _drop_reference(self) -> None:
        if self.ref_backend is not None:
            self.ref_backend.close()
        self.ref_profile = self.ref_backend = None

    def reference(self) -> Optional[Backend]:
        if self.ref_backend is None:
            ref = self.profile.target_only()
            try:
                self.ref_backend = loading.load_reference(self.profile, self.backend, ref,
                                                         self.reference_loader)
            except (BackendError, ProfileError) as e:
                self.say(f"error: reference failed to load: {e}")
                return None
            self.ref_profile = ref
        return self.ref_backend

    # ---------------------------------------------------------------- generation
    def stream(self, backend: Backend, request: Request, echo: bool = True) -> tuple[Optional[Summary], str]:
        """Stream one reply to stdout; Ctrl-C stops it and keeps what came."""
        q: "queue.Queue[Item]" = queue.Queue()
        cancel = threading.Event()
        sampling = loading.sampling_of(self.profile)
        t = threading.Thread(target=pump, args=(backend, request, sampling, cancel, q), daemon=True)
        t.start()
        text = []
        end = None
        while end is None:
            try:
                item = q.get(timeout=0.1)
            except queue.Empty:
                continue
            except KeyboardInterrupt:
                cancel.set()
                continue
            ev = item.event
            if isinstance(ev, (Summary, Failed)):
                end = ev
            elif ev.text:
                text.append(ev.text)
                if echo:
                    self.out.write(ev.text)
                    self.out.flush()
        t.join(timeout=5)
        if echo:
            self.out.write("\n")
        if isinstance(end, Failed):
            self.say(f"error: {end.message}")
            return None, "".join(text)
        return end, end.text or "".join(text)

    def ask(self, prompt: str) -> None:
        if self.backend is None:
            self.say("error: no model loaded: /profile NAME")
            return
        self.conv.add("user", prompt)
        try:
            request, note = fit_request(self.backend, self.profile, self.conv)
            request.constraint = self.constraints.current(self.profile)
        except (BackendError, ConstraintError) as e:  # the turn does not fit: it is refused and does not stay
            self.conv.pop_user()
            self.say(f"error: {e}")
            return
        if note:
            self.say(f"[{note}]")
        switched = self.backend.switch_if_ready()  # between replies: what was prepared in the background
        if switched:
            self.say(f"[{switched}]")
        summary, text = self.stream(self.backend, request)
        if summary is None and not text:  # it failed before a word: the turn does not stay
            self.conv.pop_user()
        if summary is not None and summary.stop_reason == "cancelled":
            self.say("[stopped: the reply so far is kept]")
        if text:
            saved = self.conv.add("assistant", text, profile=self.profile.name,
                                  stats=reply_stats(summary, self.profile.method_label) if summary else None)
            if summary is not None:
                suffix_memory.remember(self.backend, self.conv.id, saved, summary.token_ids)
        if summary is not None:
            self.last = summary
            self.last_request = request
            if self.ab:
                self.compare(request, summary, echo=True)

    def compare(self, request: Request, spec: Summary, echo: bool) -> None:
        ref_backend = self.reference()
        if ref_backend is None:
            return
        if echo:
            self.say(f"── reference ({self.ref_profile.name}) ──")
        ref, ref_text = self.stream(fresh(ref_backend), request, echo=echo)
        if ref is None:
            return
        if ref.stop_reason == "cancelled" or spec.stop_reason == "cancelled":
            self.say("verdict: stopped before the end; compared what both produced")
        tie = (tie_margin_of(ref_backend) if torch_engine_of(ref_backend) is not None
               else near_tie_margin(self.ref_profile.dtype))
        ref.text = ref.text or ref_text
        v = judge_replies(ref_backend, request, ref, spec, loading.sampling_of(self.profile), tie,
                          other_backend=self.backend)
        speedup = speedup_line(spec, ref)
        self.say(f"verdict: {v.line()}" + (f" · {speedup}" if speedup else ""))

    # ------------------------------------------------------------------ commands
    def command(self, line: str) -> bool:
        """Run a slash command; False means exit."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            for text in COMMANDS.values():
                self.say(text)
        elif name == "/profile":
            if not arg:
                ps = load_profiles()
                self.say("profiles: " + ", ".join(sorted(ps.profiles)))
            else:
                self.load(arg)
        elif name in CONSTRAINT_COMMANDS:
            try:
                self.say(f"[{self.constraints.command(name, arg, self.profile)}]")
            except ConstraintError as e:
                self.say(f"error: {e}")
        elif name == "/ab":
            self.ab = not self.ab
            self.say(f"[A/B {'on: each reply is followed by the reference run' if self.ab else 'off'}]")
        elif name == "/system":
            self.conv.set_system(arg or None)
            self.say("[system prompt set]" if arg else "[system prompt cleared]")
        elif name == "/clear":
            self.conv.reset()
            self.last_request = None
            self.say("[new conversation]")
        elif name == "/save":
            if self.conv.history is None or self.conv.id is None:
                self.say("error: nothing saved to export yet")
            else:
                try:
                    self.say(f"[saved to {self.conv.history.export_markdown(self.conv.id, arg or None)}]")
                except HistoryError as e:
                    self.say(f"error: {e}")
        elif name == "/stats":
            if self.last is None:
                self.say("no reply yet")
            else:
                self.say(stats_line(self.last, passes=True))
                if self.last.drafts:
                    by_pos = " ".join(f"{r:.0%}" for r in self.last.acceptance_by_position)
                    self.say(f"acceptance by draft position: {by_pos}")
        elif name == "/verify":
            if self.last_request is None or self.last is None:
                self.say("error: nothing to verify yet: ask something first")
            else:
                self.say("[verifying against target-only…]")
                self.compare(self.last_request, self.last, echo=False)
        else:
            self.say(f"error: unknown command {name} (/help lists them)")
        return True

    # ---------------------------------------------------------------------- loop
    def read_line(self) -> str:
        if self.session is not None:
            return self.session.prompt("› ")
        line = next(self.lines, None)
        if line is None:
            raise EOFError
        return line

    def run(self) -> int:
        if not self.load(self.initial):
            return 2
        if self.session is not None:
            self.say("type a message; /help for commands; Ctrl-C stops a reply; Ctrl-D exits")
        while True:
            try:
                line = self.read_line()
            except KeyboardInterrupt:
                continue
            except EOFError:
                break
            if not line.strip():
                continue
            if line.startswith("/"):
                if not self.command(line):
                    break
                continue
            self.ask(line)
        if self.backend is not None:
            self.backend.close()
        self._drop_reference()
        return 0


def run_repl(profile_name: str, constraint: Optional[Constraint] = None) -> int:
    load_profiles().get(profile_name)  # a bad name is one line and exit 2, via the CLI
    return Repl(profile_name, constraint=constraint).run()
