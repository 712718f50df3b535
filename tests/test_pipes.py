"""specchat fed by pipes and files, as shells do: the REPL reads plain lines (no terminal warning,
no echo), and bytes that are not UTF-8 become a reply, not a traceback. Real processes on a tiny
model, torch and llama.cpp."""
import os
import subprocess
import sys

import pytest

from specchat.history import History
from tests.test_llamacpp import tiny_gguf


@pytest.fixture
def tiny_profiles(isolated_dirs):
    folder = isolated_dirs / "user-profiles"
    folder.mkdir(parents=True, exist_ok=True)
    tiny_gguf(folder)  # also writes the HF checkpoint it converts, in hf/
    common = "context: 256\nthreads: 2\nsampling: {max_tokens: 6}\n"
    (folder / "tiny-cpp.yaml").write_text("backend: llamacpp\nmodel: ./tiny.gguf\n" + common)
    (folder / "tiny-torch.yaml").write_text("backend: torch\nmodel: ./hf\n" + common)
    return folder


def specchat(args, stdin=None, input=None) -> subprocess.CompletedProcess:
    """`stdin`: a file to read from; `input`: bytes written into a pipe."""
    return subprocess.run([sys.executable, "-m", "specchat.cli", *args], stdin=stdin, input=input,
                          capture_output=True, timeout=300, env=dict(os.environ))


def saved_turns() -> list[tuple[str, str]]:
    history = History()
    (conv,) = history.list_conversations()
    return [(m.role, m.content) for m in history.load(conv.id).messages]


@pytest.mark.parametrize("profile", ["tiny-cpp", "tiny-torch"])
def test_the_repl_reads_a_pipe_as_plain_lines(tiny_profiles, profile):
    proc = specchat(["repl", "-p", profile], input=b"hi there\n/stats\nsecond question\n/exit\n")
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, err
    assert "not a terminal" not in out + err and "Traceback" not in err
    assert "hi there" not in out and "second question" not in out  # no echo of what was typed
    assert "tok/s" in out  # /stats answered
    turns = saved_turns()
    assert [r for r, _ in turns] == ["user", "assistant", "user", "assistant"]
    assert turns[0][1] == "hi there" and turns[2][1] == "second question"


def test_the_repl_reads_stdin_redirected_from_a_file(tiny_profiles, tmp_path):
    script = tmp_path / "prompts.txt"
    script.write_bytes(b"first\nsecond\n")  # no /exit: the end of the file ends the session
    with script.open("rb") as f:
        proc = specchat(["repl", "-p", "tiny-torch"], f)
    assert proc.returncode == 0, proc.stderr.decode()
    assert [c for r, c in saved_turns() if r == "user"] == ["first", "second"]


@pytest.mark.parametrize("profile", ["tiny-cpp", "tiny-torch"])
def test_bytes_that_are_not_utf8_are_replaced_and_said(tiny_profiles, profile, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hi \xff\x00 there")
    with bad.open("rb") as f:
        proc = specchat(["run", "-p", profile, "--json"], f)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert "not valid UTF-8" in err and "Traceback" not in err and err.count("\n") == 1
    assert b'"tokens": ' in proc.stdout
