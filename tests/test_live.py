"""One meaning per figure: a scripted reply with known passes and drafts shows the same tokens per
pass (tokens over every target pass) on every surface — the reply's line, the status bar and the
A/B panes, `run --json`, history, `bench` and `ladder` — and tokens per drafted pass under its own
name wherever it is shown."""
from __future__ import annotations

import threading

from specchat.backends.base import Sampling, Summary
from specchat.bench import ProfileResult, Run
from specchat.live import LiveStats, reply_stats, speculation_figures, speculation_note, stats_line
from specchat.profiles import load_profiles
from specchat.prompts import PromptItem
from tests.scripted import ScriptedBackend

REPLY = " ".join(f"w{i}" for i in range(23))


def scripted_reply() -> tuple[LiveStats, Summary]:
    """23 tokens in 12 passes: 5 drafted passes accept 3, 1, 3, 1, 3 (16 tokens), 7 plain passes the other 7."""
    backend = ScriptedBackend([REPLY], accept=[3, None, 1, None, None])
    live = LiveStats()
    for ev in backend.stream(backend_request(), Sampling(max_tokens=64), threading.Event()):
        if isinstance(ev, Summary):
            live.finish(ev)
            return live, ev
        live.add(ev, 0.0)
    raise AssertionError("no summary")


def backend_request():
    from specchat.backends.base import Request

    return Request(messages=[{"role": "user", "content": "hi"}])


def test_every_surface_shows_tokens_over_all_passes():
    live, s = scripted_reply()
    assert (s.tokens, s.passes, s.drafts) == (23, 12, 5)
    tpp = f"{23 / 12:.2f}"
    drafted = f"{s.mean_accepted:.2f}"
    assert tpp != drafted  # the two figures differ on this reply, so a surface showing the wrong one fails
    assert f"{tpp} tok/pass" in stats_line(s)  # the reply's line, run --stats, the REPL
    assert f"{drafted} tok/drafted pass" in stats_line(s)
    assert f"{tpp} tok/pass" in speculation_note(s, acceptance=False) and drafted not in speculation_note(
        s, acceptance=False)
    assert f"{tpp} tok/pass" in speculation_figures(live, remote=False)  # the status bar, the A/B panes
    assert round(live.mean_per_pass, 2) == round(23 / 12, 2)
    assert s.as_dict()["tokens_per_pass"] == 23 / 12  # run --json
    assert s.as_dict()["mean_accepted"] == s.mean_accepted == 1 + 11 / 5
    assert reply_stats(s, "suffix")["tokens_per_pass"] == round(23 / 12, 3)  # history
    res = ProfileResult("x", load_profiles().get("smollm2-suffix"), [Run(PromptItem("1", ["hi"]), s)])
    assert res.tokens_per_pass() == 23 / 12 and res.mean_accepted() == s.mean_accepted  # bench, ladder


def test_a_server_that_reported_nothing_has_no_tokens_per_pass():
    s = Summary("eos", tokens=10, passes=10, spec_reported=False)
    assert s.as_dict()["tokens_per_pass"] is None
    assert "tokens_per_pass" not in reply_stats(s)
