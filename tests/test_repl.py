"""The line REPL through prompt-toolkit's pipe input and DummyOutput."""
import io
import json
import os
import signal
import threading
from pathlib import Path

import pytest
from prompt_toolkit.document import Document
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from specchat.backends.base import BackendError
from specchat.history import History
from specchat.repl import Repl
from tests.scripted import ScriptedBackend

PROFILES = {
    "spec": "backend: torch\nmodel: smollm2-135m-instruct\nspeculative:\n  method: ngram\n",
    "plain": "backend: torch\nmodel: smollm2-135m-instruct\n",
    "broken": "backend: torch\nmodel: x\nbogus: 1\n",
}


@pytest.fixture
def profiles(isolated_dirs):
    d = Path(os.environ["SPECCHAT_PROFILES_DIR"])
    d.mkdir(parents=True, exist_ok=True)
    for name, text in PROFILES.items():
        (d / f"{name}.yaml").write_text(text)


def make(backends, lines):
    def loader(profile):
        b = backends.get(profile.name)
        if b is None:
            raise BackendError(f"cannot load {profile.name}")
        return b
    inp_cm = create_pipe_input()
    inp = inp_cm.__enter__()
    inp.send_text(lines)
    out = io.StringIO()
    repl = Repl("spec", loader=loader, input=inp, output=DummyOutput(), out=out)
    return repl, out, inp_cm


def run(backends, lines):
    repl, out, cm = make(backends, lines)
    try:
        rc = repl.run()
    finally:
        cm.__exit__(None, None, None)
    return repl, out.getvalue(), rc


def test_chat_turns_stream_and_history(profiles):
    spec = ScriptedBackend(["Hello there.", "Second."], accept=[1])
    repl, out, rc = run({"spec": spec}, "hi\nmore\n/stats\n/exit\n")
    assert rc == 0
    assert "Hello there.\n" in out and "Second.\n" in out
    assert "tok/pass" in out  # /stats of a speculative reply
    assert [m["content"] for m in spec.requests[-1].messages] == ["hi", "Hello there.", "more"]
    saved = History().load(repl.conv.id)
    assert [m.content for m in saved.messages] == ["hi", "Hello there.", "more", "Second."]
    hist = Path(os.environ["SPECCHAT_DATA_DIR"]) / "repl_history"
    assert "more" in hist.read_text()  # the prompt history file lives at an absolute data path


def test_ctrl_d_exits(profiles):
    _, out, rc = run({"spec": ScriptedBackend(["x"])}, "\x04")
    assert rc == 0


def test_profile_switch_errors_keep_previous(profiles):
    spec, plain = ScriptedBackend(["from spec"]), ScriptedBackend(["from plain"])
    repl, out, _ = run({"spec": spec, "plain": plain},
                       "/profile broken\n/profile nosuch\nq\n/profile plain\nq2\n/exit\n")
    lines = [l for l in out.splitlines() if l.startswith("error:")]
    assert len(lines) == 2 and all("still on spec" in l for l in lines)
    assert "bogus" in lines[0] and "no profile named 'nosuch'" in lines[1]
    assert "from spec" in out and "from plain" in out
    assert [m["content"] for m in plain.requests[-1].messages] == ["q", "from spec", "q2"]


def test_ab_and_verify_print_verdicts(profiles):
    spec = ScriptedBackend(["the cat sat", "a b c"], accept=[1])
    ref = ScriptedBackend(["the cat sat", "a x c"])
    repl, out, _ = run({"spec": spec, "spec:target-only": ref}, "one\n/verify\n/ab\ntwo\n/exit\n")
    verdicts = [l for l in out.splitlines() if l.startswith("verdict:")]
    assert verdicts[0].startswith("verdict: identical (3 tokens)")
    assert verdicts[1].startswith("verdict: mismatch at token 1") and "' x'" in verdicts[1]
    assert "── reference (spec:target-only) ──" in out


def test_system_clear_save(profiles, tmp_path):
    spec = ScriptedBackend(["ok"])
    target = tmp_path / "out.md"
    repl, out, _ = run({"spec": spec}, f"/system Be brief.\nq\n/save {target}\n/clear\n/bogus\n/exit\n")
    assert spec.requests[0].messages[0] == {"role": "system", "content": "Be brief."}
    assert "## User\n\nq" in target.read_text()
    assert repl.conv.messages == []
    assert "error: unknown command /bogus" in out


def test_slash_completion_uses_whole_words(profiles):
    repl, _, cm = make({"spec": ScriptedBackend(["x"])}, "")
    try:
        comp = repl.session.completer
        got = [c.text for c in comp.get_completions(Document("/pr"), None)]
        assert got == ["/profile"]
        got = [c.text for c in comp.get_completions(Document("/profile pl"), None)]
        assert got == ["plain"]
    finally:
        cm.__exit__(None, None, None)


def test_ctrl_c_stops_reply_and_stays(profiles):
    long = " ".join(f"w{i}" for i in range(300))
    spec = ScriptedBackend([long, "after"], delay=0.01)
    repl, out, cm = make({"spec": spec}, "")
    # Ctrl-C as in a fresh `specchat repl` process: Python's own handler (a Textual app run earlier in
    # this test process leaves SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert repl.load("spec")
        # a real SIGINT (not _thread.interrupt_main) also wakes a main thread blocked in a wait
        timer = threading.Timer(0.15, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        repl.ask("go")
        timer.join()
        kept = repl.conv.last_reply
        assert kept and long.startswith(kept) and len(kept) < len(long)
        assert "[stopped: the reply so far is kept]" in out.getvalue()
        repl.ask("next")  # still usable
        assert repl.conv.last_reply == "after"
    finally:
        signal.signal(signal.SIGINT, previous)
        cm.__exit__(None, None, None)


def test_a_conversation_that_outgrows_the_context_keeps_answering(profiles):
    reply = "a reply of exactly ten words to every single question asked"
    spec = ScriptedBackend([reply], context=160)
    questions = [f"question number {i} asks about something else entirely" for i in range(40)]
    repl, out, rc = run({"spec": spec}, "".join(q + "\n" for q in questions) + "/exit\n")
    assert rc == 0 and "error" not in out
    assert out.count(reply) == 40  # every turn answered
    notes = [line for line in out.splitlines() if "left out" in line]
    assert notes and all("history keeps them" in n for n in notes)
    assert len(notes) < 20  # the cut leaves room for several turns, not one
    for request in spec.requests:  # every prompt fit, with the newest question last
        assert len(spec.prompt_ids(request)) + 40 <= 160
    assert spec.requests[-1].messages[-1]["content"] == questions[-1]
    saved = History().load(repl.conv.id).messages
    assert len(saved) == 80 and saved[0].content == questions[0]  # history keeps everything


def test_a_message_too_long_for_the_context_is_refused_and_does_not_stay(profiles):
    spec = ScriptedBackend(["short answer"], context=64)
    repl, out, rc = run({"spec": spec}, "hello\n" + "word " * 80 + "\nhello again\n/exit\n")
    assert rc == 0
    (refusal,) = [line for line in out.splitlines() if line.startswith("error:")]
    assert "this message is" in refusal and "64-token context" in refusal
    assert [m["content"] for m in repl.conv.messages] == ["hello", "short answer", "hello again", "short answer"]
    assert [m.content for m in History().load(repl.conv.id).messages] == [
        "hello", "short answer", "hello again", "short answer"]


def test_a_turn_that_fails_does_not_stay(profiles):
    spec = ScriptedBackend(["x"], fail_with="the server went away")
    repl, out, rc = run({"spec": spec}, "hello\n/exit\n")
    assert "error: the server went away" in out and repl.conv.messages == []


def test_schema_sets_shows_and_clears_the_constraint_every_reply_carries(profiles, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text('{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}')
    spec = ScriptedBackend(['{"name": "Ann"}'])
    lines = f"/schema\n/schema {schema}\nfirst\n/schema\n/schema off\nsecond\n/regex [a-z]+\nthird\n/exit\n"
    repl, out, rc = run({"spec": spec}, lines)
    assert rc == 0
    first, second, third = spec.requests[-3:]
    assert first.constraint.kind == "json_schema" and first.constraint.origin == str(schema)
    assert json.loads(first.constraint.text)["required"] == ["name"]
    assert second.constraint is None
    assert third.constraint.kind == "regex" and third.constraint.text == "[a-z]+"
    assert "[no constraint: replies are free]" in out
    assert "[constraint on: every reply keeps the JSON schema person.json]" in out
    assert f"[constraint: JSON schema {schema} (set in this session)]" in out
    assert "[constraint off (JSON schema person.json no longer applies): replies are free]" in out
    assert "· regex '[a-z]+'" in repl.toolbar()


@pytest.mark.parametrize("command, says", [
    ("/schema {missing}", "error: {missing}: no such JSON schema file"),
    ("/schema {bad}", "error: {bad}: not valid JSON (line 1, column 2"),
    ("/regex (", "error: --regex '(': "),
])
def test_a_constraint_that_cannot_be_used_is_one_line_and_the_one_before_stays(profiles, tmp_path, command, says):
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    paths = {"missing": tmp_path / "none.json", "bad": bad}
    spec = ScriptedBackend(["fine"])
    _, out, _ = run({"spec": spec}, f"/regex a+\n{command.format(**paths)}\nhi\n/exit\n")
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(says.format(**paths))
    assert spec.requests[-1].constraint.text == "a+"


def test_a_constraint_given_at_start_is_kept_and_shown(profiles):
    from specchat.backends.base import Constraint

    spec = ScriptedBackend(["yes"])
    inp_cm = create_pipe_input()
    inp = inp_cm.__enter__()
    inp.send_text("hi\n/exit\n")
    out = io.StringIO()
    try:
        Repl("spec", loader=lambda p: spec, input=inp, output=DummyOutput(), out=out,
             constraint=Constraint("regex", "yes|no", "--regex 'yes|no'")).run()
    finally:
        inp_cm.__exit__(None, None, None)
    assert spec.requests[-1].constraint.text == "yes|no"
    assert "[constraint: regex --regex 'yes|no' (set in this session)]" in out.getvalue()


def test_a_profile_constraint_applies_until_schema_off_and_a_broken_one_is_one_line(profiles, tmp_path):
    import os

    d = Path(os.environ["SPECCHAT_PROFILES_DIR"])
    (tmp_path / "yn.json").write_text('{"type": "string", "enum": ["yes", "no"]}')
    (d / "spec.yaml").write_text(PROFILES["spec"] + f"constraint:\n  json_schema: {tmp_path / 'yn.json'}\n")
    (d / "plain.yaml").write_text(PROFILES["plain"] + f"constraint:\n  json_schema: {tmp_path / 'gone.json'}\n")
    spec, plain = ScriptedBackend(['"yes"']), ScriptedBackend(["x"])
    repl, out, _ = run({"spec": spec, "plain": plain}, "one\n/profile plain\nthree\n/schema off\nfour\n/exit\n")
    assert spec.requests[0].constraint.origin == str(tmp_path / "yn.json")
    assert f"[constraint: JSON schema {tmp_path / 'yn.json'} (profile 'spec')]" in out
    # plain's file is gone: said at load and when a turn needs it (the turn refused, not sent free)
    assert f"[the profile's constraint cannot be read: {tmp_path / 'gone.json'}: no such JSON schema file]" in out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {tmp_path / 'gone.json'}: no such JSON schema file"]
    assert len(plain.requests) == 1 and plain.requests[0].constraint is None  # "four", after /schema off
    assert [m["content"] for m in plain.requests[0].messages if m["role"] == "user"] == ["one", "four"]
