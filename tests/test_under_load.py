"""Replies under load (verify --concurrency): a server whose replies change with others in flight
is caught, where they change is named, and a server that does not change is never blamed."""
from __future__ import annotations

import pytest

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.openai.backend import OpenAIBackend
from specchat.prompts import PromptItem
from specchat.under_load import check_under_load, report, run_under_load
from specchat.verify import PromptCheck, check_prompt
from tests.openai.servers import MODEL, InFlightServer

GREEDY = Sampling(max_tokens=4)


@pytest.fixture
def batching():
    server = InFlightServer()
    yield server
    server.stop()


def requests(n: int) -> list[Request]:
    return [Request(messages=[{"role": "user", "content": f"question {i}"}]) for i in range(n)]


def test_replies_that_change_with_others_in_flight_are_found_and_placed(batching):
    backend = OpenAIBackend(batching.base_url, MODEL)
    sent = requests(3)
    alone = [run_to_summary(backend.stream(r, GREEDY)) for r in sent]
    assert [a.text for a in alone] == [" a b c d"] * 3 and batching.most_in_flight == 1
    run = run_under_load(backend, sent, alone, GREEDY, 3)
    assert run.changed_at == [2, 2, 2] and run.changed == 3 and batching.most_in_flight == 3 and run.tok_s > 0
    assert run_under_load(backend, sent, alone, GREEDY, 1).changed_at == [None] * 3  # one at a time: as alone
    two = run_under_load(backend, sent[:1], alone[:1], GREEDY, 2)  # one prompt, sent twice to keep the load
    assert two.changed_at == [2]


def test_a_server_that_batches_without_changing_a_reply_is_never_blamed():
    steady = InFlightServer(alone=" a b c d", crowded=" a b c d")
    try:
        backend = OpenAIBackend(steady.base_url, MODEL)
        sent = requests(4)
        alone = [run_to_summary(backend.stream(r, GREEDY)) for r in sent]
        assert run_under_load(backend, sent, alone, GREEDY, 4).changed == 0 and steady.most_in_flight == 4
    finally:
        steady.stop()


def test_verify_reports_each_sides_changes_under_load(batching):
    spec, reference = OpenAIBackend(batching.base_url, MODEL), OpenAIBackend(batching.base_url, MODEL)
    checks = []
    for i, request in enumerate(requests(2)):
        ref, out, verdict = check_prompt(spec, reference, request, GREEDY)
        assert verdict.kind == "identical"  # sent alone, one at a time
        checks.append(PromptCheck(PromptItem(str(i), ["q"]), ref, out, verdict, request=request))
    totals = check_under_load(spec, reference, checks, GREEDY, 2)
    assert totals["reference"]["changed"] == 2 and totals["speculative"]["changed"] == 2
    assert checks[0].under_load == {"reference_changed_at": 2, "speculative_changed_at": 2}
    lines = report(totals, checks)
    assert lines[0].startswith("under load (C=2): 2 of 2 target-only replies changed (0 at 2, 1 at 2)")
    assert "speculative replies changed" in lines[1] and "tok/s at C=2" in lines[1]


def test_bench_measures_a_servers_rows_again_under_load(batching, tmp_path):
    from specchat import bench
    from specchat.profiles import load_profile_file

    (tmp_path / "srv.yaml").write_text(f"backend: openai\nmodel: {MODEL}\nserver:\n  base_url: {batching.base_url}\n"
                                       "sampling:\n  max_tokens: 4\n")
    profile = load_profile_file(tmp_path / "srv.yaml")
    prompts = [PromptItem(str(i), [f"question {i}"]) for i in range(3)]
    [row] = bench.bench([profile], prompts, concurrency=3)
    assert [r.summary.text for r in row.runs] == [" a b c d"] * 3  # measured one at a time first
    assert row.under_load.changed == 3 and row.under_load.changed_at == [2, 2, 2] and row.under_load.tok_s > 0
    lines = bench.load_lines([row])
    assert "with 3 in flight" in lines[0] and "3 of 3 replies changed under load" in lines[0]
    assert bench.to_json([row])["rows"][0]["under_load"]["changed"] == 3


def test_a_server_that_falls_over_under_load_is_one_line_naming_the_request():
    from specchat.backends.base import BackendError

    falls = InFlightServer(drop_crowded=True)
    try:
        backend = OpenAIBackend(falls.base_url, MODEL, timeout_s=5)
        sent = requests(2)
        alone = [run_to_summary(backend.stream(r, GREEDY)) for r in sent]  # alone it answers
        with pytest.raises(BackendError) as failed:
            run_under_load(backend, sent, alone, GREEDY, 2)
        line = str(failed.value)
        assert line.startswith("under load (2 in flight), request ") and "of 2 failed: " in line
        assert "\n" not in line
    finally:
        falls.stop()


def test_a_server_that_stalls_under_load_is_one_line_naming_the_request_and_the_wait():
    from specchat.backends.base import BackendError

    stalls = InFlightServer(stall_crowded=True)
    try:
        backend = OpenAIBackend(stalls.base_url, MODEL, timeout_s=3)
        sent = requests(2)
        alone = [run_to_summary(backend.stream(r, GREEDY)) for r in sent]
        with pytest.raises(BackendError) as failed:
            run_under_load(backend, sent, alone, GREEDY, 2)
        line = str(failed.value)
        assert line.startswith("under load (2 in flight), request ") and "sent nothing for 3s" in line, line  # not a broken pipe: no reply closes another's client
        assert "\n" not in line
    finally:
        stalls.stop()
