"""The chat and the A/B view with a remote profile, on the real loopback server (Textual's pilot)."""
import os
from pathlib import Path

import pytest

from specchat.backends.base import NO_SPEC_METRICS
from specchat.tui.app import SpecChatApp
from tests.tui.conftest import ab_open, wait_until

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


@pytest.fixture
def profiles(isolated_dirs, llama_server):
    """`remote`: the loopback server; `local`: the same GGUF on the local llama.cpp backend."""
    d = Path(os.environ["SPECCHAT_PROFILES_DIR"])
    d.mkdir(parents=True, exist_ok=True)
    (d / "remote.yaml").write_text(f"extends: smollm2-server\nserver: {{base_url: {llama_server.base_url}}}\n"
                                   "sampling: {max_tokens: 12}\n")
    (d / "local.yaml").write_text("extends: smollm2-llamacpp\ncontext: 2048\nthreads: 1\nsampling: {max_tokens: 12}\n")
    return d


async def send(pilot, selector, text):
    pilot.app.screen.query_one(selector).text = text
    await pilot.click(selector)
    await pilot.press("enter")


async def test_chat_on_a_remote_profile_says_the_server_reports_no_speculation(profiles):
    app = SpecChatApp("remote", history=False)
    async with app.run_test(size=(110, 30)) as pilot:
        await wait_until(pilot, lambda: app.backend is not None and app.loading is None, timeout=30, what="loaded")
        await send(pilot, "#prompt", "What is the capital of France?")
        chat = app.chat
        await wait_until(pilot, lambda: not chat.generating and app.conv.last_reply, timeout=60, what="reply")
        status = str(chat.query_one("#status-text").render())
        assert "openai · server-side" in status and NO_SPEC_METRICS in status and "tok/s" in status
        assert app.conv.last_reply.strip()


async def test_ab_remote_against_local_engine_compares_by_text(profiles):
    app = SpecChatApp("remote", ab_reference="local", start_ab=True, history=False)
    async with app.run_test(size=(140, 34)) as pilot:
        await wait_until(pilot, lambda: ab_open(app, ready=True), timeout=60,
                         what="A/B ready")
        ab = app.screen
        await send(pilot, "#ab-prompt", "What is the capital of France?")
        await wait_until(pilot, lambda: ab.verdict is not None, timeout=90, what="verdict")
        v = ab.verdict
        assert v.kind == "identical" and v.by == "text" and v.compared > 10
        spec, ref = ab.panes["spec"], ab.panes["ref"]
        assert spec.summary.text == ref.summary.text and ref.summary.token_ids  # ids on the local side only
        assert NO_SPEC_METRICS in str(spec.query_one(".ab-stats").render())
        assert "remote" in str(spec.query_one(".ab-title").render())
        assert "identical" in str(ab.query_one("#ab-verdict").render())
