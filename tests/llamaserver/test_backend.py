"""The llamaserver backend against a real llama-server on loopback."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from specchat.backends.base import BackendError, Request, Sampling, Step, Summary, run_to_summary
from specchat.backends.llamaserver.flags import speculation_args
from specchat.verify import judge_replies

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test may build llama-server

COPY = [{"role": "user", "content": "Repeat exactly, three times: the quick brown fox jumps over the lazy dog."}]
ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]
WIDE = [{"role": "user", "content": "Repeat exactly, twice: 日本語のテキスト、中文文本、한국어 🎉🚀"}]
NGRAM = speculation_args("ngram", depth=3, lookup=2)


@pytest.fixture(scope="module")
def plain(start):
    return start()


@pytest.fixture(scope="module")
def ngram(start):
    return start(NGRAM)


def test_streams_steps_then_one_summary_with_token_ids(plain):
    events = list(plain.stream(Request(messages=ASK), Sampling(max_tokens=24)))
    steps, last = events[:-1], events[-1]
    assert steps and all(isinstance(e, Step) for e in steps) and isinstance(last, Summary)
    assert last.token_ids == [t for s in steps for t in s.token_ids] and len(last.token_ids) == last.tokens
    assert last.text == "".join(s.text for s in steps) == plain.detokenize(last.token_ids)
    assert last.prompt_tokens == len(plain.tokenize_chat(ASK))
    assert last.passes == last.tokens and last.draft_tokens == 0  # target-only: one token a pass
    assert all(alt and alt[0][0] == t for alt, t in zip(last.alternatives, last.token_ids))


def test_target_only_greedy_reply_is_the_local_llamacpp_backends(plain, start, default_gguf):
    """One llama.cpp with the same kernels: the same tokens. On a CPU with AMX the binding's own
    build cannot use llama.cpp's extra buffers (its AMX kernel faults, llamaserver/build.py), so the
    server is compared with them off too; with them on, its AMX kernel rounds otherwise."""
    from specchat.backends.llamacpp import LlamaCppBackend, extra_buffers_work

    server = plain if extra_buffers_work(default_gguf) else start(repack=False)
    assert plain.caveat is None and (server.caveat is None) == server.settings.repack  # --no-repack says so
    local = LlamaCppBackend(default_gguf, context=2048, threads=2)
    try:
        for messages in (ASK, COPY):
            want = run_to_summary(local.stream(Request(messages=messages), Sampling(max_tokens=40)))
            got = run_to_summary(server.stream(Request(messages=messages), Sampling(max_tokens=40)))
            assert got.token_ids == want.token_ids and got.stop_reason == want.stop_reason
    finally:
        local.close()


def test_tokens_whose_text_ends_inside_a_character_are_counted(plain, default_gguf):
    """llama-server streams no chunk for a token whose text ends inside a UTF-8 character (the chunk
    that completes it names only its own id): such a reply counts every token, ends as the local
    llama.cpp's does, and leaves its ids out rather than give a list with gaps (compared by text)."""
    from specchat.backends.llamacpp import LlamaCppBackend

    local = LlamaCppBackend(default_gguf, context=2048, threads=2)
    try:
        want = run_to_summary(local.stream(Request(messages=WIDE), Sampling(max_tokens=48)))
    finally:
        local.close()
    got = run_to_summary(plain.stream(Request(messages=WIDE), Sampling(max_tokens=48)))
    assert any(ord(c) > 0x2000 for c in want.text)  # the reply does hold characters of several tokens
    assert got.token_ids == [] and got.alternatives == []  # some ids were withheld: none given
    assert (got.text, got.tokens, got.stop_reason) == (want.text, want.tokens, want.stop_reason)


def test_speculative_passes_and_metrics_are_consistent(ngram, plain):
    events = list(ngram.stream(Request(messages=COPY), Sampling(max_tokens=48)))
    steps, last = events[:-1], events[-1]
    assert last.spec_source == "llama-server /metrics" and last.drafts > 0
    assert 0 < last.accepted_tokens <= last.draft_tokens
    assert sum(s.drafted for s in steps) == last.draft_tokens
    assert sum(s.accepted for s in steps) == last.accepted_tokens
    # Every token is an accepted draft or its pass's own; a last pass may have ended in the
    # end-of-sequence token, which is not part of the reply.
    assert last.tokens + (last.stop_reason == "eos") in (last.passes + last.accepted_tokens,
                                                         last.passes + last.accepted_tokens + 1)
    assert all(len(s.token_ids) == s.accepted + 1 for s in steps[:-1])
    assert any(s.accepted >= 2 for s in steps)  # a copy prompt: passes of several tokens, streamed as such
    assert last.accepted_per_position[0] <= last.drafts_per_position[0]
    # llama.cpp verifies a draft in one batch, whose rounding differs from one-token passes: the
    # speculative reply may part from target-only's, but only where the reference's own reported
    # top-2 gap is a near-tie (on this prompt ' the' vs ' lazy' are 0.14 apart), as verify judges it.
    reference = run_to_summary(plain.stream(Request(messages=COPY), Sampling(max_tokens=48)))
    verdict = judge_replies(plain, Request(messages=COPY), reference, last, Sampling(max_tokens=48), other_backend=ngram)
    assert verdict.ok, verdict.line()


def test_cancel_stops_the_reply_and_the_server_serves_the_next(plain):
    cancel = threading.Event()
    steps = []
    for event in plain.stream(Request(messages=ASK), Sampling(max_tokens=200), cancel):
        if isinstance(event, Step):
            steps.append(event)
            if len(steps) == 3:
                cancel.set()
        else:
            summary = event
    assert summary.stop_reason == "cancelled" and summary.tokens <= 5
    again = run_to_summary(plain.stream(Request(messages=ASK), Sampling(max_tokens=8)))
    assert again.tokens == 8


def test_a_prompt_past_the_context_is_one_line(start):
    small = start(context=64)
    with pytest.raises(BackendError, match="context holds 64"):
        run_to_summary(small.stream(Request(messages=[{"role": "user", "content": "word " * 200}]), Sampling()))


def test_a_server_killed_mid_reply_is_one_line(start):
    backend = start()
    stream = backend.stream(Request(messages=ASK), Sampling(max_tokens=400))
    next(stream)
    server = subprocess.run(["pgrep", "-P", str(backend.process.keeper.pid)], capture_output=True, text=True)
    os.kill(int(server.stdout.split()[0]), signal.SIGKILL)
    with pytest.raises(BackendError, match="llama-server has stopped"):
        list(stream)
    with pytest.raises(BackendError, match="has stopped"):
        next(backend.stream(Request(messages=ASK), Sampling(max_tokens=4)))


def test_a_server_that_fails_to_start_says_why(start):
    with pytest.raises(BackendError, match=r"stopped while starting \(.*no-such-flag.*\).*log"):
        start(extra=("--no-such-flag",))


def test_a_missing_binary_is_one_line(start, tmp_path):
    with pytest.raises(BackendError, match="no llama-server at"):
        start(binary=tmp_path / "llama-server")


def test_a_port_already_taken_is_one_line(start):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(BackendError, match=f"port {s.getsockname()[1]} .* already taken"):
            start(port=s.getsockname()[1])


KEEPER_CHILD = r"""
import sys
from pathlib import Path
from specchat.backends.llamaserver.backend import LlamaServerBackend, LlamaServerSettings
b = LlamaServerBackend(Path(sys.argv[1]), LlamaServerSettings(Path(sys.argv[2]), "smollm2", context=256),
                       log=Path(sys.argv[3]))
print(b.process.keeper.pid, flush=True)
sys.stdin.read()
"""


def _gone(pid: int, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("victim", ["specchat", "keeper"])
def test_no_server_outlives_a_killed_specchat(server_binary, default_gguf, tmp_path, victim):
    child = subprocess.Popen([sys.executable, "-c", KEEPER_CHILD, str(server_binary), str(default_gguf),
                              str(tmp_path / "log")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        keeper = int(child.stdout.readline())
        server = int(subprocess.run(["pgrep", "-P", str(keeper)], capture_output=True, text=True).stdout.split()[0])
        os.kill(child.pid if victim == "specchat" else keeper, signal.SIGKILL)
        assert _gone(server), "llama-server outlived a SIGKILLed " + victim
    finally:
        child.kill()
        child.wait()


def test_close_leaves_no_process(start):
    backend = start()
    keeper = backend.process.keeper.pid
    server = int(subprocess.run(["pgrep", "-P", str(keeper)], capture_output=True, text=True).stdout.split()[0])
    backend.close()
    assert _gone(server, 10) and _gone(keeper, 10)
