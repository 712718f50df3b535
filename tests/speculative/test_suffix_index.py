"""The suffix index against a brute-force reference of what it promises (suffix.py's docstring):
insertion, the longest match, the counts behind each draft token, bounded eviction and removal."""
from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specchat.backends.speculative.suffix import SuffixIndex, SuffixSettings

END = None


def brute_find(sequences: list[list[int]], context: list[int], max_tokens: int, s: SuffixSettings,
               sizes=(2, 4, 8), max_match=24, recent=256, loop=False):
    """Every occurrence found by scanning every sequence at every position: (tokens, probs, match)."""
    places = [(i, p) for i, seq in enumerate(sequences) for p in range(1, len(seq))]  # p: the token after

    def ends_with(i, p, pattern):
        seq = sequences[i]
        return p - len(pattern) >= 0 and seq[p - len(pattern):p] == pattern

    n = len(context)
    anchor, occurrences = 0, []
    for size in sorted(sizes, reverse=True):
        if size > n:
            continue
        occurrences = [(i, p) for i, p in places if ends_with(i, p, context[n - size:])]
        if occurrences:
            anchor = size
            break
    if not occurrences:
        return [], [], 0
    occurrences = occurrences[-recent:][::-1]  # the latest, newest first

    def match_of(i, p):
        return max(m for m in range(anchor, min(max_match, n) + 1) if ends_with(i, p, context[n - m:]))

    match = max(match_of(i, p) for i, p in occurrences)
    live = [(i, p) for i, p in occurrences if match_of(i, p) == match]
    cap = min(max_tokens, int(match * s.factor + s.offset + 1e-6))
    tokens, probs, prob = [], [], 1.0
    while len(tokens) < cap:
        k = len(tokens)

        def at(i, p):
            seq = sequences[i]
            if p + k < len(seq):
                return seq[p + k]
            last = loop and i == len(sequences) - 1
            return tokens[p + k - len(seq)] if last else END

        nexts = [at(i, p) for i, p in live]
        seen = [t for t in nexts if t is not END]
        if not seen:
            break
        best = max(seen, key=lambda t: (seen.count(t), -seen.index(t)))
        prob *= seen.count(best) / len(live)
        if prob < s.min_prob:
            break
        tokens.append(best)
        probs.append(prob)
        live = [o for o, t in zip(live, nexts) if t == best]
    return tokens, probs, match


def found(index: SuffixIndex, context, max_tokens, s, loop=False):
    f = index.find(context, max_tokens, s, loop)
    return f.tokens, f.probs, f.match


tokens = st.lists(st.integers(0, 5), min_size=0, max_size=60)  # a small vocabulary: many repeats
knobs = st.fixed_dictionaries({"min_prob": st.sampled_from([0.0, 0.1, 0.3, 0.6]),
                               "factor": st.sampled_from([0.5, 1.0, 2.0]),
                               "offset": st.sampled_from([0.0, 1.0])})


@settings(max_examples=300, deadline=None)
@given(st.lists(tokens, min_size=1, max_size=6), st.lists(st.integers(0, 5), min_size=1, max_size=30), knobs,
       st.integers(1, 12), st.sampled_from([1, 3, 256]))
def test_find_agrees_with_brute_force_over_many_sequences(sequences, context, knobs, depth, recent):
    s = SuffixSettings(**knobs)
    index = SuffixIndex(recent=recent, max_match=10)
    for key, seq in enumerate(sequences):
        index.add(key, seq)
    assert found(index, context, depth, s) == pytest.approx(
        brute_find(sequences, context, depth, s, recent=recent, max_match=10))


@settings(max_examples=300, deadline=None)
@given(tokens, st.lists(st.integers(1, 8), min_size=1, max_size=6), knobs, st.integers(1, 12))
def test_a_growing_conversation_drafts_from_itself_and_reads_on_into_a_loop(stream, steps, knobs, depth):
    s = SuffixSettings(**knobs)
    index = SuffixIndex(sizes=(1, 3, 6))
    context: list[int] = []
    for grow in steps:  # committed tokens arrive a few at a time, as passes commit them
        context = (stream + stream)[:len(context) + grow] or [0]
        index.sync(context)
        assert found(index, context, depth, s, loop=True) == pytest.approx(
            brute_find([context], context, depth, s, sizes=(1, 3, 6), loop=True))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove"]), tokens), min_size=1, max_size=25),
       st.integers(0, 4), st.integers(0, 80), st.lists(st.integers(0, 5), min_size=2, max_size=12))
def test_bounded_eviction_and_removal_keep_what_a_fifo_would(ops, max_sequences, max_tokens, context):
    index = SuffixIndex(max_sequences=max_sequences, max_tokens=max_tokens)
    model: OrderedDict[int, list[int]] = OrderedDict()
    for key, (op, seq) in enumerate(ops):
        if op == "remove" and model:
            victim = list(model)[len(seq) % len(model)]
            index.remove(victim)
            del model[victim]
            continue
        index.add(key, seq)
        model[key] = list(seq)
        while len(model) > 1 and ((max_sequences and len(model) > max_sequences)
                                  or (max_tokens and sum(map(len, model.values())) > max_tokens)):
            model.popitem(last=False)
        assert list(index.spans) == list(model)
        assert index.live_tokens == sum(map(len, model.values()))
        assert all(index.sequence(k) == v for k, v in model.items())
    s = SuffixSettings(min_prob=0.0)
    assert found(index, context, 8, s) == pytest.approx(brute_find(list(model.values()), context, 8, s))


def test_counts_pick_the_continuation_that_followed_most_often():
    index = SuffixIndex()
    for key, tail in enumerate([[7, 8], [7, 8], [9, 9], [7, 8]]):
        index.add(key, [1, 2, 3] + tail)
    f = index.find([5, 1, 2, 3], 4, SuffixSettings(min_prob=0.1))
    assert f.tokens == [7, 8] and f.probs == pytest.approx([0.75, 0.75]) and f.match == 3
    # a stricter threshold drafts nothing: three in four is not enough
    assert index.find([5, 1, 2, 3], 4, SuffixSettings(min_prob=0.8)).tokens == []


def test_a_longer_match_narrows_the_occurrences_and_drafts_further():
    index = SuffixIndex()
    index.add("a", [4, 1, 2, 10, 11, 12, 13])
    index.add("b", [5, 1, 2, 20, 21, 22, 23])
    assert index.find([5, 1, 2], 8).tokens == [20, 21, 22]  # "5 1 2" only in b: a match of 3 drafts 3
    assert index.find([0, 1, 2], 8, SuffixSettings(min_prob=0.5)).tokens == [20, 21]  # b is the newer of two
    assert index.find([0, 1, 2], 8, SuffixSettings(min_prob=0.6)).tokens == []


def test_removed_sequences_are_never_drafted_from_and_are_compacted_away():
    index = SuffixIndex()
    index.add("kept", [1, 2, 3, 4])
    for key in range(50):
        index.add(key, [9, 9, 8, 7, 6, 5] * 10)
        index.remove(key)
    assert index.find([9, 9], 4).tokens == []
    assert index.find([1, 2], 4).tokens == [3, 4]
    assert len(index.flat) < 50 * 61 / 2  # rebuilt once removed tokens outnumbered the live ones


def test_one_long_removed_sequence_is_compacted_away_at_once():
    index = SuffixIndex()
    index.add("kept", [1, 2, 3, 4])
    for key in range(3):  # each longer than the 1024 removed tokens the pool tolerates before a rebuild
        index.add(key, [5 + t % 7 for t in range(2000)])
        index.remove(key)
        assert index.flat.tolist() == [1, 2, 3, 4] and index.live_tokens == 4
    assert index.find([1, 2], 4).tokens == [3, 4] and index.find([5, 6], 4).tokens == []


def test_a_few_removed_tokens_among_many_live_ones_are_left_as_separators():
    index = SuffixIndex()
    index.add("kept", [5 + t % 7 for t in range(2000)])
    index.add("gone", [1, 2, 3, 4])
    flat = index.flat
    index.remove("gone")  # 4 removed tokens against 2000 live ones: not worth a rebuild
    assert index.flat is flat and len(flat) == 2005 and index.live_tokens == 2000
    assert index.find([1, 2], 4).tokens == [] and index.find([5, 6], 2).tokens == [7, 8]


def positions_indexed(index: SuffixIndex) -> list[int]:
    """How many positions each anchor table holds."""
    return [sum(1 if type(held) is int else len(held) for held in table.values()) for table in index.tables]


def test_only_n_grams_inside_one_sequence_are_indexed():
    """An n-gram is kept for the token after it only while it lies inside that token's sequence:
    none reaches over a separator into the sequence before, nor before the pool's start."""
    index = SuffixIndex(sizes=(2, 4), max_match=8)
    index.add("a", [1, 2, 3])
    index.add("b", [4, 5, 6, 7, 8])
    # a sequence of L tokens holds L - size positions for each anchor size below L
    assert positions_indexed(index) == [(3 - 2) + (5 - 2), 5 - 4]


def test_an_n_gram_whose_hash_equals_the_tail_s_is_not_an_occurrence_of_it():
    # two 4-grams with one hash under CPython's (64-bit) tuple hash, found by search: the tables are
    # keyed by the hash, so only comparing the tokens tells them apart
    held, tail = (711, 977, 352, 0), (10, 70, 82, 559525029)
    if hash(held) != hash(tail):
        pytest.skip("this interpreter's tuple hash does not make these two collide")
    index = SuffixIndex()
    index.add("a", [*held, 5, 6, 7, 8])
    assert index.find([1, *tail], 4).tokens == []
    index.add("b", [*tail, 9, 9])
    f = index.find([1, *tail], 4)
    assert f.tokens == [9, 9] and f.probs == [1.0, 1.0]  # drafted from the real occurrence alone


def test_rollback_rebuilds_the_conversation():
    index = SuffixIndex()
    index.sync([1, 2, 3, 1, 2])
    assert index.find([1, 2, 3, 1, 2], 4, loop=True).tokens == [3, 1]
    index.sync([4, 2, 3, 4, 2])
    assert index.find([4, 2, 3, 4, 2], 4, loop=True).tokens == [3, 4] and index.sequences == 1


def test_removing_an_older_sequence_leaves_the_newest_growing():
    index = SuffixIndex(max_sequences=2)
    for key, tokens in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [9, 9])):  # "c" evicts "a"
        index.add(key, tokens)
    index.extend([4, 5])  # `extend` grows the sequence added last, whatever else went ...
    index.remove("b")
    index.extend([6])  # ... evicted or removed
    assert index.sequence("c") == [9, 9, 4, 5, 6] and index.sequences == 1
    assert index.find([9, 9], 4).tokens == [4, 5]  # as far as the match is long


def test_a_conversation_that_only_grows_is_extended_in_place():
    index = SuffixIndex()
    index.sync([1, 2, 3])
    flat, tables = index.flat, index.tables
    index.sync([1, 2, 3, 1, 2])  # another list with the same tokens and more: the new ones are added,
    assert index.flat is flat and index.tables is tables  # nothing is rebuilt
    assert index.find([1, 2, 3, 1, 2], 4, loop=True).tokens == [3, 1] and index.sequences == 1
    index.sync([1, 2, 3, 1, 2])  # another list with the same tokens: nothing to add, nothing rebuilt
    assert index.flat is flat and index.tables is tables


class Watched(list):
    """The loop's token list, noting every read of its head (what comparing it with the index costs)."""

    def __init__(self, tokens):
        super().__init__(tokens)
        self.heads_read = []

    def __getitem__(self, i):
        if isinstance(i, slice) and not i.start:
            self.heads_read.append(i.stop)
        return super().__getitem__(i)


def test_the_loop_s_own_list_grown_again_is_extended_without_comparing_what_it_held():
    index, tokens = SuffixIndex(), Watched([1, 2, 3, 1])
    index.sync(tokens)
    for more in ([2], [3, 1], [2, 3]):  # each pass: the same list, only extended
        tokens.extend(more)
        tokens.heads_read.clear()
        index.sync(tokens)
        assert tokens.heads_read == []  # a long chat costs nothing more per pass
    assert index.flat.tolist() == [1, 2, 3, 1, 2, 3, 1, 2, 3] and index.sequences == 1
    assert index.find(tokens, 4, loop=True).tokens == [1, 2, 3, 1]


@pytest.mark.parametrize("sizes, max_match", [((), 24), ((0, 2), 24), ((2, 4, 8), 4)])
def test_anchor_sizes_must_be_positive_and_within_the_longest_match(sizes, max_match):
    with pytest.raises(ValueError, match="anchor sizes"):
        SuffixIndex(sizes=sizes, max_match=max_match)


def test_anchors_of_one_token_and_a_longest_match_of_the_largest_anchor_are_allowed():
    index = SuffixIndex(sizes=(1, 2), max_match=2)
    index.add("a", [5, 6, 7])
    assert index.find([9, 6], 4).tokens == [7]  # a one-token anchor


def one_at_a_time(index: SuffixIndex, items, extra=()) -> SuffixIndex:
    """Every token filed by `extend`'s one-token path (chunks shorter than BULK)."""
    for key, tokens in items:
        index.add(key, [])
        for t in tokens:
            index.extend([t])
    for t in extra:
        index.extend([t])
    return index


def state(index: SuffixIndex):
    return index.flat.tolist(), list(index.spans.items()), index.tables, index.live_tokens


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=150), min_size=1, max_size=6),
       st.lists(st.integers(0, 5), min_size=64, max_size=140), st.integers(0, 8), st.integers(0, 400))
def test_the_bulk_paths_file_exactly_what_one_token_at_a_time_files(seqs, more, max_sequences, max_tokens):
    items = list(enumerate(seqs))
    bulk = SuffixIndex()
    bulk.add_many(items)
    assert state(bulk) == state(one_at_a_time(SuffixIndex(), items))
    bulk.extend(more)  # a bulk extend of the newest
    assert state(bulk) == state(one_at_a_time(SuffixIndex(), items, more))
    # into a memory that already holds sequences: merged with the n-grams it has
    held = one_at_a_time(SuffixIndex(), items[:1])
    held.add_many(items[1:])
    assert state(held) == state(one_at_a_time(SuffixIndex(), items))
    # bounded: the same sequences live as after one `add` each, and the same drafts
    bounded = dict(max_sequences=max_sequences, max_tokens=max_tokens)
    many, each = SuffixIndex(**bounded), SuffixIndex(**bounded)
    many.add_many(items)
    for key, tokens in items:
        each.add(key, tokens)
    assert [(k, many.sequence(k)) for k in many.spans] == [(k, each.sequence(k)) for k in each.spans]
    for _, tokens in items:
        assert many.find(tokens[:-1] or [0], 8) == each.find(tokens[:-1] or [0], 8)


def test_numpy_hashes_are_python_s_tuple_hashes():
    import numpy as np

    from specchat.backends.speculative.suffix import tuple_hashes

    ids = np.random.default_rng(1).integers(0, 200_000, 500)
    for size in (1, 2, 4, 8):
        assert tuple_hashes(ids, size).tolist() == [hash(tuple(ids[i:i + size].tolist())) for i in range(len(ids) - size + 1)]
