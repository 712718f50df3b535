"""Reopening and exporting conversations from the TUI; a broken history never stops the chat."""

import pytest

from specchat import paths
from specchat.history import History
from specchat.tui.app import SpecChatApp
from specchat.tui.widgets import AssistantMessage, HistoryScreen, PathModal, UserMessage
from tests.scripted import ScriptedBackend
from tests.tui.conftest import Loader, wait_until

pytestmark = pytest.mark.asyncio


async def ready(pilot, app):
    await wait_until(pilot, lambda: app.backend is not None and app.loading is None, what="loaded")


async def send(pilot, text):
    pilot.app.screen.query_one("#prompt").text = text
    await pilot.click("#prompt")
    await pilot.press("enter")


async def test_reopen_and_export_from_history_list(profiles_dir):
    h = History()
    old = h.new_conversation("spec", system="old system")
    h.add_message(old, "user", "an old question")
    h.add_message(old, "assistant", "an old answer")
    backend = ScriptedBackend(["new answer", "follow-up answer"])
    app = SpecChatApp("spec", loader=Loader({"spec": backend}))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await send(pilot, "a new question")
        await wait_until(pilot, lambda: app.conv.last_reply == "new answer", what="reply")
        await pilot.press("f5")
        await wait_until(pilot, lambda: isinstance(app.screen, HistoryScreen), what="history list")
        options = app.screen.query_one("#history-list")
        titles = [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]
        assert "a new question" in titles[0] and "an old question" in titles[1]  # newest first
        options.highlighted = 1
        await pilot.press("x")  # export the highlighted one
        exported = list((paths.data_dir() / "exports").glob(f"{old}-*.md"))
        assert exported and "an old answer" in exported[0].read_text()
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.conv.id == old, what="reopened")
        await pilot.pause()
        chat = app.chat
        await wait_until(pilot, lambda: [u.text for u in chat.query(UserMessage)] == ["an old question"],
                         what="old conversation shown")
        assert [a.text for a in chat.query(AssistantMessage)] == ["an old answer"]
        assert app.conv.system == "old system"
        await send(pilot, "and then?")  # the reopened conversation continues, and is saved
        await wait_until(pilot, lambda: app.conv.last_reply == "follow-up answer", what="follow-up")
        assert backend.requests[-1].messages[0] == {"role": "system", "content": "old system"}
        assert [m.content for m in History().load(old).messages][-2:] == ["and then?", "follow-up answer"]


async def test_export_current_to_chosen_path(profiles_dir, tmp_path):
    app = SpecChatApp("spec", loader=Loader({"spec": ScriptedBackend(["answer"])}))
    target = tmp_path / "chosen" / "chat.md"
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await send(pilot, "question")
        await wait_until(pilot, lambda: app.conv.last_reply == "answer", what="reply")
        await pilot.press("f8")
        await wait_until(pilot, lambda: isinstance(app.screen, PathModal), what="path prompt")
        app.screen.query_one("#path-input").value = str(target)
        await pilot.press("enter")
        await wait_until(pilot, lambda: target.exists(), what="export")
    assert "## User\n\nquestion" in target.read_text()


async def test_broken_history_database_does_not_stop_the_chat(profiles_dir):
    db = paths.data_dir() / "history.db"
    db.write_bytes(b"not a database at all" * 50)
    app = SpecChatApp("spec", loader=Loader({"spec": ScriptedBackend(["fine"])}))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        notes = [str(n.message) for n in app._notifications]
        assert any("move it aside" in n and "\n" not in n for n in notes)
        await send(pilot, "hello")
        await wait_until(pilot, lambda: app.conv.last_reply == "fine", what="reply")
    assert db.read_bytes().startswith(b"not a database")  # left as it was
