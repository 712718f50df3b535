"""Widgets shared by the chat and A/B screens."""
from __future__ import annotations


from dataclasses import dataclass
from typing import Optional

from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content, Span
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Markdown, OptionList, Sparkline, Static, TextArea
from textual.widgets.option_list import Option

from specchat.session_constraint import pretty_json

DRAFT_STYLE = "bold #5fd7ff"  # accepted draft tokens (a model drafter's, or a source that does not say)
# accepted drafts by who guessed them (Step.source), so a user sees where the free tokens came from
SOURCE_STYLES = {"lookup": "bold #87d75f", "ngram": "bold #87d75f",  # prompt lookup
                 "suffix": "bold #ffaf00",  # suffix decoding from this conversation
                 "history": "bold #d787ff"}  # suffix decoding from earlier replies (the memory)
SOURCE_LABELS = {"ngram": "lookup", "history": "suffix: earlier replies"}


def draft_style(source: str) -> str:
    return SOURCE_STYLES.get(source, DRAFT_STYLE)


def draft_sources(profile) -> tuple[str, ...]:
    """Who may draft in a profile's torch replies, by the names their steps carry; () when the
    backend does not say (a server, or target-only)."""
    spec = profile.speculative
    if profile.backend != "torch" or profile.method == "none":
        return ()
    suffix = ("suffix", "history") if spec.suffix.history else ("suffix",)
    if profile.method == "ngram":
        return ("ngram",)
    if profile.method == "suffix":
        return suffix
    front = ("lookup",) if spec.lookup else suffix if spec.suffix.first else ()
    return (*front, profile.method)


def origin_legend(sources, accepted: dict[str, int] | None = None) -> list:
    """The status-bar key to the token colours: each source (with the drafts of it the target
    accepted in this reply), then the target's own tokens."""
    if not sources:
        return [("■ accepted draft", DRAFT_STYLE), " ■ target"]
    parts: list = []
    for source in sources:
        count = f" {accepted.get(source, 0)}" if accepted is not None else ""
        parts += [(f"■ {SOURCE_LABELS.get(source, source)}{count}", draft_style(source)), " "]
    return parts + ["■ target"]
DIVERGE_STYLE = "on #870000"  # from the first divergent token on


class ChatInput(TextArea):
    """Multi-line prompt: Enter sends, Shift+Enter or Ctrl+J inserts a newline."""

    class Submitted(Message):
        def __init__(self, input: "ChatInput", value: str):
            super().__init__()
            self.input = input
            self.value = value

        @property
        def control(self) -> "ChatInput":
            return self.input

    def __init__(self, **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, compact=True, **kwargs)

    def put_back(self, text: str) -> None:
        """A prompt that was not sent, back in the input ahead of anything typed since: nothing is lost."""
        self.text = text + ("\n" + self.text if self.text.strip() else "")

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                self.post_message(self.Submitted(self, text))
            return
        if event.key in ("shift+enter", "ctrl+j", "alt+enter"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)


class UserMessage(Static):
    """A user turn; `waiting` names what it waits for (a prompt sent while a profile loads)."""

    def __init__(self, text: str, waiting: str = ""):
        super().__init__(text, markup=False, classes="message user")
        self.text = text
        self.set_waiting(waiting)

    def set_waiting(self, waiting: str) -> None:
        self.set_class(bool(waiting), "waiting")
        self.update(Content.assemble(self.text, ("\n" + waiting, "dim italic")) if waiting else self.text)


class TokenText:
    """Reply text with the spans of accepted draft tokens, as it streams."""

    def __init__(self, text: str = ""):
        self.text = text
        self.spans: list[tuple[int, int, str]] = []  # (start, end, source)

    def add(self, text: str, draft_chars: int = 0, source: str = "") -> None:
        start = len(self.text)
        self.text += text
        if draft_chars:
            end = start + min(draft_chars, len(text))
            if self.spans and self.spans[-1][1] == start and self.spans[-1][2] == source:
                self.spans[-1] = (self.spans[-1][0], end, source)
            else:
                self.spans.append((start, end, source))

    def content(self, origin: bool = True, diverge_at: Optional[int] = None) -> Content:
        spans = [Span(a, b, draft_style(source)) for a, b, source in self.spans] if origin else []
        if diverge_at is not None and diverge_at < len(self.text):
            spans.append(Span(diverge_at, len(self.text), DIVERGE_STYLE))
        return Content(self.text, spans)


class AssistantMessage(Vertical):
    """A reply: Markdown while streaming (only the last block re-parsed), or token-origin colours."""

    def __init__(self, text: str = "", show_origin: bool = False, note: str = ""):
        super().__init__(classes="message assistant")
        self.tokens = TokenText(text)
        self.show_origin = show_origin
        self.note = note
        self._stream = None
        self._pending: list[str] = []

    @property
    def text(self) -> str:
        return self.tokens.text

    def markdown(self) -> str:
        """The reply as shown: one that is a JSON object or array indented in a json block (the
        reply itself, copied and saved, stays as the model wrote it)."""
        pretty = pretty_json(self.tokens.text)
        return f"```json\n{pretty}\n```" if pretty is not None else self.tokens.text

    def compose(self) -> ComposeResult:
        yield Markdown(self.markdown(), classes="reply-md")
        yield Static(self.tokens.content(), classes="reply-origin", markup=False)
        yield Label(self.note, classes="reply-note")

    def on_mount(self) -> None:
        self._apply_mode()

    def _apply_mode(self) -> None:
        self.query_one(".reply-md").display = not self.show_origin
        origin = self.query_one(".reply-origin", Static)
        origin.display = self.show_origin
        if self.show_origin:
            origin.update(self.tokens.content())
        self.query_one(".reply-note").display = bool(self.note)

    async def set_origin_mode(self, on: bool) -> None:
        if on == self.show_origin:
            return
        self.show_origin = on
        if not on:
            if self._stream is not None:
                await self._stream.stop()
                self._stream = None
            await self.query_one(".reply-md", Markdown).update(self.markdown())
            self._pending.clear()
        self._apply_mode()

    def record(self, text: str, draft_chars: int = 0, source: str = "") -> None:
        """Note one step's text (kept with its draft span and who drafted it); shown at the next `flush`."""
        self.tokens.add(text, draft_chars, source)
        self._pending.append(text)

    async def flush(self) -> None:
        """Show what was recorded since the last frame: one Markdown append, not one per token."""
        if not self._pending or not self.is_attached:
            return
        chunk = "".join(self._pending)
        self._pending.clear()
        if self.show_origin:
            self.query_one(".reply-origin", Static).update(self.tokens.content())
            return
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(".reply-md", Markdown))
        await self._stream.write(chunk)

    async def finish(self, final_text: Optional[str] = None, note: str = "") -> None:
        """Stop streaming and re-render the whole reply once (so fenced code never ends blank)."""
        if final_text is not None and final_text != self.tokens.text:
            if final_text.startswith(self.tokens.text):
                self.tokens.add(final_text[len(self.tokens.text):])
            else:
                self.tokens = TokenText(final_text)
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.note = note
        if not self.is_attached:
            return  # removed while streaming (new chat): nothing to draw
        await self.query_one(".reply-md", Markdown).update(self.markdown())
        if self.is_attached and self.query(".reply-note"):
            self.query_one(".reply-note", Label).update(note)
            self._apply_mode()


class StatusBar(Horizontal):
    def compose(self) -> ComposeResult:
        yield Static("", id="status-text", markup=False)
        yield Sparkline([], id="status-spark")

    def show(self, text: str | Content, per_pass: Optional[list[int]] = None) -> None:
        self.query_one("#status-text", Static).update(text, layout=False)  # fixed size: no relayout
        spark = self.query_one("#status-spark", Sparkline)
        spark.display = bool(per_pass)
        if per_pass:
            spark.data = per_pass[-60:]


# ------------------------------------------------------------------------------ modals

@dataclass(frozen=True)
class PickerRow:
    """One line of the profile picker: a profile, or (name None) the heading of a group."""

    name: Optional[str]
    line: str  # the heading, or what the profile runs (method · backend · model)
    why: str = ""  # next to it: why it does not run here, or what it will do first
    style: str = ""  # the colour of `why` (of the heading, for one)
    refused: bool = False  # choosing it shows `why` instead of loading it
    note: str = ""  # shown when it is chosen (e.g. the model it downloads first)


class ProfilePicker(ModalScreen[Optional[str]]):
    """Profiles group by group (the headings are disabled options); `show_rows` replaces them while
    it is open (once the servers have answered)."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, rows: list[PickerRow], current: Optional[str]):
        super().__init__()
        self.rows = rows
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Switch profile  (Enter: load · Esc: cancel)", classes="dialog-title")
            yield OptionList(*self._options(), id="profile-list")

    def _options(self) -> list[Option]:
        options = []
        for row in self.rows:
            if row.name is None:
                options.append(Option(Content.styled(row.line, f"bold {row.style}"), disabled=True))
                continue
            mark = "●" if row.name == self.current else " "
            why = ("\n    ", (row.why, row.style)) if row.why else ()  # on a line of its own, indented
            options.append(Option(Content.assemble(f"{mark} ", (row.name, "bold"), "  ", row.line, *why), id=row.name))
        return options

    def _highlight(self, name: Optional[str]) -> None:
        names = [row.name for row in self.rows]
        index = names.index(name) if name in names else next((i for i, n in enumerate(names) if n), None)
        self.query_one(OptionList).highlighted = index

    def on_mount(self) -> None:
        self._highlight(self.current)

    def show_rows(self, rows: list[PickerRow]) -> None:
        """Replace the rows, the highlighted profile kept."""
        if not self.is_attached:
            return
        ol = self.query_one(OptionList)
        keep = ol.highlighted_option.id if ol.highlighted_option is not None else self.current
        self.rows = rows
        ol.clear_options()
        ol.add_options(self._options())
        self._highlight(keep)

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        row = next(r for r in self.rows if r.name == event.option.id)
        if row.refused:
            self.app.notify(row.why, title=f"{row.name} cannot run now", severity="warning", timeout=10)
            return
        if row.note:
            self.app.notify(row.note, title=row.name, timeout=8)
        self.dismiss(row.name)


class SystemPromptModal(ModalScreen[Optional[str]]):
    """Edit the system prompt; Ctrl+S saves (an empty prompt means none), Esc cancels."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("System prompt  (Ctrl+S: save · Esc: cancel)", classes="dialog-title")
            yield TextArea(self.text, id="system-text", soft_wrap=True)

    def action_save(self) -> None:
        self.dismiss(self.query_one("#system-text", TextArea).text)


class PathModal(ModalScreen[Optional[str]]):
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str, value: str):
        super().__init__()
        self.title_text = title
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog small"):
            yield Label(self.title_text, classes="dialog-title")
            yield Input(self.value, id="path-input")

    @on(Input.Submitted)
    def _done(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)


class HistoryScreen(ModalScreen[Optional[int]]):
    """Saved conversations, newest first. Enter opens, X exports, Esc closes."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close"), Binding("x", "export", "Export Markdown")]

    def __init__(self, rows: list[tuple[int, str]]):
        super().__init__()
        self.rows = rows

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("History  (Enter: open · X: export to Markdown · Esc: close)", classes="dialog-title")
            if self.rows:
                yield OptionList(*[Option(line, id=str(cid)) for cid, line in self.rows], id="history-list")
            else:
                yield Label("No saved conversations yet.")

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))

    def action_export(self) -> None:
        ol = self.query("#history-list")
        if not ol or ol.first().highlighted is None:
            return
        option = ol.first().get_option_at_index(ol.first().highlighted)
        self.app.export_conversation(int(option.id))
