"""TorchBackend behind the streaming interface: stop reasons, cancel, cache reuse across turns."""
from __future__ import annotations

import threading

import pytest
import torch

from specchat.backends.base import (STOP_CANCELLED, STOP_CONTEXT_FULL, STOP_EOS, STOP_MAX_TOKENS, BackendError, Request,
                                    Sampling, Step, Summary, run_to_summary)
from specchat.backends.native.engine import TorchBackend

HELLO = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return TorchBackend(tiny_dirs["llama"], precision="float32", context=64)


def fresh_reply(tiny_dirs, request: Request, sampling: Sampling) -> Summary:
    return run_to_summary(TorchBackend(tiny_dirs["llama"], precision="float32", context=64).stream(request, sampling))


def test_stream_yields_steps_then_one_summary(engine):
    events = list(engine.stream(Request(messages=HELLO), Sampling(max_tokens=10)))
    steps, summary = events[:-1], events[-1]
    assert all(isinstance(e, Step) and len(e.token_ids) == 1 for e in steps)
    assert isinstance(summary, Summary) and summary.stop_reason in (STOP_MAX_TOKENS, STOP_EOS)
    assert summary.tokens == len(steps) == summary.passes
    assert summary.token_ids == [t for s in steps for t in s.token_ids]
    assert summary.text == engine.detokenize(summary.token_ids)
    assert summary.prompt_tokens == len(engine.tokenize_chat(HELLO))


def test_max_tokens_and_seeded_sampling_are_reproducible(engine, tiny_dirs):
    s = Sampling(temperature=0.9, top_p=0.95, seed=42, max_tokens=12)
    a = run_to_summary(engine.stream(Request(messages=HELLO), s))
    b = run_to_summary(engine.stream(Request(messages=HELLO), s))
    assert a.stop_reason == STOP_MAX_TOKENS and a.tokens == 12
    assert a.token_ids == b.token_ids
    assert fresh_reply(tiny_dirs, Request(messages=HELLO), s).token_ids == a.token_ids
    other = run_to_summary(engine.stream(Request(messages=HELLO), Sampling(temperature=0.9, top_p=0.95, seed=43,
                                                                           max_tokens=12)))
    assert other.token_ids != a.token_ids


def test_eos_stops_the_reply_and_is_not_emitted(engine):
    prompt = engine.tokenize_chat(HELLO)
    logits = engine.prefill(prompt)
    first = int(engine.sample(logits, [len(prompt)], Sampling())[0])
    engine.eos_ids = frozenset({first})
    try:
        summary = run_to_summary(engine.stream(Request(prompt_ids=prompt), Sampling(max_tokens=5)))
    finally:
        engine.eos_ids = engine.tokenizer.eos_ids
    assert summary.stop_reason == STOP_EOS and summary.tokens == 0 and summary.text == ""


def test_eos_ids_include_generation_config(engine):
    assert engine.eos_ids == {0, 2, engine.tokenizer.hf.eos_token_id}


def test_context_full(tiny_dirs):
    small = TorchBackend(tiny_dirs["llama"], precision="float32", context=24)
    small.eos_ids = frozenset()  # a reply that never ends by itself
    prompt = small.tokenize_chat(HELLO)
    summary = run_to_summary(small.stream(Request(prompt_ids=prompt), Sampling(max_tokens=100)))
    assert summary.stop_reason == STOP_CONTEXT_FULL
    assert len(prompt) + summary.tokens == 24


def test_prompt_longer_than_context_is_a_backend_error(engine):
    with pytest.raises(BackendError) as e:
        list(engine.stream(Request(prompt_ids=list(range(3, 70))), Sampling()))
    assert "context" in str(e.value) and "\n" not in str(e.value)


def test_cancel_stops_after_the_current_pass(engine):
    cancel = threading.Event()
    events = []
    for ev in engine.stream(Request(messages=HELLO), Sampling(max_tokens=30, temperature=1.0), cancel):
        events.append(ev)
        cancel.set()
    assert events[-1].stop_reason == STOP_CANCELLED and events[-1].tokens == 1


def test_closing_the_generator_leaves_the_engine_usable(engine, tiny_dirs):
    gen = engine.stream(Request(messages=HELLO), Sampling(max_tokens=30))
    next(gen), next(gen)
    gen.close()
    assert engine.cache_len == len(engine.cached)
    again = run_to_summary(engine.stream(Request(messages=HELLO), Sampling(max_tokens=8)))
    assert again.token_ids == fresh_reply(tiny_dirs, Request(messages=HELLO), Sampling(max_tokens=8)).token_ids


def test_second_turn_reuses_the_cache_and_matches_a_fresh_engine(engine, tiny_dirs):
    first = run_to_summary(engine.stream(Request(messages=HELLO), Sampling(max_tokens=6)))
    turn2 = HELLO + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and you?"}]
    prompt = engine.tokenize_chat(turn2)
    common = next(i for i, (a, b) in enumerate(zip(prompt, engine.cached + [-1] * len(prompt))) if a != b)
    assert common > len(engine.tokenize_chat(HELLO)) - 1  # the whole first prompt at least is reused
    calls = []
    original = engine.model.forward
    engine.model.forward = lambda t, start, *a, **k: calls.append((start, t.shape[-1])) or original(t, start, *a, **k)
    try:
        reply = run_to_summary(engine.stream(Request(messages=turn2), Sampling(max_tokens=8)))
    finally:
        del engine.model.forward
    assert calls[0] == (common, len(prompt) - common)  # only the new part was prefilled
    assert reply.token_ids == fresh_reply(tiny_dirs, Request(messages=turn2), Sampling(max_tokens=8)).token_ids


def test_transformers_reference_backend_streams_the_same_reply(tiny_dirs, engine):
    from specchat.backends.hf_reference import TransformersBackend

    reference = TransformersBackend(tiny_dirs["llama"], context=64)
    for s in (Sampling(max_tokens=12), Sampling(temperature=0.8, top_k=20, seed=5, max_tokens=12)):
        ours = run_to_summary(engine.stream(Request(messages=HELLO), s))
        theirs = run_to_summary(reference.stream(Request(messages=HELLO), s))
        assert theirs.token_ids == ours.token_ids and theirs.stop_reason == ours.stop_reason


def test_a_prompt_sent_again_chooses_its_first_token_from_the_same_bits(engine):
    """Sent again on a warm engine, a prompt finds all but its last token cached; were that token run
    alone, its row would have other bits than the prefill's last row of the first send, and a
    near-tie another first token. The prefill whose rows it would reuse in part runs again whole."""
    prompt = engine.tokenize_chat(HELLO)
    engine.truncate(0)
    first, _, start = engine.prefill_with_hidden(prompt, head=False)
    assert start == 0 and engine.pass_spans == [(0, len(prompt))]
    again, _, start = engine.prefill_with_hidden(prompt, head=False)
    assert start == 0 and torch.equal(first, again)
    engine.forward([5], len(prompt), all_logits=False)  # a reply token: a single-token pass
    longer = prompt + [5, 6, 7]  # the next turn reuses the whole prefill and the reply
    assert engine.prefill_with_hidden(longer)[2] == len(prompt) + 1
    edited = prompt[:-2] + [9, 9]  # another last message: the rows before it are reused
    assert engine.prefill_with_hidden(edited)[2] == len(prompt) - 2
    engine.truncate(3)  # what is left of a pass is still that pass's rows
    assert engine.pass_spans == [(0, 3)]
    engine.truncate(0)
    assert engine.pass_spans == []


def test_regenerate_gives_the_first_reply_again(engine):
    request = Request(messages=HELLO)
    for sampling in (Sampling(max_tokens=12), Sampling(temperature=0.9, seed=3, max_tokens=12)):
        engine.truncate(0)
        first = run_to_summary(engine.stream(request, sampling))
        again = run_to_summary(engine.stream(request, sampling))
        assert again.token_ids == first.token_ids and again.prefill_start == 0


def test_prefill_with_hidden_reports_what_it_computed(engine):
    from specchat.backends.native.model import FINAL

    prompt = engine.tokenize_chat(HELLO)
    engine.truncate(0)
    logits, hidden, start = engine.prefill_with_hidden(prompt, (0, FINAL))
    assert start == 0 and hidden[0].shape[0] == len(prompt) and hidden[FINAL].shape[0] == len(prompt)
    longer = prompt + [5, 6, 7]
    logits2, hidden2, start2 = engine.prefill_with_hidden(longer, (FINAL,))
    assert start2 == len(prompt) and hidden2[FINAL].shape[0] == 3
    assert torch.allclose(engine.probs(logits2, Sampling(temperature=1.0)).sum(), torch.tensor(1.0))


def test_compile_without_a_working_compiler_is_one_clear_error(tiny_ggufs, tmp_path, monkeypatch):
    """`compile: true` compiles at load (not mid-reply); if inductor cannot build its C++ kernels,
    the user gets one line saying what to do, not a compiler log."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing cached to fall back on
    monkeypatch.setattr(inductor_config.cpp, "cxx", (str(tmp_path / "no-such-g++"),))
    with pytest.raises(BackendError, match=r"compile: true failed .*set compile: false") as err:
        TorchBackend(tiny_ggufs["Q4_1"], precision="int4", context=64, compile=True)
    assert "\n" not in str(err.value)
