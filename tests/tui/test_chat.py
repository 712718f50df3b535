"""Pilot tests of the chat screen with a scripted backend."""
import pytest

from specchat.history import History
from specchat.tui.app import SpecChatApp
from specchat.tui.host import ChatHost
from specchat.tui.widgets import AssistantMessage, UserMessage
from tests.scripted import ScriptedBackend
from tests.tui.conftest import REPLY, Loader, wait_until

pytestmark = pytest.mark.asyncio


def app_with(profiles_dir, **backends):
    loader = Loader(backends)
    app = SpecChatApp("spec", loader=loader)
    return app, loader


async def ready(pilot, app):
    await wait_until(pilot, lambda: app.backend is not None and app.loading is None, what="backend loaded")


async def send(pilot, text):
    await pilot.click("#prompt")
    for ch in text:
        await pilot.press("space" if ch == " " else ch)
    await pilot.press("enter")


async def reply_to(pilot, app, text):
    """Send `text` and wait for its reply to finish; the chat screen."""
    await send(pilot, text)
    screen = app.chat
    await wait_until(pilot, lambda: not screen.generating and app.conv.last_reply, what="reply")
    return screen


async def test_prompt_streams_reply_and_saves_history(profiles_dir):
    backend = ScriptedBackend([REPLY], accept=[3, 1, 0], delay=0.002)
    app, _ = app_with(profiles_dir, spec=backend)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        screen = await reply_to(pilot, app, "hi there")
        replies = list(screen.query(AssistantMessage))
        assert [u.text for u in screen.query(UserMessage)] == ["hi there"]
        assert replies[-1].text == REPLY
        assert app.conv.messages == [{"role": "user", "content": "hi there"},
                                     {"role": "assistant", "content": REPLY}]
        # the request the backend saw carried the user's message
        assert backend.requests[-1].messages[-1] == {"role": "user", "content": "hi there"}
        # speculative figures reached the status bar
        assert screen.live.mean_per_pass > 1.5
        status = str(screen.query_one("#status-text").render())
        assert "tok/pass" in status and "tok/s" in status
        # saved as it happened
        conv = History().load(app.conv.id)
        assert [m.content for m in conv.messages] == ["hi there", REPLY]


async def test_the_reply_line_the_status_bar_and_history_agree_on_tokens_per_pass(profiles_dir):
    # passes that drafted nothing (None) make tokens per pass differ from tokens per drafted pass
    backend = ScriptedBackend([REPLY], accept=[3, None, 1, None])
    app, _ = app_with(profiles_dir, spec=backend)
    async with app.run_test(size=(160, 30)) as pilot:
        await ready(pilot, app)
        screen = await reply_to(pilot, app, "hi there")
        summary = screen.live.summary
        assert summary.tokens_per_pass < summary.mean_accepted
        figure = f"{summary.tokens_per_pass:.2f} tok/pass"
        assert figure in list(screen.query(AssistantMessage))[-1].note
        assert figure in str(screen.query_one("#status-text").render())
        stats = History().load(app.conv.id).messages[-1].stats
        assert stats["tokens_per_pass"] == round(summary.tokens_per_pass, 3)
        assert stats["mean_accepted"] == round(summary.mean_accepted, 3) and stats["method"]


async def test_escape_stops_and_keeps_partial_reply(profiles_dir):
    long_reply = " ".join(f"word{i}" for i in range(400))
    backend = ScriptedBackend([long_reply], delay=0.01)
    app, _ = app_with(profiles_dir, spec=backend)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await send(pilot, "go")
        screen = app.chat
        await wait_until(pilot, lambda: screen.live is not None and screen.live.tokens > 5, what="some tokens")
        await pilot.press("escape")
        await wait_until(pilot, lambda: not screen.generating, what="stop")
        kept = app.conv.last_reply
        assert kept and long_reply.startswith(kept) and len(kept) < len(long_reply)
        assert screen.query(AssistantMessage).last().text == kept
        assert "cancelled" in screen.query(AssistantMessage).last().note


async def test_regenerate_replaces_last_reply(profiles_dir):
    backend = ScriptedBackend(["first answer", "second answer"])
    app, _ = app_with(profiles_dir, spec=backend)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await send(pilot, "q")
        await wait_until(pilot, lambda: app.conv.last_reply == "first answer", what="first")
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: app.conv.last_reply == "second answer", what="second")
        assert [m["role"] for m in app.conv.messages] == ["user", "assistant"]
        assert len(app.chat.query(AssistantMessage)) == 1
        assert [m.content for m in History().load(app.conv.id).messages] == ["q", "second answer"]


async def test_code_block_renders_after_stream_and_copies(profiles_dir):
    reply = "Here:\n\n```python\nprint('hi')\nx = 1\n```\n\nDone."
    app, _ = app_with(profiles_dir, spec=ScriptedBackend([reply], delay=0.001))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await send(pilot, "code")
        await wait_until(pilot, lambda: app.conv.last_reply == reply, what="reply")
        await pilot.pause()
        fence = app.chat.query("MarkdownFence")
        assert fence, "the code block was rendered as a fence"
        # after the stream, one full update: the fence holds its code (Textual #6518 left it blank)
        assert fence.first().code.strip() == "print('hi')\nx = 1"
        await pilot.press("ctrl+b")
        assert app.clipboard == "print('hi')\nx = 1"
        await pilot.press("ctrl+o")
        assert app.clipboard == reply


async def test_origin_colours_toggle(profiles_dir):
    app, _ = app_with(profiles_dir, spec=ScriptedBackend([REPLY], accept=[2]))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await pilot.press("ctrl+t")
        await send(pilot, "x")
        await wait_until(pilot, lambda: app.conv.last_reply == REPLY, what="reply")
        msg = app.chat.query(AssistantMessage).last()
        # accept=[2]: each pass is two confirmed drafts then the target's token
        assert msg.tokens.spans, "accepted drafts were marked"
        content = msg.tokens.content()
        first_draft = content.plain[msg.tokens.spans[0][0]:msg.tokens.spans[0][1]]
        assert first_draft == "Speculative decoding"
        assert msg.query_one(".reply-origin").display and not msg.query_one(".reply-md").display
        await pilot.press("ctrl+t")
        assert not msg.query_one(".reply-origin").display


async def test_new_chat_and_system_prompt(profiles_dir):
    backend = ScriptedBackend(["a", "b"])
    app, _ = app_with(profiles_dir, spec=backend)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await pilot.press("f4")
        await pilot.pause()
        area = app.screen.query_one("#system-text")
        area.text = "Be terse."
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.conv.system == "Be terse."
        await send(pilot, "q")
        await wait_until(pilot, lambda: app.conv.last_reply == "a", what="reply")
        assert backend.requests[-1].messages[0] == {"role": "system", "content": "Be terse."}
        first_id = app.conv.id
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.conv.messages == [] and not app.chat.query(AssistantMessage)
        await send(pilot, "again")
        await wait_until(pilot, lambda: app.conv.last_reply == "b", what="reply 2")
        assert app.conv.id != first_id


async def test_the_app_is_the_chat_host_the_screens_expect(profiles_dir):
    """The screens see the app only as a ChatHost (specchat/tui/host.py): every name it declares is there."""
    app, _ = app_with(profiles_dir, spec=ScriptedBackend([REPLY]))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        assert isinstance(app, ChatHost)
