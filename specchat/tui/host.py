"""What the chat and A/B screens may ask of the app they run in, beyond what any Textual App offers
(SpecChatApp implements it).

The screens name this, never app.py: app.py pushes the screens, so a screen that imported the app
back (even only for its type) would close an import circle, and every change to the app would be
one to check against the screens. tests/test_layering.py holds the screens to these names and
Textual's, and tests/tui checks that the running app has them all.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Optional, Protocol, runtime_checkable

from specchat.backends.base import Backend, Summary
from specchat.conversation import Conversation
from specchat.profiles import Profile
from specchat.session_constraint import SessionConstraint


@runtime_checkable
class ChatHost(Protocol):
    conv: Conversation
    profile: Optional[Profile]
    backend: Optional[Backend]
    loading: Optional[str]  # what is loading now (a profile, compiled graphs), for the status line
    loading_profile: Optional[str]  # the profile whose load a sent prompt waits for
    background_line: Optional[str]
    show_origin: bool
    last_summary: Optional[Summary]
    between_replies: threading.Lock  # a reply starts only while the backend is not switching
    constraints: SessionConstraint
    reference_loader: Callable[[Profile], Backend]

    def constraint_label(self) -> Optional[str]: ...

    def constraint_command(self, text: str) -> bool: ...

    def open_ab(self, prompt: Optional[str] = None) -> None: ...


if TYPE_CHECKING:
    from textual.app import App

    class HostApp(App, ChatHost):
        """The type of a screen's `self.app`: Textual's App and a ChatHost (Python has no A & B).
        Only for annotations: at run time the metaclasses of App and Protocol would not mix."""
