"""The conversation a front end is holding, saved to history as each message completes."""
from __future__ import annotations

import re
import sqlite3
from typing import Callable, Optional

from specchat.history import History, HistoryError

_FENCE = re.compile(r"^```[^\n]*\n(.*?)(?:^```|\Z)", re.DOTALL | re.MULTILINE)


def last_code_block(text: str) -> Optional[str]:
    blocks = _FENCE.findall(text)
    return blocks[-1].rstrip("\n") if blocks else None


class Conversation:
    """Messages (user/assistant) plus the system prompt; history writes never raise.

    A failing history database turns saving off with one message through `on_error`; the
    conversation in memory carries on."""

    def __init__(self, history: Optional[History], profile: str = "",
                 on_error: Callable[[str], None] = lambda msg: None):
        self.history = history
        self.profile = profile
        self.on_error = on_error
        self.messages: list[dict] = []
        self.ids: list[Optional[int]] = []  # each message's id in history (None: not saved)
        self.system: Optional[str] = None
        self.id: Optional[int] = None
        self.version = 0  # bumped on every change, so views know when to redraw
        # the first message the model still sees; earlier ones were left out to fit the context
        # (context_window.py), and stay here and in history
        self.context_start = 0
        self.keeping = True  # written to history (off while a `history: false` profile runs)

    def _save(self, fn: Callable[[], object]) -> object:
        if self.history is None:
            return None
        try:
            return fn()
        except (sqlite3.Error, HistoryError) as e:
            self.history = None
            self.on_error(f"history is off for this session: {e}")
            return None

    def _ensure_row(self) -> None:
        if self.id is None and self.history is not None and self.keeping:
            def create():
                self.id = self.history.new_conversation(self.profile, self.system)
            self._save(create)

    def add(self, role: str, content: str, profile: Optional[str] = None, stats: Optional[dict] = None) -> Optional[int]:
        """Append a message; its id in history (None: not saved)."""
        self.messages.append({"role": role, "content": content})
        self.version += 1
        self._ensure_row()
        saved = None
        if self.id is not None and self.keeping:
            saved = self._save(lambda: self.history.add_message(self.id, role, content, profile or self.profile, stats))
        self.ids.append(saved)
        return saved

    def _pop(self, role: str) -> Optional[str]:
        if not self.messages or self.messages[-1]["role"] != role:
            return None
        msg = self.messages.pop()
        self.ids.pop()
        self.version += 1
        self.context_start = min(self.context_start, self._last_user_index())
        if self.id is not None:
            self._save(lambda: self.history.delete_last(self.id, role))
        return msg["content"]

    def pop_assistant(self) -> Optional[str]:
        """Drop the last reply (to regenerate or replace it)."""
        return self._pop("assistant")

    def pop_user(self) -> Optional[str]:
        """Drop a user turn that got no reply (it failed): it does not stay in the conversation."""
        return self._pop("user")

    def _last_user_index(self) -> int:
        return next((i for i in range(len(self.messages) - 1, -1, -1) if self.messages[i]["role"] == "user"), 0)

    @property
    def in_context(self) -> list[dict]:
        """The messages the model sees: from `context_start` on (context_window.py moves it)."""
        return self.messages[self.context_start:]

    def set_system(self, system: Optional[str]) -> None:
        self.system = system or None
        self.version += 1
        if self.id is not None:
            self._save(lambda: self.history.set_system(self.id, self.system))

    def set_profile(self, profile: str, keep: bool = True) -> None:
        """The profile the next messages come from; `keep` False (its `history: false`): they stay
        in memory only, never written."""
        self.profile = profile
        self.keeping = keep
        if self.id is not None:
            self._save(lambda: self.history.set_profile(self.id, profile))

    def reset(self) -> None:
        self.messages = []
        self.ids = []
        self.id = None
        self.context_start = 0
        self.version += 1

    def open(self, conversation_id: int) -> None:
        if self.history is None:
            raise HistoryError("history is off for this session")
        conv = self.history.load(conversation_id)
        self.messages = conv.as_history()
        self.ids = [m.id for m in conv.messages if m.role != "system"]
        self.system = conv.system
        self.id = conv.id
        self.context_start = 0
        self.version += 1

    @property
    def last_reply(self) -> Optional[str]:
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                return m["content"]
        return None

    @property
    def last_user(self) -> Optional[str]:
        for m in reversed(self.messages):
            if m["role"] == "user":
                return m["content"]
        return None

    def last_code(self) -> Optional[str]:
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                code = last_code_block(m["content"])
                if code is not None:
                    return code
        return None
