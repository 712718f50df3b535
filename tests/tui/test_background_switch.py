"""The chat and a backend preparing faster passes in the background (TorchBackend with
compile_in_background): the status bar says how far it is, the switch happens only between
replies, and a prompt sent during the switch waits for it."""
import threading
import time

import pytest

from specchat.tui import app as app_module
from tests.scripted import ScriptedBackend
from tests.tui.conftest import REPLY
from tests.tui.test_chat import app_with, ready, send, wait_until

pytestmark = pytest.mark.asyncio
COMPILING = "eager passes; compiling decode graphs in the background (1/2)"


class PreparingBackend(ScriptedBackend):
    """Scripted replies, and a background preparation the test moves along (`state`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.state = "compiling"
        self.streams = 0  # running now
        self.log: list[tuple[str, float]] = []  # (what, when): stream starts, switch start and end

    def background_status(self):
        return {"compiling": COMPILING, "ready": "compiled graphs ready: used from the next reply"}.get(self.state)

    def switch_if_ready(self):
        self.log.append(("switch", time.perf_counter()))
        assert self.streams == 0, "switched while a reply was streaming"
        time.sleep(0.5)
        self.log.append(("switched", time.perf_counter()))
        if self.state == "ready":
            self.state = "done"
            return "switched to compiled decode graphs (loaded in 0.5 s)"
        return None

    def stream(self, request, sampling, cancel=None):
        self.log.append(("stream", time.perf_counter()))
        self.streams += 1
        try:
            yield from super().stream(request, sampling, cancel)
        finally:
            self.streams -= 1


def status(app) -> str:
    return str(app.chat.query_one("#status-text").render())


async def test_status_shows_the_preparation_and_the_switch_waits_for_the_reply(profiles_dir, monkeypatch):
    monkeypatch.setattr(app_module, "BACKGROUND_POLL_S", 0.05)
    backend = PreparingBackend([" ".join(["word"] * 200), REPLY], delay=0.01)
    app, _ = app_with(profiles_dir, spec=backend)
    async with app.run_test(size=(160, 30)) as pilot:
        await ready(pilot, app)
        await wait_until(pilot, lambda: COMPILING in status(app), what="the preparation in the status bar")
        await send(pilot, "hi")
        await wait_until(pilot, lambda: backend.streams == 1, what="the reply streaming")
        backend.state = "ready"  # ready in the middle of a reply: the switch waits for its end
        await wait_until(pilot, lambda: not app.chat.generating, what="the reply")
        await wait_until(pilot, lambda: backend.state == "done", what="the switch")
        await wait_until(pilot, lambda: app.loading is None and app.background_line is None, what="switch shown")
        assert "compiling" not in status(app)
        assert [what for what, _ in backend.log][:2] == ["stream", "switch"]

        backend.state = "ready"  # once more, and a prompt sent while it switches waits for it
        await wait_until(pilot, lambda: backend.log[-1][0] == "switch", what="a second switch")
        await send(pilot, "again")
        await wait_until(pilot, lambda: len(app.conv.messages) == 4 and not app.chat.generating, what="reply")
        (_, switched), (what, started) = backend.log[-2:]
        assert what == "stream" and started >= switched
