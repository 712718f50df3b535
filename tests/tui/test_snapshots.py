"""Layout snapshots of the chat and A/B screens (pytest-textual-snapshot; update with --snapshot-update).

Timings are frozen before the snapshot so the pictures do not depend on the machine."""
import pytest

pytest.importorskip("pytest_textual_snapshot")

from specchat.tui.app import SpecChatApp  # noqa: E402
from specchat.tui.chat_screen import summary_note  # noqa: E402
from specchat.tui.widgets import AssistantMessage  # noqa: E402
from tests.scripted import ScriptedBackend  # noqa: E402
from tests.tui.conftest import Loader, ab_open, wait_until  # noqa: E402

REPLY = ("Speculative decoding has a small **drafter** guess tokens and the target checks them.\n\n"
         "```python\ndef speedup(accepted, cost):\n    return (1 + accepted) / (1 + cost)\n```\n\nThat's it.")


def freeze(summary, tok_s=100.0, ttft=0.05):
    summary.ttft_s = ttft
    summary.decode_s = (summary.tokens - 1) / tok_s


async def _send(pilot, selector, text):
    pilot.app.screen.query_one(selector).text = text
    await pilot.click(selector)
    await pilot.press("enter")


def test_chat_screen_snapshot(profiles_dir, snap_compare):
    app = SpecChatApp("spec", loader=Loader({"spec": ScriptedBackend([REPLY], accept=[2, 0, 3])}), history=False)

    async def run_before(pilot):
        await wait_until(pilot, lambda: app.backend is not None, what="loaded")
        await _send(pilot, "#prompt", "How does speculative decoding work?")
        chat = app.chat
        await wait_until(pilot, lambda: app.conv.last_reply == REPLY and not chat.generating, what="reply")
        freeze(chat.live.summary)
        msg = chat.query(AssistantMessage).last()
        msg.note = summary_note(chat.live.summary)
        msg.query_one(".reply-note").update(msg.note)
        chat.refresh_status()
        app.clear_notifications()
        app.screen.set_focus(None)  # a blinking cursor would make the picture random
        await pilot.pause()

    assert snap_compare(app, terminal_size=(100, 32), run_before=run_before)


def test_ab_screen_snapshot(profiles_dir, snap_compare):
    spec = ScriptedBackend(["The cat sat on the rug and slept well."], accept=[2, 1])
    ref = ScriptedBackend(["The cat sat on the mat and slept well."])
    app = SpecChatApp("spec", loader=Loader({"spec": spec, "spec:target-only": ref}), history=False, start_ab=True)

    async def run_before(pilot):
        await wait_until(pilot, lambda: ab_open(app, ready=True), what="A/B")
        ab = app.screen
        await _send(pilot, "#ab-prompt", "Where did the cat sit?")
        await wait_until(pilot, lambda: ab.verdict is not None, what="verdict")
        freeze(ab.panes["spec"].summary, tok_s=150.0)
        freeze(ab.panes["ref"].summary, tok_s=100.0)
        for pane in ab.panes.values():
            pane.render_stats()
        ab.show_verdict()
        app.clear_notifications()
        app.screen.set_focus(None)  # a blinking cursor would make the picture random
        await pilot.pause()

    assert snap_compare(app, terminal_size=(120, 30), run_before=run_before)


def test_constrained_chat_snapshot(profiles_dir, tmp_path, snap_compare):
    """A JSON schema on: the status line says so, and the JSON reply shows indented."""
    from specchat.backends.base import Constraint

    schema = Constraint("json_schema", '{"type": "object"}', str(tmp_path / "person.json"))
    reply = '{"name": "Ann", "age": 31, "city": "Oslo", "tags": ["sea", "ski"]}'
    app = SpecChatApp("spec", loader=Loader({"spec": ScriptedBackend([reply], accept=[2, 1])}), history=False,
                      constraint=schema)

    async def run_before(pilot):
        await wait_until(pilot, lambda: app.backend is not None, what="loaded")
        await _send(pilot, "#prompt", "Ann is 31 and lives in Oslo; she likes the sea and skiing.")
        chat = app.chat
        await wait_until(pilot, lambda: app.conv.last_reply == reply and not chat.generating, what="reply")
        freeze(chat.live.summary)
        msg = chat.query(AssistantMessage).last()
        msg.note = summary_note(chat.live.summary)
        msg.query_one(".reply-note").update(msg.note)
        chat.refresh_status()
        app.clear_notifications()
        app.screen.set_focus(None)
        await pilot.pause()

    assert snap_compare(app, terminal_size=(100, 32), run_before=run_before)
