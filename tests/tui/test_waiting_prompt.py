"""A prompt sent while a profile loads (at start-up, after F2, on the way into the A/B view) is
kept, shown as waiting, and sent the moment the engine is ready; Esc withdraws it."""
import threading

import pytest

from specchat.backends.base import BackendError
from specchat.tui.ab_screen import ABScreen
from specchat.tui.app import SpecChatApp
from specchat.tui.widgets import ChatInput, UserMessage
from tests.scripted import ScriptedBackend
from tests.tui.conftest import REPLY, Loader, ab_open, wait_until
from tests.tui.test_profiles_ab import notes, type_and_send

pytestmark = pytest.mark.asyncio


def gated(backend, gate: threading.Event, error: str | None = None):
    """A loader entry that holds the load until the test opens the gate (a slow model load)."""
    def load():
        assert gate.wait(20), "the test never let the load finish"
        if error:
            raise BackendError(error)
        return backend
    return load


def status(app) -> str:
    return str(app.chat.query_one("#status-text").render())


def users(app) -> list[UserMessage]:
    return list(app.chat.query(UserMessage))


def prompt_text(app, selector="#prompt") -> str:
    return app.screen.query_one(selector, ChatInput).text


async def chat_up(pilot, app):
    await wait_until(pilot, lambda: app.chat.is_mounted and bool(app.chat.query("#status-text")), what="chat")


async def test_prompt_sent_while_the_default_loads_waits_and_gets_its_reply(profiles_dir):
    gate = threading.Event()
    backend = ScriptedBackend([REPLY], accept=[2])
    app = SpecChatApp("spec", loader=Loader({"spec": gated(backend, gate)}))
    async with app.run_test(size=(100, 30)) as pilot:
        await chat_up(pilot, app)
        assert app.loading == "spec" and app.backend is None
        assert "loading spec" in status(app) and "no model loaded" not in status(app)
        await type_and_send(pilot, "#prompt", "hello there")
        await pilot.pause()
        # kept and shown as waiting; the input is free again; nothing says there is no model
        assert app.chat.waiting == "hello there" and prompt_text(app) == ""
        [shown] = users(app)
        assert shown.text == "hello there" and shown.has_class("waiting")
        assert "waiting for spec" in str(shown.render())
        assert not any("no model loaded" in n for n in notes(app))
        assert "no model loaded" not in status(app) and backend.requests == []
        gate.set()
        await wait_until(pilot, lambda: app.conv.last_reply == REPLY and not app.chat.generating, what="reply")
        assert app.conv.messages == [{"role": "user", "content": "hello there"},
                                     {"role": "assistant", "content": REPLY}]
        assert backend.requests[-1].messages[-1] == {"role": "user", "content": "hello there"}
        [shown] = users(app)
        assert not shown.has_class("waiting") and "waiting" not in str(shown.render())
        assert app.chat.waiting is None


async def test_escape_withdraws_the_waiting_prompt_into_the_input(profiles_dir):
    gate = threading.Event()
    backend = ScriptedBackend([REPLY])
    app = SpecChatApp("spec", loader=Loader({"spec": gated(backend, gate)}))
    async with app.run_test(size=(100, 30)) as pilot:
        await chat_up(pilot, app)
        await type_and_send(pilot, "#prompt", "never mind")
        await wait_until(pilot, lambda: app.chat.waiting is not None, what="waiting")
        await pilot.press("escape")
        await pilot.pause()
        assert app.chat.waiting is None and users(app) == [] and prompt_text(app) == "never mind"
        gate.set()
        await wait_until(pilot, lambda: app.backend is backend and app.loading is None, what="loaded")
        await pilot.pause(0.1)
        assert backend.requests == [] and app.conv.messages == []


async def test_second_prompt_while_one_waits_is_refused_and_kept_in_the_input(profiles_dir):
    gate = threading.Event()
    backend = ScriptedBackend(["first reply"])
    app = SpecChatApp("spec", loader=Loader({"spec": gated(backend, gate)}))
    async with app.run_test(size=(100, 30)) as pilot:
        await chat_up(pilot, app)
        await type_and_send(pilot, "#prompt", "one")
        await wait_until(pilot, lambda: app.chat.waiting == "one", what="waiting")
        await type_and_send(pilot, "#prompt", "two")
        await pilot.pause()
        assert prompt_text(app) == "two" and any("already waits" in n for n in notes(app))
        gate.set()
        await wait_until(pilot, lambda: app.conv.last_reply == "first reply", what="reply")
        assert [m["content"] for m in app.conv.messages] == ["one", "first reply"] and prompt_text(app) == "two"


async def test_prompt_sent_after_f2_waits_for_the_picked_profile(profiles_dir):
    gate = threading.Event()
    spec, plain = ScriptedBackend(["from spec"]), ScriptedBackend(["from plain"])
    app = SpecChatApp("spec", loader=Loader({"spec": spec, "plain": gated(plain, gate)}))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: app.backend is spec and app.loading is None, what="spec loaded")
        await pilot.press("f2")
        await wait_until(pilot, lambda: app.screen.query("#profile-list"), what="picker")
        app.screen.dismiss("plain")
        await wait_until(pilot, lambda: app.loading == "plain", what="plain loading")
        await type_and_send(pilot, "#prompt", "for plain")
        await pilot.pause()
        assert spec.requests == [] and app.chat.waiting == "for plain"
        assert "waiting for plain" in str(users(app)[0].render())
        gate.set()
        await wait_until(pilot, lambda: app.conv.last_reply == "from plain", what="reply from plain")
        assert spec.requests == [] and plain.requests[-1].messages[-1]["content"] == "for plain"


async def test_waiting_prompt_goes_back_to_the_input_when_the_load_fails(profiles_dir):
    gate = threading.Event()
    spec = ScriptedBackend(["from spec"])
    app = SpecChatApp("spec", loader=Loader({"spec": spec, "plain": gated(None, gate, "model file not found: x")}))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: app.backend is spec and app.loading is None, what="spec loaded")
        app.switch_profile("plain")
        await wait_until(pilot, lambda: app.loading == "plain", what="plain loading")
        await type_and_send(pilot, "#prompt", "keep me")
        await wait_until(pilot, lambda: app.chat.waiting == "keep me", what="waiting")
        gate.set()
        await wait_until(pilot, lambda: app.loading is None and app.chat.waiting is None, what="load failed")
        await pilot.pause()
        # nothing lost, nothing sent to a model the user did not pick
        assert prompt_text(app) == "keep me" and users(app) == [] and spec.requests == []
        assert any("model file not found" in n and "still on spec" in n for n in notes(app))
        assert any("back in the input" in n for n in notes(app))


async def test_prompt_sent_while_the_ab_view_loads_runs_in_it(profiles_dir):
    """`specchat ab`: the chat shows while the speculative profile loads; a prompt typed there is
    the A/B view's first run once it opens."""
    gate = threading.Event()
    loader = Loader({"spec": gated(ScriptedBackend([REPLY], accept=[1]), gate),
                     "spec:target-only": ScriptedBackend([REPLY])})
    app = SpecChatApp("spec", loader=loader, start_ab=True)
    async with app.run_test(size=(120, 32)) as pilot:
        await chat_up(pilot, app)
        await type_and_send(pilot, "#prompt", "early bird")
        await wait_until(pilot, lambda: app.chat.waiting == "early bird", what="waiting")
        gate.set()
        await wait_until(pilot, lambda: ab_open(app), what="A/B")
        ab = app.screen
        await wait_until(pilot, lambda: ab.verdict is not None, what="verdict")
        assert ab.verdict.kind == "identical" and app.conv.messages[0]["content"] == "early bird"
        assert app.chat.waiting is None and users(app) == []


async def test_ab_prompt_waiting_for_the_reference_is_shown_and_escape_withdraws_it(profiles_dir):
    gate = threading.Event()
    ref = ScriptedBackend(["same words"])
    loader = Loader({"spec": ScriptedBackend(["same words"], accept=[1]), "spec:target-only": gated(ref, gate)})
    app = SpecChatApp("spec", loader=loader, start_ab=True)
    async with app.run_test(size=(120, 32)) as pilot:
        await wait_until(pilot, lambda: ab_open(app), what="A/B")
        ab = app.screen
        await type_and_send(pilot, "#ab-prompt", "early")
        await pilot.pause()
        assert ab.pending_prompt == "early" and prompt_text(app, "#ab-prompt") == ""
        assert "waiting for the reference" in str(ab.query_one("#ab-verdict").render())
        await pilot.press("escape")  # withdraws the prompt; the view stays open
        await pilot.pause()
        assert isinstance(app.screen, ABScreen) and ab.pending_prompt is None
        assert prompt_text(app, "#ab-prompt") == "early"
        assert "waiting" not in str(ab.query_one("#ab-verdict").render())
        gate.set()
        await wait_until(pilot, lambda: ab.ready, what="reference loaded")
        await pilot.pause(0.1)
        assert ref.requests == [] and ab.verdict is None
        await pilot.press("escape")  # nothing waits now: back to the chat
        await pilot.pause()
        assert not isinstance(app.screen, ABScreen)


async def test_no_ab_view_on_a_backend_a_load_is_replacing(profiles_dir):
    """F3 during a load would open the view on the backend the load then closes; a profile switch
    from the palette while the view is open would close it under the view."""
    gate = threading.Event()
    spec, plain = ScriptedBackend([REPLY]), ScriptedBackend([REPLY])
    app = SpecChatApp("spec", loader=Loader({"spec": spec, "spec:target-only": ScriptedBackend([REPLY]),
                                             "plain": gated(plain, gate),
                                             "plain:target-only": ScriptedBackend([REPLY])}))
    async with app.run_test(size=(120, 32)) as pilot:
        await wait_until(pilot, lambda: app.backend is spec and app.loading is None, what="spec loaded")
        app.switch_profile("plain")
        await wait_until(pilot, lambda: app.loading == "plain", what="plain loading")
        await pilot.press("f3")
        await pilot.pause()
        assert not isinstance(app.screen, ABScreen) and any("still loading plain" in n for n in notes(app))
        gate.set()
        await wait_until(pilot, lambda: app.backend is plain and app.loading is None, what="plain loaded")
        await pilot.press("f3")
        await wait_until(pilot, lambda: ab_open(app, ready=True), what="A/B")
        app.switch_profile("spec")  # as the command palette's "Profile: spec" does
        await pilot.pause()
        assert app.loading is None and app.backend is plain and not plain.closed
        assert any("close the A/B view" in n for n in notes(app))
