"""Speculative metrics as vLLM, SGLang and llama-server report them, from responses recorded in
their documented formats; and the backend putting them into its Summary."""
import json

import pytest

from specchat.backends.base import NO_SPEC_METRICS, BackendError, Request, Sampling, Step, Summary, run_to_summary
from specchat.backends.openai import OpenAIBackend
from specchat.backends.openai.chunks import parse_chunk
from specchat.backends.openai.metrics import (llama_server_figures, prometheus_samples, sglang_figures, vllm_counters,
                                              vllm_figures)
from specchat.live import LiveStats, speculation_figures, speculation_note
from tests.openai.servers import RECORDED

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def sse_payloads(name):
    lines = (RECORDED / name).read_text().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_prometheus_text_is_read_with_labels():
    samples = list(prometheus_samples((RECORDED / "vllm-metrics-before.txt").read_text()))
    by_name = {(n, lab.get("position")): v for n, lab, v in samples}
    assert by_name[("vllm:spec_decode_num_drafts_total", None)] == 120.0
    assert by_name[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "2")] == 35.0
    assert all(not n.startswith("#") for n, _, _ in samples)


def test_vllm_counters_before_and_after_give_one_requests_figures():
    before = vllm_counters((RECORDED / "vllm-metrics-before.txt").read_text(), "Qwen/Qwen3-8B")
    after = vllm_counters((RECORDED / "vllm-metrics-after.txt").read_text(), "Qwen/Qwen3-8B")
    assert before.drafts == 120 and before.per_position == (100, 65, 35)  # `_created` samples are not counters
    f = vllm_figures(before, after)
    assert (f.drafts, f.draft_tokens, f.accepted_tokens) == (4, 12, 7)
    assert f.accepted_per_position == [4, 2, 1] and f.drafts_per_position == [4, 4, 4]
    s = f.apply(Summary(stop_reason="max_tokens", tokens=12, passes=5))
    assert s.mean_accepted == 1 + 7 / 4 and s.acceptance_rate == 7 / 12
    assert s.acceptance_by_position == [1.0, 0.5, 0.25]  # vLLM's per-position rate: accepted_i / drafts
    assert s.passes == 12 - 7 and s.spec_source == "vLLM /metrics"


def test_vllm_counters_of_another_model_or_no_speculation_are_not_ours():
    text = (RECORDED / "vllm-metrics-before.txt").read_text()
    assert vllm_counters(text, "some/other-model") is None
    assert vllm_counters("vllm:num_requests_running{engine=\"0\"} 0.0\n") is None  # vLLM without speculation
    assert vllm_counters("") is None


def test_sglang_meta_info_from_a_recorded_reply():
    chunk = parse_chunk(json.loads((RECORDED / "sglang-response.json").read_text()))
    assert chunk.text == "Paris is the capital of France." and chunk.finish_reason == "stop"
    f = sglang_figures(chunk.meta_info)
    assert (f.drafts, f.accepted_tokens) == (3, 8 - 3)
    s = f.apply(Summary(stop_reason="eos", tokens=8))
    assert s.mean_accepted == pytest.approx(8 / 3)  # SGLang's accept length: completion_tokens / spec_verify_ct
    # newer builds count accepted and drafted tokens themselves
    f = sglang_figures({"spec_verify_ct": 3, "completion_tokens": 8, "spec_accept_token_num": 4,
                        "spec_draft_token_num": 9})
    assert (f.accepted_tokens, f.draft_tokens) == (4, 9)
    assert sglang_figures({"completion_tokens": 8}) is None  # no speculation on that server


def test_llama_server_timings_from_the_final_chunk():
    chunks = [parse_chunk(p) for p in sse_payloads("llama-server-stream.txt")]
    assert [c.token_ids for c in chunks if c.text] == [[785], [6722], [315], [9625], [374], [12095], [13]]
    f = llama_server_figures(chunks[-1].timings)
    assert (f.draft_tokens, f.accepted_tokens) == (8, 4)
    s = f.apply(Summary(stop_reason="eos", tokens=7))
    assert s.drafts == 7 - 4 - 1 and s.passes == 3 and s.acceptance_rate == 0.5
    assert llama_server_figures({"predicted_n": 7}) is None


def test_vllm_chunks_carry_several_token_ids():
    chunks = [parse_chunk(p) for p in sse_payloads("vllm-stream.txt")]
    assert [len(c.token_ids) for c in chunks if c.text] == [1, 4, 3, 2, 2]
    assert chunks[-2].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 12


def test_errors_in_a_stream_are_read():
    assert parse_chunk({"error": {"message": "out of memory", "code": 500}}).error == "out of memory"
    assert parse_chunk({"object": "error", "message": "boom", "code": 400}).error == "boom"


# --------------------------------------------------------- the backend, on replayed servers

def stream(replay, kind, **kw):
    backend = OpenAIBackend(replay.base_url(kind), "Qwen/Qwen3-8B", **kw)
    backend.check_server()
    try:
        return list(backend.stream(Request(messages=CHAT), Sampling(max_tokens=12)))
    finally:
        backend.close()


def test_backend_reads_vllm_ids_and_counters(replay):
    events = stream(replay, "vllm")
    steps, s = events[:-1], events[-1]
    assert [len(e.token_ids) for e in steps] == [1, 4, 3, 2, 2]  # a speculative pass arrives as one chunk
    assert s.token_ids == [59604, 374, 279, 6722, 323, 7772, 3283, 315, 9625, 13, 1084, 374]
    assert s.tokens == 12 and s.prompt_tokens == 14 and s.stop_reason == "max_tokens"
    assert s.spec_reported and s.drafts == 4 and s.mean_accepted == 2.75
    assert s.acceptance_by_position == [1.0, 0.5, 0.25]
    body = replay.requests[-1][2]
    assert body["return_tokens_as_token_ids"] and body["logprobs"] and body["stream"]
    assert body["temperature"] == 0.0 and body["max_tokens"] == 12 and body["seed"] == 0
    live = LiveStats()
    for e in steps:
        live.add(e, 0.0)
    live.finish(s)
    assert "2.40 tok/pass" in speculation_figures(live, remote=True) and "by pos 100% 50% 25%" in \
        speculation_figures(live, remote=True)


def test_backend_reads_llama_server_timings(replay):
    s = stream(replay, "llama-server")[-1]
    assert s.text == "The capital of France is Paris." and s.token_ids[-2:] == [12095, 13]
    assert s.spec_source == "llama-server timings" and s.draft_tokens == 8 and s.accepted_tokens == 4


def test_tokens_a_server_sent_no_chunk_for_are_counted_and_the_ids_left_out(replay):
    """llama-server sends no chunk for a token whose text ends inside a UTF-8 character; the usage
    counts it: the reply has every token and no ids with a gap (it is compared by text)."""
    s = stream(replay, "llama-server-withheld")[-1]
    assert s.text == " Paris \U0001F389." and s.tokens == 4 and s.token_ids == []


def test_sglang_streamed_reply_says_no_metrics_whole_reply_has_them(replay):
    events = stream(replay, "sglang")
    s = events[-1]
    assert s.text == "Paris is the capital of France." and s.token_ids == []
    assert all(isinstance(e, Step) and e.token_count == 1 for e in events[:-1])  # counted per chunk
    assert s.tokens == 8 and not s.spec_reported and s.drafts == 0  # the usage count beats one per chunk
    assert speculation_note(s) == NO_SPEC_METRICS  # not "1.00 tokens/pass"
    whole = stream(replay, "sglang", stream=False, metrics="sglang")[-1]
    assert replay.requests[-1][2]["return_meta_info"] and not replay.requests[-1][2]["stream"]
    assert whole.spec_source == "SGLang meta_info" and whole.drafts == 3
    assert whole.tokens == 8 and whole.prompt_tokens == 14  # no logprobs: the server's own count


def test_metrics_none_asks_nothing_and_reports_nothing(replay):
    calls = replay.metrics_calls
    s = run_to_summary(OpenAIBackend(replay.base_url("vllm"), "Qwen/Qwen3-8B", metrics="none")
                       .stream(Request(messages=CHAT), Sampling(max_tokens=12)))
    assert replay.metrics_calls == calls and not s.spec_reported
    assert "return_meta_info" not in replay.requests[-1][2]


def test_cancel_while_the_server_is_silent_returns_at_once(replay):
    import threading
    import time

    backend = OpenAIBackend(replay.base_url("silent"), "Qwen/Qwen3-8B")
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    start = time.perf_counter()
    s = run_to_summary(backend.stream(Request(messages=CHAT), Sampling(max_tokens=12), cancel))
    assert s.stop_reason == "cancelled" and s.tokens == 0
    assert time.perf_counter() - start < 2.0  # not the server's 5 s of silence


def test_a_silent_server_times_out_with_one_line(replay):
    backend = OpenAIBackend(replay.base_url("silent"), "Qwen/Qwen3-8B", timeout_s=0.5)
    with pytest.raises(BackendError) as e:
        run_to_summary(backend.stream(Request(messages=CHAT), Sampling(max_tokens=12)))
    assert "sent nothing for 0.5s" in str(e.value) and "server.timeout_s" in str(e.value)


def test_a_stream_answered_without_server_sent_events_is_one_line(replay):
    backend = OpenAIBackend(replay.base_url("not-sse"), "Qwen/Qwen3-8B")
    with pytest.raises(BackendError) as e:
        run_to_summary(backend.stream(Request(messages=CHAT), Sampling(max_tokens=12)))
    assert "answered a stream request with application/json, not server-sent events" in str(e.value)
    assert "\n" not in str(e.value)


def test_events_split_over_data_lines_comments_and_keep_alives_are_read_as_servers_send_them():
    import httpx

    from specchat.backends.openai.http import EventStream

    body = (b": ping\n\n"  # a keep-alive comment
            b"event: message\nid: 1\ndata: {\"a\":\ndata: 1}\n\n"  # one payload over two data lines
            b"data: not json\n\n"  # nothing we use
            b"data: {\"b\": 2}\r\n\r\n"  # CRLF line ends
            b"data: [DONE]\n\ndata: {\"after\": 3}\n\n")
    response = httpx.Response(200, headers={"content-type": "text/event-stream; charset=utf-8"}, content=body,
                              request=httpx.Request("POST", "http://127.0.0.1/v1/chat/completions"))
    stream = EventStream(response)
    assert list(stream) == [{"a": 1}, {"b": 2}] and stream.done


def test_a_token_holding_a_unicode_line_separator_stays_one_event():
    """Servers write UTF-8 as it is (llama-server does): U+2028 or NEL inside a token ends no SSE line.
    The hand-written parser split lines as str.splitlines does and lost such a chunk without a word."""
    import httpx

    from specchat.backends.openai.http import EventStream

    payload = json.dumps({"choices": [{"delta": {"content": "a\u2028b\x85c\x0cd"}}]}, ensure_ascii=False)
    response = httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=f"data: {payload}\n\ndata: [DONE]\n\n".encode(),
                              request=httpx.Request("POST", "http://127.0.0.1/v1/chat/completions"))
    assert [c["choices"][0]["delta"]["content"] for c in EventStream(response)] == ["a\u2028b\x85c\x0cd"]


def test_a_model_the_server_does_not_serve_is_named(replay):
    backend = OpenAIBackend(replay.base_url("vllm"), "Qwen/Qwen3-80B")
    with pytest.raises(BackendError, match="has no model 'Qwen/Qwen3-80B' \\(HTTP 404: The model"):
        run_to_summary(backend.stream(Request(messages=CHAT), Sampling(max_tokens=12)))
    with pytest.raises(BackendError, match="serves 'Qwen/Qwen3-8B', not 'Qwen/Qwen3-80B'"):
        backend.check_server()


def test_bench_shows_what_a_remote_server_reported(replay):
    from rich.console import Console

    from specchat import bench
    from specchat.profiles import load_profiles
    from specchat.prompts import PromptItem

    profile = load_profiles().get("vllm-qwen3-8b-dflash").with_overrides({"server.base_url": replay.base_url("vllm")})
    results = bench.bench([profile], [PromptItem("1", ["What is the capital of France?"])])
    console = Console(width=200, record=True)
    console.print(bench.render(results))
    row = next(line for line in console.export_text().splitlines() if "vllm-qwen3-8b-dflash" in line)
    assert "server: dflash ×15" in row and "2.75" in row


def test_listing_profiles_never_connects(monkeypatch, capsys):
    import httpx

    from specchat import cli

    def refuse(*args, **kwargs):
        raise AssertionError("listing profiles opened a connection")

    monkeypatch.setattr(httpx.Client, "__init__", refuse)
    assert cli.main(["profiles", "--json", "--no-probe"]) == 0  # without --no-probe it asks each server (0.5 s at most)
    listed = json.loads(capsys.readouterr().out)
    # as in test_shipped_profiles_all_load: only a drafter not trained yet may be missing
    assert all("no drafter at" in msg and "specchat train" in msg for msg in listed["errors"].values())
    remote = {n: p for n, p in listed["profiles"].items() if p["backend"] == "openai"}
    assert {"smollm2-server", "vllm-qwen3-8b-dflash", "sglang-qwen3-8b-dflash", "vllm-mimo-7b-mtp"} <= set(remote)
    assert all("Server:" in p["description"] for p in remote.values())  # each says how to start its server


def test_vllm_per_request_metrics_beat_the_server_wide_counters(replay):
    backend = OpenAIBackend(replay.base_url("vllm-per-request"), "Qwen/Qwen3-8B")
    first = run_to_summary(backend.stream(Request(messages=CHAT), Sampling(max_tokens=12)))
    assert first.spec_source == "vLLM per-request metrics"
    assert (first.drafts, first.draft_tokens, first.accepted_tokens) == (4, 12, 6)
    # the histogram [1, 1, 1, 1]: one pass each accepted 0, 1, 2 and 3 drafts
    assert first.accepted_per_position == [3, 2, 1] and first.drafts_per_position == [4, 4, 4]
    assert first.mean_accepted == 2.5 and first.passes == 12 - 6
    calls = replay.metrics_calls
    again = run_to_summary(backend.stream(Request(messages=CHAT), Sampling(max_tokens=12)))
    backend.close()
    assert replay.metrics_calls == calls and again.spec_source == "vLLM per-request metrics"  # /metrics no longer read


def test_vllm_per_request_histogram_as_a_mapping():
    from specchat.backends.openai.metrics import vllm_request_figures

    f = vllm_request_figures({"num_spec_steps": 43, "num_draft_tokens": 129, "num_accepted_draft_tokens": 10,
                              "num_spec_tokens": 3, "acceptance_histogram": {"0": 39, "1": 1, "3": 3}})
    assert f.accepted_per_position == [4, 3, 3] and sum(f.accepted_per_position) == 10
    assert vllm_request_figures({"mean_acceptance_length": 1.0}) is None
