"""The chat and suffix decoding's memory: earlier replies in at load, finished replies in as they
are saved, a regenerated one out; each source's drafts in a colour of its own (Ctrl+T)."""
import pytest

from specchat.backends.base import Step
from specchat.backends.speculative.suffix import SuffixIndex
from specchat.history import History
from specchat.tui.app import SpecChatApp
from specchat.tui.widgets import SOURCE_STYLES, AssistantMessage, draft_sources
from tests.scripted import ScriptedBackend, piece_id, pieces_of
from tests.tui.conftest import REPLY, Loader, wait_until
from tests.tui.test_chat import ready, send

class RememberingBackend(ScriptedBackend):
    """A scripted backend with a suffix memory, as SpeculativeBackend has for method suffix."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.memory = SuffixIndex()

    def tokenize_many(self, texts) -> list[list[int]]:
        return [[piece_id(p) for p in pieces_of(text)] for text in texts]


def remembered(backend) -> list[str]:
    return [backend.detokenize(backend.memory.sequence(key)) for key in backend.memory.spans]


@pytest.mark.asyncio
async def test_memory_warms_at_load_learns_replies_and_forgets_a_regenerated_one(profiles_dir):
    history = History()
    earlier = history.new_conversation("spec")
    history.add_message(earlier, "user", "hi")
    history.add_message(earlier, "assistant", "an earlier reply")
    backend = RememberingBackend([REPLY, "a second try"], accept=[2, 0])
    app = SpecChatApp("spec", loader=Loader({"spec": backend}), history=history)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await wait_until(pilot, lambda: remembered(backend) == ["an earlier reply"], what="memory warmed")
        await send(pilot, "hi there")
        await wait_until(pilot, lambda: not app.chat.generating and app.conv.last_reply, what="reply")
        assert remembered(backend) == ["an earlier reply", REPLY]
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: app.conv.last_reply == "a second try" and not app.chat.generating,
                         what="regenerated")
        assert remembered(backend) == ["an earlier reply", "a second try"]
        assert list(backend.memory.spans)[-1] == (app.conv.id, app.conv.ids[-1])


class SourcedBackend(RememberingBackend):
    """Each drafted pass says who guessed: suffix, then history, in turn."""

    def stream(self, request, sampling, cancel=None):
        for n, ev in enumerate(super().stream(request, sampling, cancel)):
            if isinstance(ev, Step) and ev.drafted:
                ev.source = ("suffix", "history")[n % 2]
            yield ev


@pytest.mark.asyncio
async def test_token_colours_and_status_bar_tell_the_sources_apart(profiles_dir):
    (profiles_dir / "sfx.yaml").write_text("backend: torch\nmodel: smollm2-135m-instruct\n"
                                          "speculative:\n  method: suffix\n  depth: 4\n")
    backend = SourcedBackend([REPLY], accept=[2])
    app = SpecChatApp("sfx", loader=Loader({"sfx": backend}), history=False)
    async with app.run_test(size=(160, 30)) as pilot:
        await ready(pilot, app)
        await pilot.press("ctrl+t")
        await send(pilot, "x")
        await wait_until(pilot, lambda: app.conv.last_reply == REPLY and not app.chat.generating, what="reply")
        msg = app.chat.query(AssistantMessage).last()
        assert {source for _, _, source in msg.tokens.spans} == {"suffix", "history"}
        styles = {span.style for span in msg.tokens.content().spans}
        assert styles == {SOURCE_STYLES["suffix"], SOURCE_STYLES["history"]}
        status = str(app.chat.query_one("#status-text").render())
        live = app.chat.live.accepted_by_source
        assert live["suffix"] > 0 and live["history"] > 0
        assert f"■ suffix {live['suffix']}" in status and f"■ suffix: earlier replies {live['history']}" in status
        assert "suffix memory 1 earlier reply" in status  # the reply just finished joined the memory


def test_draft_sources_follow_the_profile():
    from specchat.profiles import load_profiles

    ps = load_profiles()
    assert draft_sources(ps.get("smollm2-suffix")) == ("suffix", "history")
    assert draft_sources(ps.get("smollm2-ngram")) == ("ngram",)
    assert draft_sources(ps.get("smollm2-mtp-lookup")) == ("lookup", "mtp")
    mtp_suffix = ps.get("smollm2-mtp").with_overrides({"speculative.suffix.first": 4, "speculative.suffix.history": False})
    assert draft_sources(mtp_suffix) == ("suffix", "mtp")
    assert draft_sources(ps.get("smollm2")) == ()
