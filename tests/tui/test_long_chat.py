"""A conversation that outgrows the context keeps going in the chat and the A/B view: the oldest
turns are left out (said once in a notification), every prompt fits, history keeps everything."""
import pytest

from specchat.history import History
from specchat.tui.app import SpecChatApp
from tests.scripted import ScriptedBackend
from tests.tui.conftest import Loader, ab_open, wait_until

pytestmark = pytest.mark.asyncio

REPLY = "a reply of exactly ten words to every single question asked"
CONTEXT = 160


def question(i: int) -> str:
    return f"question number {i} asks about something else entirely"


async def submit(pilot, app, selector: str, text: str) -> None:
    box = app.screen.query_one(selector)
    box.text = text
    box.focus()
    await pilot.press("enter")


def recorded_notes(app) -> list[str]:
    notes = []
    notify = app.notify

    def recording(message, *args, **kwargs):
        notes.append(str(message))
        return notify(message, *args, **kwargs)
    app.notify = recording
    return notes


async def test_forty_turns_in_a_small_context_keep_answering(profiles_dir):
    backend = ScriptedBackend([REPLY], context=CONTEXT)
    app = SpecChatApp("spec", loader=Loader({"spec": backend}))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: app.backend is not None and app.loading is None, what="backend")
        notes = recorded_notes(app)
        chat = app.chat
        for i in range(40):
            await submit(pilot, app, "#prompt", question(i))
            await wait_until(pilot, lambda: not chat.generating and len(app.conv.messages) == 2 * i + 2,
                             what=f"reply {i}")
        assert [m["content"] for m in app.conv.messages[1::2]] == [REPLY] * 40
        left_out = [n for n in notes if "left out" in n]
        assert left_out and len(left_out) < 20 and not [n for n in notes if "context holds" in n]
        for request in backend.requests:
            assert len(backend.prompt_ids(request)) + 40 <= CONTEXT
        assert len(History().load(app.conv.id).messages) == 80


async def test_the_ab_view_fits_both_sides_to_the_context(profiles_dir):
    spec = ScriptedBackend([REPLY], accept=[2], context=CONTEXT)
    ref = ScriptedBackend([REPLY], context=CONTEXT)
    app = SpecChatApp("spec", loader=Loader({"spec": spec, "spec:target-only": ref}))
    async with app.run_test(size=(120, 32)) as pilot:
        await wait_until(pilot, lambda: app.backend is not None and app.loading is None, what="backend")
        for i in range(12):  # a conversation longer than the context
            app.conv.add("user", question(i))
            app.conv.add("assistant", REPLY)
        app.open_ab()
        await wait_until(pilot, lambda: ab_open(app, ready=True), what="A/B ready")
        await submit(pilot, app, "#ab-prompt", "one more question")
        await wait_until(pilot, lambda: app.screen.verdict is not None, what="verdict")
        assert app.screen.verdict.kind == "identical"
        (spec_request,), (ref_request,) = spec.requests, ref.requests
        assert spec_request.messages == ref_request.messages  # both sides saw the same turns
        assert len(spec.prompt_ids(spec_request)) + 40 <= CONTEXT
        assert spec_request.messages[-1]["content"] == "one more question"
        assert app.conv.context_start > 0 and len(app.conv.messages) == 26
