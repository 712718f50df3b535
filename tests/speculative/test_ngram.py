"""Prompt lookup: which tokens the n-gram index proposes, and copying runs drafting past the depth."""
import random

import pytest

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.speculative.ngram import COPY_MIN, NgramIndex
from specchat.verify import fresh
from tests.speculative.conftest import Counting, compare


def test_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6]
    assert index.propose(tokens, 3) == [8, 2]  # "5 6" last seen before position 6
    assert index.propose(tokens + [8], 3) == [2, 9, 5]  # "5 6 8" matches, longer than "6 8" or "8"
    assert index.propose(tokens + [8], 2) == [2, 9]
    assert index.propose([1, 2, 3], 4) == []


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_a_match_of_n_tokens_proposes_at_most_n(n):
    rng = random.Random(n)
    text = [rng.randrange(1000, 2000) for _ in range(12)]
    tokens = text + [7] * 3 + text[:n]  # the last n tokens stood at the start, and no more of them
    assert NgramIndex(1, 4).propose(tokens, 8) == text[n:2 * n]
    assert NgramIndex(1, 4).propose(tokens, 1) == text[n:n + 1]


def test_index_follows_a_rollback():
    index = NgramIndex(1, 2)
    assert index.propose([1, 2, 3, 1], 2) == [2]  # a 1-token match drafts one token
    assert index.propose([4, 2, 3, 4, 2], 2) == [3, 4]  # rebuilt: nothing of [1, 2, 3, 1] is left


def test_a_sequence_shorter_than_the_longest_n_gram_still_finds_shorter_matches():
    assert NgramIndex(1, 3).propose([5, 5], 2) == [5]  # too short for 3- and 2-grams; the 1-gram matches


def test_a_growing_sequence_extends_the_index_in_place():
    index = NgramIndex(1, 2)
    index.propose([1, 2, 3, 1], 2)
    held = index.next_after
    assert index.propose([1, 2, 3, 1, 2], 2) == [3, 1] and index.next_after is held  # not rebuilt each pass


def copying(span: int, tail: int) -> list[int]:
    """A sequence whose last `tail` tokens repeat tokens that came `span` earlier."""
    rng = random.Random(span)
    first = [rng.randrange(1000, 2000) for _ in range(span)]
    return [7, 7] + first + first[:tail]


@pytest.mark.parametrize("run", [COPY_MIN, 10, 11, 20, 40])
def test_copying_run_drafts_up_to_copy_depth_and_one_fewer_than_the_run(run):
    tokens = copying(60, run)
    index = NgramIndex(2, 3, copy_depth=16)
    assert index.propose(tokens, 3) == tokens[2 + run:2 + run + min(16, run - 1)]
    assert index.propose(tokens, 3, copy_depth=5) == tokens[2 + run:2 + run + 5]  # the loop's cap for this pass


def test_a_copying_run_from_the_first_token_is_as_long_as_the_tokens_before_it():
    rng = random.Random(3)
    first = [rng.randrange(1000, 2000) for _ in range(11)]
    first[10] = first[9]  # so an index past the first token, wrapping round to the last, would match too
    tokens = first + first[:10]  # the last 10 tokens repeat the first 10: a run of exactly 10
    assert NgramIndex(2, 3, copy_depth=16).propose(tokens, 3) == tokens[10:19]  # one fewer than the run


def test_short_matches_and_no_copy_depth_keep_the_depth():
    assert NgramIndex(2, 3, copy_depth=16).propose(copying(60, COPY_MIN - 1), 3) == copying(60, 0)[2 + 7:2 + 10]
    assert NgramIndex(2, 3).propose(copying(60, 30), 3) == copying(60, 0)[2 + 30:2 + 33]
    # a copy cap of 0 for this pass: the run drafts as any match, no more tokens than the match is long
    assert NgramIndex(2, 3, copy_depth=16).propose(copying(60, 30), 5, copy_depth=0) == copying(60, 0)[2 + 30:2 + 33]
    # a copying run shorter than the depth still drafts the depth
    assert len(NgramIndex(2, 3, copy_depth=16).propose(copying(60, COPY_MIN), 10)) == 10


def looping_prompt(target) -> list[int]:
    """A prompt whose greedy reply from this random model falls into a loop (a stretch of
    COPY_MIN + 6 tokens that repeats itself with a period of at most 8), found from target-only
    replies alone."""
    span = COPY_MIN + 6
    for t in range(5, target.model.cfg.vocab_size, 7):
        prompt = [1, t, t, t]
        r = run_to_summary(fresh(target).stream(Request(prompt_ids=prompt), Sampling(max_tokens=60))).token_ids
        if any(all(r[i + j] == r[i + j - p] for j in range(span))
               for p in range(1, 9) for i in range(p, len(r) - span + 1)):
            return prompt
    raise AssertionError("no prompt [1, t, t, t] made the tiny target loop; pick another probe")


@pytest.mark.parametrize("depth", [1, 3])
def test_copying_runs_draft_past_the_depth_and_keep_parity(target, drafters, depth):
    """In a loop of the target's own text, lookup drafts the run at once, and the output is
    still the target's own, in fewer passes than with the depth alone."""
    prompt, sampling = looping_prompt(target), Sampling(max_tokens=60)
    drafter = drafters["ngram-copy"]("exact")  # copy_depth 12
    counted = Counting(drafter.index)
    ref, out, verdict = compare(target, drafter, depth, sampling, prompt_ids=prompt)
    assert verdict.kind == "identical", verdict.line()
    assert out.tokens == ref.tokens and out.stop_reason == ref.stop_reason
    assert counted.longest > depth
    _, plain, _ = compare(target, drafters["ngram"]("exact"), depth, sampling, prompt_ids=prompt)
    assert out.passes < plain.passes


def test_lookup_first_copies_past_its_lookup_depth(target, drafters):
    drafter = drafters["mtp+lookup-copy"]("exact")  # lookup depth 4, copy depth 12
    counted = Counting(drafter.index)
    ref, out, verdict = compare(target, drafter, 1, Sampling(max_tokens=60), prompt_ids=looping_prompt(target))
    assert verdict.kind == "identical", verdict.line()
    assert counted.longest > 4
