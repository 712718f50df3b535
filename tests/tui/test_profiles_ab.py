"""Profile switching and the A/B split view, driven through Pilot."""
import pytest

from specchat.tui.ab_screen import ABScreen, SEQUENTIAL_NOTE, RACE_NOTE
from specchat.tui.app import SpecChatApp
from tests.scripted import ScriptedBackend
from tests.tui.conftest import REPLY, Loader, ab_open, wait_until

pytestmark = pytest.mark.asyncio


async def ready(pilot, app, name="spec"):
    await wait_until(pilot, lambda: app.profile is not None and app.profile.name == name and app.loading is None,
                     what=f"{name} loaded")


async def type_and_send(pilot, selector, text):
    await pilot.click(selector)
    for ch in text:
        await pilot.press("space" if ch == " " else ch)
    await pilot.press("enter")


def notes(app):
    return [str(n.message) for n in app._notifications]


async def test_switch_profile_carries_conversation(profiles_dir):
    spec, plain = ScriptedBackend(["from spec"]), ScriptedBackend(["from plain"])
    app = SpecChatApp("spec", loader=Loader({"spec": spec, "plain": plain}))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await type_and_send(pilot, "#prompt", "one")
        await wait_until(pilot, lambda: app.conv.last_reply == "from spec", what="reply")
        await pilot.press("f2")
        await pilot.pause()
        picker = app.screen
        names = [o.id for o in picker.query_one("#profile-list").options]
        assert {"spec", "plain", "broken", "noload"} <= set(names)
        assert "tok/s" in str(app.chat.query_one("#status-text").render())  # spec's figures
        picker.dismiss("plain")
        await ready(pilot, app, "plain")
        assert spec.closed  # the previous model was released after the new one loaded
        await pilot.pause()
        status = str(app.chat.query_one("#status-text").render())
        assert "plain" in status and "tok/s" not in status  # spec's figures are not plain's
        await type_and_send(pilot, "#prompt", "two")
        await wait_until(pilot, lambda: app.conv.last_reply == "from plain", what="reply 2")
        # the conversation carried over to the new profile
        assert [m["content"] for m in plain.requests[-1].messages] == ["one", "from spec", "two"]


async def test_broken_profiles_notify_and_keep_previous(profiles_dir):
    spec = ScriptedBackend(["still here"])
    app = SpecChatApp("spec", loader=Loader({"spec": spec}))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        app.switch_profile("broken")  # fails validation (unknown key)
        await wait_until(pilot, lambda: app.loading is None and any("speculativ" in n for n in notes(app)),
                         what="validation error")
        app.switch_profile("noload")  # BackendError at load
        await wait_until(pilot, lambda: app.loading is None and any("model file not found" in n for n in notes(app)),
                         what="load error")
        assert app.profile.name == "spec" and app.backend is spec and not spec.closed
        errors = [n for n in notes(app) if "speculativ" in n or "not found" in n]
        assert all("\n" not in n for n in errors) and all("still on spec" in n for n in errors)
        await type_and_send(pilot, "#prompt", "works")
        await wait_until(pilot, lambda: app.conv.last_reply == "still here", what="reply")


async def test_palette_lists_profiles(profiles_dir):
    from specchat.tui.app import ProfileCommands

    app = SpecChatApp("spec", loader=Loader({"spec": ScriptedBackend(["x"])}))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        provider = ProfileCommands(app.screen)
        titles = [t for t, _, _ in provider._items()]
        assert "Profile: plain" in titles and "Profile: broken (broken)" in titles


def ab_app(spec_backend, ref_backend, **kw):
    loader = Loader({"spec": spec_backend, "spec:target-only": ref_backend, "plain": ref_backend})
    return SpecChatApp("spec", loader=loader, **kw)


async def run_ab(pilot, app, prompt="compare"):
    await wait_until(pilot, lambda: ab_open(app, ready=True), what="A/B ready")
    await type_and_send(pilot, "#ab-prompt", prompt)
    await wait_until(pilot, lambda: app.screen.verdict is not None, what="verdict")
    return app.screen


async def test_ab_divergent_highlighted_with_mismatch_verdict(profiles_dir):
    ref_text = "The cat sat on the mat and slept."
    spec_text = "The cat sat on the rug and slept."
    app = ab_app(ScriptedBackend([spec_text], accept=[2, 1], delay=0.002),
                 ScriptedBackend([ref_text], delay=0.002), start_ab=True)
    async with app.run_test(size=(120, 32)) as pilot:
        ab = await run_ab(pilot, app)
        v = ab.verdict
        assert v.kind == "mismatch" and v.index == 5 and v.by == "tokens"
        assert v.ref_text == " mat" and v.other_text == " rug"
        assert "mismatch at token 5" in str(ab.query_one("#ab-verdict").render())
        spec_pane, ref_pane = ab.panes["spec"], ab.panes["ref"]
        # both panes highlighted from the divergent token on
        assert ref_pane.diverge_at == len("The cat sat on the") == spec_pane.diverge_at
        spans = ref_pane.tokens.content(origin=False, diverge_at=ref_pane.diverge_at).spans
        assert spans[-1].start == len("The cat sat on the") and spans[-1].end == len(ref_text)
        assert "speed-up" in str(ab.query_one("#ab-verdict").render())
        # the conversation continues with the reference reply unless the user picks the other
        assert app.conv.last_reply == ref_text
        await pilot.press("ctrl+l")
        assert app.conv.last_reply == spec_text
        assert [m["role"] for m in app.conv.messages] == ["user", "assistant"]
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, ABScreen)


async def test_ab_identical_and_sequential(profiles_dir):
    spec = ScriptedBackend([REPLY], accept=[3, 0, 2], delay=0.003)
    ref = ScriptedBackend([REPLY], delay=0.003)
    app = ab_app(spec, ref, start_ab=True)
    async with app.run_test(size=(120, 32)) as pilot:
        # the screen is pushed before it is composed: wait for its widgets, not only its type
        await wait_until(pilot, lambda: ab_open(app), what="A/B")
        assert str(app.screen.query_one("#ab-mode").render()) == SEQUENTIAL_NOTE
        ab = await run_ab(pilot, app)
        assert ab.verdict.kind == "identical" and ab.verdict.line().startswith("identical")
        s, r = ab.panes["spec"].summary, ab.panes["ref"].summary
        # sequential by default: the reference started only after the speculative side finished
        assert r.passes == len(REPLY.split()) and s.passes < r.passes
        assert ab.panes["spec"].diverge_at is None and ab.panes["ref"].diverge_at is None
        assert "tok/pass" in str(ab.panes["spec"].query_one(".ab-stats").render())
        assert not ab.can_choose and app.conv.last_reply == REPLY
        await pilot.press("ctrl+g")
        assert str(ab.query_one("#ab-mode").render()) == RACE_NOTE
        ab.start("again")
        await wait_until(pilot, lambda: not ab.running and ab.verdict is not None, what="race verdict")
        assert ab.verdict.kind == "identical"


async def test_ab_sequential_order(profiles_dir):
    """In sequential mode the reference's first token comes after the speculative summary."""
    import time
    stamps = {}

    class Stamped(ScriptedBackend):
        def __init__(self, tag, *a, **k):
            super().__init__(*a, **k)
            self.tag = tag

        def stream(self, request, sampling, cancel=None):
            stamps[self.tag + "-start"] = time.perf_counter()
            yield from super().stream(request, sampling, cancel)
            stamps[self.tag + "-end"] = time.perf_counter()

    app = ab_app(Stamped("spec", [REPLY], accept=[1], delay=0.002), Stamped("ref", [REPLY], delay=0.002),
                 start_ab=True)
    async with app.run_test(size=(120, 32)) as pilot:
        await run_ab(pilot, app)
    assert stamps["ref-start"] >= stamps["spec-end"]


async def test_ab_text_fallback_and_reference_profile(profiles_dir):
    spec = ScriptedBackend(["abc def"], ids=False)
    ref = ScriptedBackend(["abc dxf"], ids=False)
    app = ab_app(spec, ref, start_ab=True, ab_reference="plain")
    async with app.run_test(size=(120, 32)) as pilot:
        ab = await run_ab(pilot, app)
        assert ab.ref_profile.name == "plain"
        assert ab.verdict.by == "text" and ab.verdict.kind == "mismatch" and ab.verdict.index == 5
        assert ab.panes["ref"].diverge_at == 5


async def test_ab_prompt_sent_while_reference_loads_runs_when_ready(profiles_dir):
    import threading

    gate = threading.Event()
    ref = ScriptedBackend(["same words here"])

    def slow_ref():
        gate.wait(5)
        return ref

    loader = Loader({"spec": ScriptedBackend(["same words here"], accept=[1]), "spec:target-only": slow_ref})
    app = SpecChatApp("spec", loader=loader, start_ab=True)
    async with app.run_test(size=(120, 32)) as pilot:
        await wait_until(pilot, lambda: ab_open(app), what="A/B")
        ab = app.screen
        assert not ab.ready
        await type_and_send(pilot, "#ab-prompt", "early")
        assert ab.verdict is None and ab.pending_prompt == "early"
        gate.set()
        await wait_until(pilot, lambda: ab.verdict is not None, what="verdict after load")
        assert ab.verdict.kind == "identical" and app.conv.messages[0]["content"] == "early"
