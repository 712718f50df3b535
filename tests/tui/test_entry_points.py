"""`specchat chat/ab/repl` with a bad profile: one line on stderr, exit 2, no traceback."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [["chat", "-p", "nosuch"], ["ab", "-p", "nosuch"], ["repl", "-p", "nosuch"],
                                  ["ab", "-p", "spec", "-r", "broken"]])
def test_bad_profile_is_one_line(profiles_dir, argv):
    r = subprocess.run([sys.executable, "-m", "specchat.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specchat: error: "), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
