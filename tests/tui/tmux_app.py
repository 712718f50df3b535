"""Launch the real TUI on a scripted backend, for the tmux end-to-end test."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specchat.tui.app import SpecChatApp  # noqa: E402
from tests.scripted import ScriptedBackend  # noqa: E402

REPLY = "Drafts are **checked** by the target.\n\n```python\nprint('ok')\n```\n\nDone."


def loader(profile):
    return ScriptedBackend([REPLY], accept=[2, 1], delay=0.02)


if __name__ == "__main__":
    SpecChatApp(sys.argv[1], loader=loader).run()
