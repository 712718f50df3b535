"""The chat and suffix decoding's memory: earlier replies in at load, finished replies in as they
are saved, a regenerated one out; each source's drafts in a colour of its own (Ctrl+T)."""
import pytest

from specchat.backends.speculative.suffix import SuffixIndex
from specchat.history import History
from specchat.tui.app import SpecChatApp
from tests.scripted import ScriptedBackend, piece_id, pieces_of
from tests.tui.conftest import REPLY, Loader, wait_until
from tests.tui.test_chat import ready, send

pytestmark = pytest.mark.asyncio


class RememberingBackend(ScriptedBackend):
    """A scripted backend with a suffix memory, as SpeculativeBackend has for method suffix."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.memory = SuffixIndex()

    def tokenize(self, text: str) -> list[int]:
        return [piece_id(p) for p in pieces_of(text)]


def remembered(backend) -> list[str]:
    return [backend.detokenize(backend.memory.sequence(key)) for key in backend.memory.spans]


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
