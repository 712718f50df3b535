"""End to end in a real terminal (tmux): the scripted backend always, the real default model
when its backend runs on this machine. Skips cleanly without tmux."""
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


class Tmux:
    def __init__(self, cmd: str, env: dict, size=(100, 30)):
        self.name = f"specchat-e2e-{uuid.uuid4().hex[:8]}"
        exports = " ".join(f"{k}={v}" for k, v in env.items())
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", str(size[0]), "-y", str(size[1]),
                        f"cd {ROOT} && env {exports} {cmd}; sleep 30"], check=True)

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-t", self.name, "-p"], capture_output=True,
                              text=True).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def wait_for(self, text: str, timeout: float = 20.0) -> str:
        end = time.time() + timeout
        while time.time() < end:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{text!r} never appeared; screen was:\n{self.screen()}")

    def wait_gone(self, text: str, timeout: float = 10.0) -> None:
        end = time.time() + timeout
        while time.time() < end:
            if text not in self.screen():
                return
            time.sleep(0.2)
        raise AssertionError(f"{text!r} is still on screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def _env(tmp_path, profiles: dict | None = None) -> dict:
    env = {"SPECCHAT_DATA_DIR": tmp_path / "data", "SPECCHAT_CONFIG_DIR": tmp_path / "config",
           "SPECCHAT_PROFILES_DIR": tmp_path / "profiles", "TERM": "xterm-256color"}
    (tmp_path / "profiles").mkdir(exist_ok=True)
    for name, text in (profiles or {}).items():
        (tmp_path / "profiles" / f"{name}.yaml").write_text(text)
    if os.environ.get("SPECCHAT_CACHE_DIR"):
        env["SPECCHAT_CACHE_DIR"] = os.environ["SPECCHAT_CACHE_DIR"]
    return {k: str(v) for k, v in env.items()}


def test_tmux_chat_on_scripted_backend(tmp_path):
    env = _env(tmp_path, {"spec": "backend: torch\nmodel: smollm2-135m-instruct\nspeculative:\n  method: ngram\n"})
    t = Tmux(f"{sys.executable} tests/tui/tmux_app.py spec", env)
    try:
        t.wait_for("ngram d=4")
        t.keys("hello there", "Enter")
        screen = t.wait_for(" tok · TTFT")  # the closing note under the finished reply
        assert "tok/pass" in screen and "hello there" in screen and "checked" in screen and "print('ok')" in screen
        t.keys("F3")
        t.wait_for("sequential: timings don't contend")
        t.keys("Escape")
        t.wait_gone("sequential")
        t.keys("C-q")
        t.wait_gone("ngram d=4")  # the app quit and gave the terminal back
    finally:
        t.close()
    from specchat.history import History

    os.environ["SPECCHAT_DATA_DIR"] = env["SPECCHAT_DATA_DIR"]
    [conv] = History().list_conversations()
    assert conv.messages == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tmux_chat_on_real_default_model(tmp_path):
    """The real `specchat chat` on the default model (8-token replies to stay quick)."""
    env = _env(tmp_path, {"tiny": "extends: smollm2\nsampling:\n  max_tokens: 8\n"})
    t = Tmux(f"{sys.executable} -m specchat.cli chat -p tiny", env)
    try:
        t.wait_for("tiny · torch · target-only", timeout=240)
        t.keys("Say hello in five words.", "Enter")
        screen = t.wait_for(" tok · TTFT", timeout=240)  # the reply's closing note
        assert "Say hello in five words." in screen and "tok/s" in screen
        t.keys("C-q")
        t.wait_gone("tiny · torch")
    finally:
        t.close()
