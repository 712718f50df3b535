"""Time to the chat's first paint, as a user meets it: `specchat` started in a tmux pane (the
terminal a person has), the pane read every 10 ms until the chat's prompt box shows, then until the
chat says the profile is loaded. Median and range of several starts.

    python scripts/tui_first_paint.py [--runs 5] [-p PROFILE]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

SESSION = "specchat-first-paint"


def pane() -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", SESSION], capture_output=True, text=True).stdout


def one_start(profile: str) -> tuple[float, float]:
    """(seconds to the first paint of the chat, seconds until its status bar shows the profile loaded)."""
    subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    started = time.perf_counter()
    subprocess.run(["tmux", "new-session", "-d", "-s", SESSION, "-x", "120", "-y", "30",
                    f"{sys.executable} -m specchat.cli chat -p {profile}"], check=True)
    painted = loaded = None
    while time.perf_counter() - started < 60 and loaded is None:
        screen = pane()
        now = time.perf_counter() - started
        if painted is None and "▔" in screen:  # the prompt box's frame: the chat's first paint
            painted = now
        if painted is not None and "profile loaded" in screen:  # the chat's notice once the model is in
            loaded = now
        time.sleep(0.01)
    subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    if painted is None or loaded is None:
        raise SystemExit(f"the chat did not paint within 60 s:\n{pane()}")
    return painted, loaded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--profile", default="smollm2")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    one_start(args.profile)  # the files warm in the page cache
    rows = [one_start(args.profile) for _ in range(args.runs)]
    for name, column in zip(("first paint", "profile loaded"), zip(*rows)):
        print(f"{name:15} {statistics.median(column):.2f} s ({min(column):.2f}-{max(column):.2f})")


if __name__ == "__main__":
    main()
