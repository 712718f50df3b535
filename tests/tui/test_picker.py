"""The profile picker (F2): profiles grouped by where they run, here first; one that cannot run now
says why instead of loading; one that needs a download loads after saying so."""
import os
import socket
from pathlib import Path

import pytest

from specchat import availability
from specchat.availability import CHECKING, GROUPS
from specchat.tui.app import SpecChatApp
from specchat.tui.widgets import ProfilePicker
from tests.scripted import ScriptedBackend
from tests.tui.conftest import Loader, wait_until

pytestmark = pytest.mark.asyncio


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cpu_machine(profiles_dir, isolated_dirs, monkeypatch):
    """The Pilot profiles plus a server profile on a loopback port where nothing listens and a GPU
    one, on a CPU-only machine with an empty model cache."""
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(isolated_dirs / "cache"))
    monkeypatch.setattr(availability, "cuda_devices", lambda: 0)
    folder = Path(os.environ["SPECCHAT_PROFILES_DIR"])
    (folder / "down.yaml").write_text(
        f"backend: openai\nmodel: tiny\nserver:\n  base_url: http://127.0.0.1:{free_port()}/v1\n")
    (folder / "gpu.yaml").write_text("model: smollm2-135m-instruct\ndevice: cuda\n")
    return folder


def notes(app):
    return [str(n.message) for n in app._notifications]


async def open_picker(pilot, app) -> ProfilePicker:
    await wait_until(pilot, lambda: app.profile is not None and app.loading is None, what="spec loaded")
    await pilot.press("f2")
    await wait_until(pilot, lambda: isinstance(app.screen, ProfilePicker), what="picker")
    picker = app.screen
    await wait_until(pilot, lambda: all(r.why != CHECKING for r in picker.rows), what="servers asked")
    await pilot.pause()
    return picker


async def choose(pilot, picker, name):
    ol = picker.query_one("#profile-list")
    ol.highlighted = ol.get_option_index(name)
    await pilot.press("enter")
    await pilot.pause()


async def test_picker_groups_profiles_and_refuses_a_server_that_is_down(cpu_machine):
    loader = Loader({"spec": ScriptedBackend(["x"]), "down": ScriptedBackend(["never"])})
    app = SpecChatApp("spec", loader=loader)
    async with app.run_test(size=(120, 40)) as pilot:
        picker = await open_picker(pilot, app)
        options = picker.query_one("#profile-list").options
        headings = [o.prompt.plain for o in options if o.disabled]
        assert headings == ["needs a download", "needs a GPU", "needs a server", "broken"]
        assert headings == [h for h in GROUPS.values() if h in headings]  # in GROUPS' order
        rows = {r.name: r for r in picker.rows}
        assert rows["down"].refused and rows["down"].why.startswith("not answering at 127.0.0.1:")
        assert "not answering at 127.0.0.1:" in next(o for o in options if o.id == "down").prompt.plain
        assert rows["gpu"].refused and "no CUDA GPU" in rows["gpu"].why
        assert rows["broken"].refused and "speculativ" in rows["broken"].why
        assert picker.query_one("#profile-list").highlighted_option.id == "spec"  # the current one

        await choose(pilot, picker, "down")
        assert app.screen is picker  # still open: nothing was loaded
        assert any("not answering at 127.0.0.1:" in n for n in notes(app))
        await choose(pilot, picker, "gpu")
        assert app.screen is picker and any("no CUDA GPU" in n for n in notes(app))
        assert loader.loaded == ["spec"] and app.loading is None and app.profile.name == "spec"


async def test_picker_loads_a_profile_that_needs_a_download_after_saying_so(cpu_machine):
    loader = Loader({"spec": ScriptedBackend(["x"]), "plain": ScriptedBackend(["y"])})
    app = SpecChatApp("spec", loader=loader)
    async with app.run_test(size=(120, 40)) as pilot:
        picker = await open_picker(pilot, app)
        row = next(r for r in picker.rows if r.name == "plain")
        assert not row.refused and "specchat pull smollm2-135m-instruct" in row.why
        await choose(pilot, picker, "plain")
        await wait_until(pilot, lambda: app.profile is not None and app.profile.name == "plain" and app.loading is None,
                         what="plain loaded")
        assert any("specchat pull smollm2-135m-instruct" in n for n in notes(app))
        assert loader.loaded == ["spec", "plain"]


async def test_palette_checks_a_profile_as_the_picker_does(cpu_machine):
    """The command palette's "Profile: NAME" refuses, with the picker's reason, what cannot run now
    (a GPU profile here, a server that does not answer, a broken file) and loads what can."""
    from specchat.tui.app import ProfileCommands

    loader = Loader({"spec": ScriptedBackend(["x"]), "plain": ScriptedBackend(["y"]),
                     "gpu": ScriptedBackend(["never"]), "down": ScriptedBackend(["never"])})
    app = SpecChatApp("spec", loader=loader)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.profile is not None and app.loading is None, what="spec loaded")
        provider = ProfileCommands(app.screen)
        await provider.startup()
        items = {name: (title, help_) for title, help_, name in provider._items()}
        assert items["gpu"][0] == "Profile: gpu (needs a GPU)" and "no CUDA GPU" in items["gpu"][1]
        assert items["broken"][0] == "Profile: broken (broken)"
        hits = {str(h.text): h for h in [h async for h in provider.search("Profile: gpu")]}
        hits["Profile: gpu (needs a GPU)"].command()  # as choosing it in the palette does
        await wait_until(pilot, lambda: any("no CUDA GPU" in n for n in notes(app)), what="gpu refused")
        for name, why in (("down", "not answering at 127.0.0.1:"), ("broken", "speculativ")):
            app.choose_profile(name)
            await wait_until(pilot, lambda: any(why in n for n in notes(app)), what=f"{name} refused")
        assert loader.loaded == ["spec"] and app.profile.name == "spec" and app.loading is None
        app.choose_profile("plain")  # needs a download: said, then loaded
        await wait_until(pilot, lambda: app.profile.name == "plain" and app.loading is None, what="plain loaded")
        assert any("specchat pull smollm2-135m-instruct" in n for n in notes(app))
