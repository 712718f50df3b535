import os
import threading

import pytest

from specchat.backends.base import BackendError, Request, Sampling, Step, Summary, run_to_summary
from specchat.backends.llamacpp import LlamaCppBackend
from specchat.paths import cache_dir
from tests.native.tiny import make_gguf, make_hf_checkpoint

CHAT = [{"role": "user", "content": "Say something"}]


def tiny_gguf(folder, qtype="Q8_0"):
    return make_gguf(folder / "tiny.gguf", make_hf_checkpoint(folder / "hf", "llama"), qtype)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def tiny(tiny_path):
    backend = LlamaCppBackend(tiny_path, context=128, threads=2)
    yield backend
    backend.close()


def test_stream_yields_steps_then_one_summary(tiny):
    events = list(tiny.stream(Request(messages=CHAT), Sampling(max_tokens=12)))
    steps, last = events[:-1], events[-1]
    assert all(isinstance(e, Step) for e in steps) and isinstance(last, Summary)
    assert last.tokens == len(steps) == last.passes
    assert last.token_ids == [t for s in steps for t in s.token_ids]
    assert last.stop_reason in ("max_tokens", "eos")
    assert last.text == tiny.detokenize(last.token_ids)
    assert last.prompt_tokens == len(tiny.tokenize_chat(CHAT))


def test_chat_template_comes_from_the_gguf(tiny):
    ids = tiny.tokenize_chat(CHAT)
    # The specials are control tokens: they render as nothing, the rest is the template's text.
    assert tiny.detokenize(ids) == "user\nSay something\nassistant\n"


def test_greedy_is_deterministic_and_seeded_sampling_repeats(tiny):
    req = Request(messages=CHAT)
    a = run_to_summary(tiny.stream(req, Sampling(max_tokens=16)))
    b = run_to_summary(tiny.stream(req, Sampling(max_tokens=16)))
    assert a.token_ids == b.token_ids
    s1 = run_to_summary(tiny.stream(req, Sampling(temperature=1.5, seed=7, max_tokens=16)))
    s2 = run_to_summary(tiny.stream(req, Sampling(temperature=1.5, seed=7, max_tokens=16)))
    s3 = run_to_summary(tiny.stream(req, Sampling(temperature=1.5, seed=8, max_tokens=16)))
    assert s1.token_ids == s2.token_ids
    assert s1.token_ids != s3.token_ids


def test_cancel_mid_stream_then_next_turn_works(tiny):
    cancel = threading.Event()
    got = []
    for ev in tiny.stream(Request(messages=CHAT), Sampling(max_tokens=50), cancel):
        if isinstance(ev, Step):
            got.append(ev)
            if len(got) == 3:
                cancel.set()
        else:
            summary = ev
    assert summary.stop_reason == "cancelled" and summary.tokens == 3
    after = run_to_summary(tiny.stream(Request(messages=CHAT), Sampling(max_tokens=5)))
    fresh = run_to_summary(tiny.stream(Request(messages=CHAT), Sampling(max_tokens=5)))
    assert after.tokens == 5 and after.token_ids == fresh.token_ids


def test_closing_the_generator_leaves_backend_ready(tiny):
    gen = tiny.stream(Request(messages=CHAT), Sampling(max_tokens=50))
    next(gen)
    gen.close()
    assert run_to_summary(tiny.stream(Request(messages=CHAT), Sampling(max_tokens=4))).tokens == 4


def test_context_full_and_prompt_too_long(tiny):
    n_ctx = tiny.context_length
    long_prompt = [60 + i % 150 for i in range(n_ctx - 8)]
    s = run_to_summary(tiny.stream(Request(prompt_ids=long_prompt), Sampling(max_tokens=50)))
    assert s.stop_reason == "context_full" and s.tokens == 8
    with pytest.raises(BackendError, match=f"context holds {n_ctx}"):
        run_to_summary(tiny.stream(Request(prompt_ids=long_prompt + long_prompt), Sampling()))


def test_greedy_matches_the_torch_engine_on_the_same_gguf(tiny, tiny_path):
    from specchat.backends.native.engine import TorchBackend

    engine = TorchBackend(tiny_path, "gguf", precision="float32", threads=2, context=128)
    request = Request(messages=CHAT)
    assert engine.tokenize_chat(CHAT) == tiny.tokenize_chat(CHAT)
    ours = run_to_summary(engine.stream(request, Sampling(max_tokens=24)))
    theirs = run_to_summary(tiny.stream(request, Sampling(max_tokens=24)))
    assert ours.token_ids == theirs.token_ids


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(BackendError, match="no such GGUF file"):
        LlamaCppBackend(tmp_path / "none.gguf")


@pytest.mark.slow
def test_real_default_model_answers(default_gguf):
    b = LlamaCppBackend(default_gguf, context=1024, threads=2, cache_dir=cache_dir())
    try:
        s = run_to_summary(b.stream(Request(messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]),
                                    Sampling(max_tokens=24)))
    finally:
        b.close()
    assert "Paris" in s.text
    assert s.decode_tok_s > 0 and s.ttft_s > 0


def test_the_next_turn_reuses_the_cached_prefix_and_says_how_much(tiny, tiny_path):
    first = run_to_summary(tiny.stream(Request(messages=CHAT), Sampling(max_tokens=8)))
    held = list(tiny.llm.input_ids[:tiny.llm.n_tokens])
    second = Request(messages=CHAT + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}])
    prompt = tiny.tokenize_chat(second.messages)
    out = run_to_summary(tiny.stream(second, Sampling(max_tokens=8)))
    shared = len(os.path.commonprefix([held, prompt]))
    assert out.prefill_start == shared > len(tiny.tokenize_chat(CHAT)) // 2
    cold = LlamaCppBackend(tiny_path, context=128, threads=2)
    try:
        assert out.token_ids == run_to_summary(cold.stream(second, Sampling(max_tokens=8))).token_ids  # as a cold cache
    finally:
        cold.close()


def test_without_llama_cpps_extra_buffers_the_backend_says_so(tiny, tiny_path, monkeypatch):
    import specchat.backends.llamacpp as module

    assert (tiny.caveat is None) == module.extra_buffers_work(tiny_path)  # this CPU's own answer
    monkeypatch.setattr(module, "extra_buffers_work", lambda *a: False)  # as on a CPU where they fault
    backend = LlamaCppBackend(tiny_path, context=128, threads=2)
    try:
        assert "extra CPU buffers (AMX, repacked weights) are off" in backend.caveat
        assert run_to_summary(backend.stream(Request(messages=CHAT), Sampling(max_tokens=4))).tokens > 0
    finally:
        backend.close()
