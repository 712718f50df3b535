"""The A/B view's floor and its reference on another engine, driven through Pilot: a reference on
another engine is judged as `verify` judges one (the speculative profile's own target-only runs
after both visible runs; a divergence only from the other engine is 'engines differ', never the
drafter's), and the floor (Ctrl+F, or `ab -p P -r P`) runs the target-only twice and says whether
it reproduced itself."""
import time

import pytest

from specchat import cli
from specchat.compare import mark_and_colour
from specchat.tui.ab_screen import ABScreen, SEQUENTIAL_NOTE
from specchat.tui.app import SpecChatApp
from tests.scripted import ScriptedBackend
from tests.tui.conftest import Loader, ab_open, wait_until

pytestmark = pytest.mark.asyncio

# the same model as `spec`, in another dtype: other arithmetic, as another engine or quantization is
OTHER = "backend: torch\nmodel: smollm2-135m-instruct\ndtype: bfloat16\n"


class Stamped(ScriptedBackend):
    """Records when each of its runs started and ended, in a log shared by all the backends."""

    def __init__(self, tag, log, *a, **k):
        super().__init__(*a, **k)
        self.tag, self.log = tag, log

    def stream(self, request, sampling, cancel=None):
        self.log.append((self.tag, "start", time.perf_counter()))
        yield from super().stream(request, sampling, cancel)
        self.log.append((self.tag, "end", time.perf_counter()))


async def send(pilot, text):
    await wait_until(pilot, lambda: ab_open(pilot.app, ready=True), what="A/B ready")
    pilot.app.screen.query_one("#ab-prompt").text = text
    await pilot.click("#ab-prompt")
    await pilot.press("enter")
    ab = pilot.app.screen
    await wait_until(pilot, lambda: ab.verdict is not None and not ab.running, what="verdict")
    return ab


def shown(ab, selector):
    return str(ab.query_one(selector).render())


async def test_another_engine_divergence_is_the_engines_not_the_drafter(profiles_dir):
    (profiles_dir / "other.yaml").write_text(OTHER)
    log = []
    spec = Stamped("spec", log, ["a b c d e"], accept=[2])
    own = Stamped("own", log, ["a b c d e"])  # the speculative reply is its own target-only's
    other = Stamped("other", log, ["a b x d e"])  # the other engine parts at token 2
    loader = Loader({"spec": spec, "spec:target-only": own, "other": other})
    app = SpecChatApp("spec", loader=loader, start_ab=True, ab_reference="other", history=False)
    async with app.run_test(size=(140, 32)) as pilot:
        ab = await send(pilot, "compare")
        v = ab.verdict
        assert v.kind == "engines differ" and v.index == 2 and v.ok
        assert mark_and_colour(v) == ("⇄", "cyan")
        line = shown(ab, "#ab-verdict")
        assert "engines differ at token 2: ' c' (its own target-only) vs ' x' (reference)" in line
        assert "mismatch" not in line and "drafter's" not in line
        assert "own target-only runs after both" in shown(ab, "#ab-header")
        # both panes highlighted where the replies on screen part
        assert ab.panes["spec"].diverge_at == len("a b") == ab.panes["ref"].diverge_at
    assert "spec:target-only" in loader.loaded and len(own.requests) == 1
    # quietly after the two visible runs: never contending with their timings
    order = [(tag, what) for tag, what, _ in log]
    assert order == [("spec", "start"), ("spec", "end"), ("other", "start"), ("other", "end"),
                     ("own", "start"), ("own", "end")]
    assert own.requests[0].messages == spec.requests[0].messages


async def test_another_engine_the_drafters_own_mismatch_is_still_its(profiles_dir):
    (profiles_dir / "other.yaml").write_text(OTHER)
    spec = ScriptedBackend(["a q c d e"], accept=[1])
    own = ScriptedBackend(["a b c d e"])
    other = ScriptedBackend(["a b c d e"])
    app = SpecChatApp("spec", loader=Loader({"spec": spec, "spec:target-only": own, "other": other}),
                      start_ab=True, ab_reference="other", history=False)
    async with app.run_test(size=(140, 32)) as pilot:
        ab = await send(pilot, "compare")
        assert ab.verdict.kind == "mismatch" and ab.verdict.index == 1
        assert "against its own target-only reply, so the drafter's" in ab.verdict.why
        assert mark_and_colour(ab.verdict)[1] == "red"


async def test_the_same_arithmetic_needs_no_third_run(profiles_dir):
    spec, plain = ScriptedBackend(["a b c"], accept=[1]), ScriptedBackend(["a x c"])
    loader = Loader({"spec": spec, "plain": plain})
    app = SpecChatApp("spec", loader=loader, start_ab=True, ab_reference="plain", history=False)
    async with app.run_test(size=(140, 32)) as pilot:
        ab = await send(pilot, "compare")
        assert ab.verdict.kind == "mismatch"  # judged directly, as before
        assert "another engine" not in shown(ab, "#ab-header")
    assert loader.loaded == ["spec", "plain"]


async def test_ctrl_f_shows_the_floor_and_a_target_that_does_not_reproduce(profiles_dir):
    spec = ScriptedBackend(["a b c d"], accept=[1])
    ref = ScriptedBackend(["a b c d", "a b x d"])  # its second run parts at token 2
    app = SpecChatApp("spec", loader=Loader({"spec": spec, "spec:target-only": ref}), start_ab=True, history=False)
    async with app.run_test(size=(140, 32)) as pilot:
        await wait_until(pilot, lambda: ab_open(app, ready=True), what="A/B ready")
        ab = app.screen
        assert any(b.key == "ctrl+f" and b.description == "Floor" for b in ABScreen.BINDINGS)
        await pilot.press("ctrl+f")
        assert shown(ab, "#ab-mode").startswith("target-only vs target-only: the floor")
        assert shown(ab, "#pane-spec .ab-title") == "floor: spec:target-only again (target-only, a fresh cache)"
        await pilot.press("ctrl+g")  # its two runs share one engine: never raced
        assert not ab.race and "the floor" in shown(ab, "#ab-mode")
        ab = await send(pilot, "compare")
        v = ab.verdict
        assert v.kind == "target not reproducible" and v.index == 2
        assert mark_and_colour(v) == ("↯", "magenta")
        line = shown(ab, "#ab-verdict")
        assert "target not reproducible: its runs part at token 2" in line and "no drafter" in line
        assert "speed-up" not in line and "mismatch" not in line
        assert spec.requests == [] and len(ref.requests) == 2  # the reference on both sides, each run fresh
        assert "floor run's" in line  # Ctrl+L offers the other run's reply
        await pilot.press("ctrl+f")  # back to the drafter
        assert shown(ab, "#ab-mode") == SEQUENTIAL_NOTE
        assert shown(ab, "#pane-spec .ab-title").startswith("speculative: spec")
        ab = await send(pilot, "again")
        assert ab.verdict.kind != "target not reproducible" and len(spec.requests) == 1


async def test_ab_p_p_is_the_floor_and_a_reproducible_target_says_so(profiles_dir):
    loader = Loader({"plain": lambda: ScriptedBackend(["the same words each time"])})
    app = SpecChatApp("plain", loader=loader, start_ab=True, ab_reference="plain", history=False)
    async with app.run_test(size=(140, 32)) as pilot:
        await wait_until(pilot, lambda: ab_open(app, ready=True), what="A/B ready")
        ab = app.screen
        assert shown(ab, "#ab-mode").startswith("target-only vs target-only: the floor")
        assert shown(ab, "#pane-spec .ab-title") == "floor: plain (target-only, a fresh cache)"
        assert not any("not speculative" in str(n.message) for n in app._notifications)
        await pilot.press("ctrl+f")  # already the floor: says so, stays it
        assert any("this view is the floor" in str(n.message) for n in app._notifications)
        ab = await send(pilot, "compare")
        assert ab.verdict.kind == "identical"
        line = shown(ab, "#ab-verdict")
        assert line.startswith("✔ reproducible: both runs gave the same 5 tokens")
        assert "target not reproducible" not in line
        assert app.conv.last_reply == "the same words each time"


async def test_ab_p_p_on_a_target_that_does_not_reproduce(profiles_dir):
    same = ScriptedBackend(["one two three", "one two four"])  # one engine, two runs
    app = SpecChatApp("plain", loader=Loader({"plain": same}), start_ab=True, ab_reference="plain", history=False)
    async with app.run_test(size=(140, 32)) as pilot:
        ab = await send(pilot, "compare")
        assert ab.verdict.kind == "target not reproducible" and ab.verdict.index == 2
        assert ab.panes["spec"].diverge_at == len("one two") == ab.panes["ref"].diverge_at
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, ABScreen), what="back to the chat")
        assert not same.closed  # the chat's own backend, never closed by the view


async def test_ab_p_p_is_accepted(isolated_dirs, monkeypatch):
    """`specchat ab -p smollm2 -r smollm2`: a target-only profile against itself starts the view."""
    started = []
    monkeypatch.setattr(SpecChatApp, "run", lambda self: started.append((self.initial_profile, self.ab_reference,
                                                                          self.start_ab)))
    assert cli.main(["ab", "-p", "smollm2", "-r", "smollm2"]) == 0
    assert started == [("smollm2", "smollm2", True)]
