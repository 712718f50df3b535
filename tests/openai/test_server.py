"""The openai backend against a real server on loopback: llama-cpp-python's OpenAI-compatible
server on the default GGUF (started once per session by the `llama_server` fixture)."""
import json
import logging
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from specchat.backends.base import NO_SPEC_METRICS, BackendError, Request, Sampling, Step, Summary, run_to_summary
from specchat.backends.llamacpp import LlamaCppBackend
from specchat.backends.openai import OpenAIBackend
from specchat.live import Failed, pump
from specchat.profiles import load_profiles
from specchat.paths import cache_dir
from tests.openai.servers import MODEL, ROOT, LlamaCppServer, free_port

pytestmark = pytest.mark.slow  # the real default model

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
STORY = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]


def remote(server, logprobs=False, **kw) -> OpenAIBackend:
    """llama-cpp-python's logprobs cost ~0.1-0.4 s a token on this machine and give no ids:
    off, as in the shipped profile, except where a test is about them."""
    backend = OpenAIBackend(server.base_url, MODEL, logprobs=logprobs, **kw)
    backend.check_server()
    return backend


@pytest.fixture(scope="module")
def local(default_gguf):
    backend = LlamaCppBackend(default_gguf, context=2048, threads=1, cache_dir=cache_dir())  # see LlamaCppServer: one thread is faster here
    yield backend
    backend.close()


def test_streams_a_reply(llama_server):
    backend = remote(llama_server)
    events = list(backend.stream(Request(messages=CHAT), Sampling(max_tokens=24)))
    steps, summary = events[:-1], events[-1]
    assert all(isinstance(e, Step) for e in steps) and isinstance(summary, Summary)
    assert "Paris" in summary.text and summary.text == "".join(s.text for s in steps)
    assert summary.tokens == len(steps) and summary.stop_reason in ("eos", "max_tokens")
    assert summary.ttft_s > 0 and summary.decode_tok_s > 0
    # no ids from this server, and nothing about speculation: unknown, not zero
    assert summary.token_ids == [] and not summary.spec_reported and summary.drafts == 0


def test_logprobs_count_tokens_where_the_server_gives_no_ids(llama_server):
    events = list(remote(llama_server, logprobs=True).stream(Request(messages=CHAT), Sampling(max_tokens=4)))
    assert [e.token_count for e in events[:-1]] == [1, 1, 1, 1] and events[-1].tokens == 4
    assert events[-1].token_ids == []


def test_greedy_reply_matches_local_llamacpp_token_for_token(llama_server, local):
    backend = remote(llama_server)
    for messages in (CHAT, STORY):
        sampling = Sampling(max_tokens=32)
        ours = run_to_summary(local.stream(Request(messages=messages), sampling))
        events = list(backend.stream(Request(messages=messages), sampling))
        # this server streams one token per chunk
        server_tokens = [e.text for e in events[:-1]]
        assert server_tokens == [local.detokenize([t]) for t in ours.token_ids]
        assert events[-1].text == ours.text and events[-1].stop_reason == ours.stop_reason


def test_cancel_mid_reply_then_the_next_reply_is_whole(llama_server):
    backend = remote(llama_server)
    cancel = threading.Event()
    got = []
    for ev in backend.stream(Request(messages=STORY), Sampling(max_tokens=200), cancel):
        if isinstance(ev, Step):
            got.append(ev)
            if len(got) == 3:
                cancel.set()
        else:
            summary = ev
    assert summary.stop_reason == "cancelled" and summary.tokens == 3
    after = run_to_summary(backend.stream(Request(messages=CHAT), Sampling(max_tokens=5)))
    again = run_to_summary(backend.stream(Request(messages=CHAT), Sampling(max_tokens=5)))
    assert after.tokens == 5 and after.text == again.text


def test_closing_the_generator_closes_the_stream(llama_server):
    backend = remote(llama_server)
    gen = backend.stream(Request(messages=STORY), Sampling(max_tokens=200))
    next(gen)
    gen.close()
    assert run_to_summary(backend.stream(Request(messages=CHAT), Sampling(max_tokens=4))).tokens == 4


def test_a_reply_the_server_breaks_off_is_an_error_and_the_next_one_works(llama_server):
    backend = remote(llama_server)
    too_long = [{"role": "user", "content": " ".join(f"word{i} is here." for i in range(700))}]
    with pytest.raises(BackendError, match="ended the reply without finishing it"):
        list(backend.stream(Request(messages=too_long), Sampling(max_tokens=4)))
    assert run_to_summary(backend.stream(Request(messages=CHAT), Sampling(max_tokens=4))).tokens == 4


def test_wrong_port_and_wrong_model_are_one_clear_line(llama_server):
    with pytest.raises(BackendError) as e:
        remote(type("S", (), {"base_url": f"http://127.0.0.1:{free_port()}/v1"})())
    msg = str(e.value)
    assert "cannot connect" in msg and "connection refused" in msg and "\n" not in msg
    with pytest.raises(BackendError, match="serves 'smollm2-135m-instruct', not 'gpt-5'"):
        OpenAIBackend(llama_server.base_url, "gpt-5").check_server()
    with pytest.raises(BackendError, match="not found \\(HTTP 404\\).*/v1"):
        OpenAIBackend(llama_server.base_url[:-3] + "/nope", MODEL).check_server()


def test_api_key_from_the_environment_wrong_key_and_never_shown(default_gguf, tmp_path, monkeypatch, caplog):
    key, wrong = "sk-test-3f9a1c77e2", "sk-wrong-0000"
    server = LlamaCppServer(default_gguf, tmp_path, api_key_env="SERVER_KEY", env={"SERVER_KEY": key})
    caplog.set_level(logging.DEBUG)
    try:
        monkeypatch.setenv("SPECCHAT_TEST_KEY", wrong)
        profile = load_profiles().get("smollm2-server").with_overrides(
            {"server.base_url": server.base_url, "server.api_key_env": "SPECCHAT_TEST_KEY"}, max_tokens=6)
        from specchat.loading import load_backend

        with pytest.raises(BackendError) as e:
            load_backend(profile)
        assert "refused the API key (HTTP 401)" in str(e.value) and "$SPECCHAT_TEST_KEY" in str(e.value)
        monkeypatch.delenv("SPECCHAT_TEST_KEY")
        with pytest.raises(BackendError, match=r"SPECCHAT_TEST_KEY, which is not set: export SPECCHAT_TEST_KEY="):
            load_backend(profile)
        monkeypatch.setenv("SPECCHAT_TEST_KEY", key)
        backend = load_backend(profile)
        s = run_to_summary(backend.stream(Request(messages=CHAT), Sampling(max_tokens=6)))
        assert s.tokens == 6
        shown = " ".join([repr(backend), repr(backend.conn), repr(backend.conn.client.headers), str(e.value),
                          caplog.text, profile.model_dump_json()])
        assert key not in shown and wrong not in shown
        with pytest.raises(BackendError) as e:  # no key at all
            OpenAIBackend(server.base_url, MODEL).check_server()
        assert "the server wants a key: name the environment variable" in str(e.value)
    finally:
        server.stop()


def test_server_killed_mid_reply_is_one_line_and_the_session_goes_on(default_gguf, tmp_path):
    server = LlamaCppServer(default_gguf, tmp_path)
    try:
        backend = remote(server)
        out: "queue.Queue" = queue.Queue()
        events = backend.stream(Request(messages=STORY), Sampling(max_tokens=400))
        first = next(events)
        assert isinstance(first, Step)
        server.kill()
        with pytest.raises(BackendError) as e:
            list(events)
        msg = str(e.value)
        assert "closed the connection mid-reply" in msg and "crashed" in msg and "\n" not in msg
        # the front ends' feeder turns it into one line for the user, and stays usable
        assert pump(backend, Request(messages=CHAT), Sampling(max_tokens=4), threading.Event(), out) is None
        item = out.get_nowait()
        assert isinstance(item.event, Failed) and "cannot connect" in item.event.message
    finally:
        server.stop()


def run_cli(*args):
    env = dict(os.environ)  # with the test's own config, data and profile directories
    return subprocess.run([sys.executable, "-m", "specchat.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)


def test_specchat_run_end_to_end(llama_server):
    url = f"server.base_url={llama_server.base_url}"
    done = run_cli("run", "-p", "smollm2-server", "--set", url, "--max-tokens", "16", "--stats",
                   "What is the capital of France? Answer in one sentence.")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert NO_SPEC_METRICS in done.stderr and "Traceback" not in done.stderr
    wrong = run_cli("run", "-p", "smollm2-server", "--set", f"server.base_url=http://127.0.0.1:{free_port()}/v1", "hi")
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1
    assert "cannot connect" in wrong.stderr and "Traceback" not in wrong.stderr


def test_verify_across_a_server_and_the_local_engine(llama_server, isolated_dirs):
    profiles = Path(os.environ["SPECCHAT_PROFILES_DIR"])
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / "local.yaml").write_text("extends: smollm2-llamacpp\nthreads: 1\ncontext: 2048\n")
    prompts = isolated_dirs / "prompts.txt"
    prompts.write_text("What is the capital of France? Answer in one sentence.\nName three colours.\n")
    done = run_cli("verify", "-p", "smollm2-server", "-r", "local", "--set", f"server.base_url={llama_server.base_url}",
                   "--prompts", str(prompts), "--max-tokens", "12", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["identical"] == report["prompts"] == 2
    assert all(p["by"] == "text" and p["mean_accepted"] is None for p in report["prompts_checked"])
    alone = run_cli("verify", "-p", "smollm2-server", "--set", f"server.base_url={llama_server.base_url}")
    assert alone.returncode == 2 and "name a reference profile (-r)" in alone.stderr
