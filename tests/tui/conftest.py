import asyncio
import os
from pathlib import Path

import pytest

from specchat.backends.base import BackendError
from specchat.tui.ab_screen import ABScreen

PROFILES = {
    "spec": "backend: torch\nmodel: smollm2-135m-instruct\nspeculative:\n  method: ngram\n  depth: 4\n",
    "plain": "backend: torch\nmodel: smollm2-135m-instruct\n",
    "broken": "backend: torch\nmodel: smollm2-135m-instruct\nspeculativ: {}\n",
    "noload": "backend: torch\nmodel: smollm2-135m-instruct\n",
}

REPLY = "Speculative decoding drafts cheap tokens and the target checks them in one pass."


@pytest.fixture
def profiles_dir(isolated_dirs):
    d = Path(os.environ["SPECCHAT_PROFILES_DIR"])
    d.mkdir(parents=True, exist_ok=True)
    for name, text in PROFILES.items():
        (d / f"{name}.yaml").write_text(text)
    return d


class Loader:
    """Backends by profile name; `noload` fails like a missing model would."""

    def __init__(self, backends: dict):
        self.backends = backends
        self.loaded: list[str] = []

    def __call__(self, profile):
        self.loaded.append(profile.name)
        if profile.name == "noload":
            raise BackendError("model file not found: /nowhere/model.gguf (run `specchat pull`)")
        b = self.backends.get(profile.name)
        if b is None:
            raise BackendError(f"no scripted backend for {profile.name}")
        return b() if callable(b) else b


async def wait_until(pilot, predicate, timeout: float = 30.0, what: str = "condition"):
    """Poll until predicate() holds. The timeout only bounds a real failure: a 2-core machine under
    load (the whole suite running) once took over 5 s to open the A/B screen."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


def ab_open(app, ready: bool = False) -> bool:
    """The A/B screen is up with its widgets (it is pushed before it is composed, and a loaded
    suite once failed a query in between) and, with `ready`, its backends are loaded."""
    s = app.screen
    return (isinstance(s, ABScreen) and s.is_mounted and bool(s.query("#ab-prompt")) and bool(s.query("#ab-mode"))
            and (s.ready or not ready))
