"""Suffix decoding through the one loop: speculative == target-only alone and behind each model
drafter, greedy and seeded sampling, one turn and several; a reply seen before drafts longer and
right; the memory switched off."""
from __future__ import annotations

import pytest

from specchat.backends.base import Request, Sampling, Step
from specchat.backends.speculative.backend import (SpeculativeBackend, SpeculativeSettings, make_drafter,
                                                   make_suffix_drafter)
from specchat.backends.speculative.drafters import SuffixDrafter, SuffixFirst
from specchat.backends.speculative.suffix import SuffixIndex, SuffixSettings
from specchat.verify import fresh
from tests.speculative.conftest import PROMPTS, SAMPLINGS, compare, streamed

SAMPLING_IDS = ["greedy", "t0.8", "t1.2-topk-topp"]


def reference(target, sampling, messages=PROMPTS[0]):
    return streamed(fresh(target).stream(Request(messages=messages), sampling))


def perturbed(ids: list[int], every: int = 5) -> list[int]:
    """The reply with every `every`-th token changed: a memory whose drafts are right for a while, then wrong."""
    return [t if i % every else (t + 1) % 100 for i, t in enumerate(ids)]


def suffix_with_memory(*replies, settings=SuffixSettings()) -> SuffixDrafter:
    drafter = make_suffix_drafter(settings)
    for key, ids in enumerate(replies):
        drafter.memory.add(key, ids)
    return drafter


def steps_of(target, drafter, depth, sampling, messages=PROMPTS[0]) -> tuple[list[Step], object]:
    events = list(fresh(SpeculativeBackend(target, drafter, depth)).stream(Request(messages=messages), sampling))
    return events[:-1], streamed(events)


@pytest.mark.parametrize("depth", [1, 3, 8])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_suffix_alone_equals_target_only(target, depth, sampling):
    ref = reference(target, sampling)
    other = reference(target, sampling, PROMPTS[1])
    for drafter in (make_suffix_drafter(SuffixSettings()),  # an empty memory: the conversation alone
                    suffix_with_memory(other.token_ids, perturbed(ref.token_ids)),
                    suffix_with_memory(ref.token_ids, settings=SuffixSettings(min_prob=0.0, factor=4.0))):
        _, out, verdict = compare(target, drafter, depth, sampling)
        assert verdict.kind == "identical", verdict.line()
        assert out.tokens == ref.tokens and out.stop_reason == ref.stop_reason


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_a_reply_seen_before_drafts_longer_and_right_the_second_time(target, sampling):
    cold, first = steps_of(target, make_suffix_drafter(SuffixSettings()), 6, sampling)
    drafter = make_suffix_drafter(SuffixSettings())
    drafter.memory.add("earlier", first.token_ids)
    warm, second = steps_of(target, drafter, 6, sampling)
    assert second.token_ids == first.token_ids
    assert second.passes < first.passes and second.tokens / second.passes > first.tokens / first.passes
    assert second.accepted_tokens > first.accepted_tokens
    assert any(s.source == "history" and s.accepted >= 2 for s in warm)  # long drafts, from the memory, right
    assert not any(s.source == "history" for s in cold)


def test_similar_text_is_drafted_from_memory_and_a_wrong_memory_costs_nothing_but_passes(target):
    sampling = Sampling(max_tokens=40)
    ref = reference(target, sampling)
    drafter = suffix_with_memory(perturbed(ref.token_ids, every=7))
    steps, out = steps_of(target, drafter, 6, sampling)
    assert out.token_ids == ref.token_ids
    history = [s for s in steps if s.source == "history"]
    assert history and any(s.accepted < s.drafted for s in history) and any(s.accepted for s in history)


@pytest.mark.parametrize("model", ["mtp", "dflash", "eagle3", "draft"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_suffix_in_front_of_a_model_drafter_keeps_parity_and_uses_both(target, drafters, model, sampling):
    ref = reference(target, sampling)
    front = suffix_with_memory(perturbed(ref.token_ids, every=6))
    drafter = SuffixFirst(drafters[model]("exact"), front, suffix_depth=6, model_depth=8)
    steps, out = steps_of(target, drafter, 3, sampling)
    assert out.token_ids == ref.token_ids and out.stop_reason == ref.stop_reason
    sources = {s.source for s in steps if s.drafted}
    assert "history" in sources and model in sources  # the model guessed where the memory had nothing
    assert all(s.drafted <= 3 for s in steps if s.source == model)  # the profile's depth is the model's
    assert all(s.drafted <= 6 for s in steps)


def test_multi_turn_conversation_keeps_parity_and_drafts_from_the_earlier_turn(target, drafters):
    sampling = Sampling(max_tokens=30)
    first = reference(target, sampling, PROMPTS[1])
    convo = PROMPTS[1] + [{"role": "assistant", "content": first.text}, {"role": "user", "content": PROMPTS[1][0]["content"]}]
    for drafter in (make_suffix_drafter(SuffixSettings()),
                    SuffixFirst(drafters["mtp"]("exact"), make_suffix_drafter(SuffixSettings()), 6, 2)):
        backend = SpeculativeBackend(target, drafter, 4)
        for messages in (PROMPTS[1], convo):  # one backend, two turns: the second reuses the first's cache
            request = Request(messages=messages)
            ref = streamed(fresh(target).stream(request, sampling))
            events = list(backend.stream(request, sampling))
            out = streamed(events)
            assert out.token_ids == ref.token_ids, messages
        assert any(s.source == "suffix" for s in events[:-1])  # the earlier turn stood in the conversation


def test_memory_off_drafts_from_the_conversation_only():
    drafter = make_suffix_drafter(SuffixSettings(memory=False))
    assert drafter.memory is None and drafter.sources == ("suffix",)
    draft = drafter.propose([1, 2, 3, 4, 1, 2], 4)
    assert draft.tokens == [3, 4] and draft.source == "suffix"


def test_a_loop_in_the_conversation_is_drafted_on_past_its_end():
    drafter = make_suffix_drafter(SuffixSettings(memory=False))
    # "1 2 3 1 2" stood before, followed by "3 1 2" and then the conversation's end: the draft reads
    # on into itself, so the loop goes on for as many tokens as the match is long (5), not 3
    draft = drafter.propose([1, 2, 3, 1, 2, 3, 1, 2], 8)
    assert draft.tokens == [3, 1, 2, 3, 1] and draft.source == "suffix"


def test_the_better_draft_of_conversation_and_memory_goes():
    drafter = suffix_with_memory([9, 1, 2, 7, 7, 7, 7])
    # the conversation has "1 2" once, followed by 5; the memory's "9 1 2" matches longer and drafts further
    assert drafter.propose([1, 2, 5, 9, 1, 2], 8).source == "history"
    assert drafter.propose([1, 2, 5, 9, 1, 2], 8).tokens == [7, 7, 7]
    drafter.paused = frozenset({"history"})  # the gate can pause either source
    assert drafter.propose([1, 2, 5, 9, 1, 2], 8).tokens == [5, 9] and drafter.propose([1, 2, 5, 9, 1, 2], 8).source == "suffix"


def test_the_conversations_draft_goes_when_it_is_as_likely_as_the_memorys_or_more():
    drafter = suffix_with_memory([1, 2, 9, 9])
    # the conversation matched "5 1 2" and drafts three tokens; the memory only "1 2", and two
    draft = drafter.propose([5, 1, 2, 3, 4, 5, 1, 2], 8)
    assert (draft.tokens, draft.source) == ([3, 4, 5], "suffix")
    tie = suffix_with_memory([1, 2, 3, 4])  # the same continuation on both sides, counted alike
    draft = tie.propose([1, 2, 3, 4, 1, 2], 8)
    assert (draft.tokens, draft.source) == ([3, 4], "suffix")


def test_with_the_conversation_paused_the_memory_drafts_and_with_both_nothing_does():
    drafter = suffix_with_memory([1, 2, 9, 9])
    drafter.paused = frozenset({"suffix"})
    draft = drafter.propose([5, 1, 2, 3, 4, 5, 1, 2], 8)
    assert (draft.tokens, draft.source) == ([9, 9], "history")
    drafter.paused = frozenset({"suffix", "history"})
    assert drafter.propose([5, 1, 2, 3, 4, 5, 1, 2], 8).tokens == []
    alone = make_suffix_drafter(SuffixSettings(memory=False))
    alone.paused = frozenset({"suffix"})
    assert alone.propose([1, 2, 3, 1, 2], 8).tokens == []


def test_the_backend_exposes_the_memory_the_settings_ask_for(target, drafters):
    bounded = SuffixSettings(memory_replies=3, memory_tokens=50)
    for settings, has in ((SpeculativeSettings("suffix", suffix=bounded), True),
                          (SpeculativeSettings("suffix", suffix=SuffixSettings(memory=False)), False),
                          (SpeculativeSettings("ngram"), False)):
        backend = SpeculativeBackend(target, make_drafter(settings, target), 4)
        assert isinstance(backend.memory, SuffixIndex) == has
    memory = SpeculativeBackend(target, make_drafter(SpeculativeSettings("suffix", suffix=bounded), target), 4).memory
    assert (memory.max_sequences, memory.max_tokens) == (3, 50)
    front = make_suffix_drafter(bounded)  # in front of a model drafter, the memory is still the one filled
    both = SuffixFirst(drafters["mtp"]("exact"), front, 6, 2)
    assert SpeculativeBackend(target, both, 4).memory is front.memory
    assert both.sources == ("suffix", "history", "mtp")  # what the gate and the status bar tell apart
