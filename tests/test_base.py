from specchat.backends.base import Step, StreamStats, Summary
from specchat.backends.detok import IncrementalDetokenizer


def test_stats_follow_vllm_definitions():
    st = StreamStats(prompt_tokens=5)
    st.add(Step([1], "a"))  # prefill pass: no drafts
    st.add(Step([2, 3, 4], "bcd", drafted=4, accepted=2))
    st.add(Step([5], "e", drafted=4, accepted=0))
    st.add(Step([6, 7, 8, 9, 10], "fghij", drafted=4, accepted=4))
    s = st.finish("max_tokens")
    assert s.tokens == 10 and s.passes == 4 and s.text == "abcdefghij"
    assert s.drafts == 3 and s.draft_tokens == 12 and s.accepted_tokens == 6
    assert s.mean_accepted == 1 + 6 / 3
    assert s.acceptance_rate == 0.5
    assert s.accepted_per_position == [2, 2, 1, 1]
    assert s.acceptance_by_position == [2 / 3, 2 / 3, 1 / 3, 1 / 3]
    d = s.as_dict()
    assert d["mean_accepted"] == 3.0 and d["stop_reason"] == "max_tokens"


def test_target_only_summary_has_mean_one():
    s = Summary(stop_reason="eos", tokens=3, passes=3)
    assert s.mean_accepted == 1.0 and s.acceptance_rate == 0.0


def byte_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_holds_back_split_characters():
    text = "héllo → wörld ✓"
    ids = list(text.encode())
    d = IncrementalDetokenizer(byte_decode)
    out = ""
    for i in ids:
        delta = d.add([i])
        assert "\ufffd" not in delta
        out += delta
    assert out + d.flush() == text


def test_detokenizer_flushes_a_dangling_byte():
    d = IncrementalDetokenizer(byte_decode)
    assert d.add(list("ok".encode()) + [0xE2]) == "ok"
    assert d.flush() == "\ufffd"
