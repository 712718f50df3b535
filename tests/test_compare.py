"""Token alignment and the verdicts behind `specchat verify` and the A/B view."""
from specchat.compare import ENGINES_DIFFER, IDENTICAL, MISMATCH, NEAR_TIE, Verdict, judge_text, judge_tokens


def decode(ids):
    return "".join(chr(ord("a") + i) for i in ids)


def test_identical_replies():
    v = judge_tokens([1, 2, 3], [1, 2, 3], decode, stops=("eos", "eos"))
    assert v.kind == IDENTICAL and v.compared == 3 and v.ok


def test_divergence_is_a_near_tie_only_within_the_margin():
    gap = {2: 0.1}
    margin_at = lambda i, a, b: gap.get(i, 5.0)  # noqa: E731
    v = judge_tokens([1, 2, 3, 4], [1, 2, 5, 4], decode, margin_at, tie_margin=0.25)
    assert (v.kind, v.index, v.ref_text, v.other_text, v.margin) == (NEAR_TIE, 2, "d", "f", 0.1)
    v = judge_tokens([1, 2, 3, 4], [1, 7, 3, 4], decode, margin_at, tie_margin=0.25)
    assert v.kind == MISMATCH and v.index == 1 and not v.ok
    # without a way to score the divergence it is never assumed to be a tie
    assert judge_tokens([1, 2], [1, 3], decode).kind == MISMATCH


def test_a_reply_that_ends_early_is_a_mismatch_when_both_ran_to_their_end():
    # e.g. one side emitted a token past the context window, or stopped at a wrong end of sequence
    v = judge_tokens([1, 2, 3], [1, 2, 3, 4], decode, stops=("context_full", "context_full"))
    assert (v.kind, v.index, v.ref_text, v.other_text) == (MISMATCH, 3, "<context_full>", "e")
    v = judge_tokens([1, 2, 3], [1, 2, 3], decode, stops=("max_tokens", "eos"))
    assert v.kind == MISMATCH and v.index == 3 and "<max_tokens>" in v.line()


def test_a_cancelled_or_unjudged_end_is_only_a_shorter_reply():
    assert judge_tokens([1, 2, 3], [1, 2], decode, stops=("eos", "cancelled")).kind == IDENTICAL
    assert judge_tokens([1, 2, 3], [1, 2], decode).kind == IDENTICAL  # no stop reasons given (a partial view)


def test_text_alignment_for_servers_without_token_ids():
    assert judge_text("hello world", "hello world").kind == IDENTICAL
    v = judge_text("hello world", "hello there")
    assert v.kind == MISMATCH and v.index == 6 and v.by == "text"
    v = judge_text("the answer: forty-two, as said", "the answer: 41, as said")
    assert (v.ref_text, v.other_text) == ("forty-two, a", "41, as said")  # 12 characters from the divergence


def test_under_strict_verification_every_divergence_is_a_mismatch():
    """Strict: both runs computed the token with single-token arithmetic, so even a gap far inside
    the near-tie margin is a bug, and the verdict says why."""
    tiny_gap = lambda i, a, b: (10.0, 10.0 - 1e-6)  # noqa: E731
    v = judge_tokens([1, 2, 3], [1, 2, 5], decode, scores_at=tiny_gap, tie_margin=0.25, strict_until=3)
    assert v.kind == MISMATCH and v.strict and "strict" in v.why
    assert "(10.0000)" in v.line() and "(10.0000)" in v.line().split("vs")[1]  # both scores shown
    assert "verify row itself chose it" not in v.why
    # a strict divergence whose recomputed verify row chose the emitted token: that pass was not row-exact
    v = judge_tokens([1, 2, 3], [1, 2, 5], decode, scores_at=tiny_gap, strict_until=3, row_choice=lambda i: 5)
    assert v.kind == MISMATCH and "the speculative verify row itself chose it" in v.why
    v = judge_tokens([1, 2, 3], [1, 2, 5], decode, scores_at=tiny_gap, strict_until=3, row_choice=lambda i: 3)
    assert v.kind == MISMATCH and "verify row itself chose it" not in v.why
    # past the strict prefix the same gap is a near-tie, and says which arithmetic it was
    v = judge_tokens([1, 2, 3], [1, 2, 5], decode, scores_at=tiny_gap, tie_margin=0.25, strict_until=2,
                     not_strict="float32 rows of multi-row verify blocks")
    assert v.kind == NEAR_TIE and not v.strict and "not strict: float32 rows" in v.why


def test_a_reply_that_ends_early_is_strict_only_if_the_token_past_it_was():
    """The first token one reply has and the other lacks is where they part: strict when both
    runs computed up to and including that position with single-token arithmetic."""
    v = judge_tokens([1, 2, 3], [1, 2], decode, stops=("max_tokens", "eos"), strict_until=2)
    assert v.kind == MISMATCH and v.index == 2 and not v.strict
    assert judge_tokens([1, 2, 3], [1, 2], decode, stops=("max_tokens", "eos"), strict_until=3).strict


def test_the_margin_rule_where_no_row_can_be_recomputed():
    at_the_margin = lambda i, a, b: (10.0, 9.75)  # noqa: E731  (a gap of exactly 0.25)
    assert judge_tokens([1, 2, 3], [1, 2, 5], decode, scores_at=at_the_margin, tie_margin=0.25).kind == NEAR_TIE
    wide = judge_tokens([1, 2, 3], [1, 2, 5], decode, scores_at=lambda i, a, b: (10.0, 9.0), tie_margin=0.25)
    assert wide.kind == MISMATCH and "wider than the near-tie margin 0.25" in wide.why


def test_a_recomputed_verify_row_decides_over_any_margin():
    """The speculative run's own verify row: it chose the emitted token (a flip, even with a wide
    gap) or it did not (a bug, even with a tiny one)."""
    wide = lambda i, a, b: 4.0  # noqa: E731
    v = judge_tokens([1, 2, 3], [1, 2, 5], decode, wide, tie_margin=0.25, row_choice=lambda i: 5)
    assert v.kind == NEAR_TIE and "own verify row chose 'f'" in v.why
    tiny = lambda i, a, b: 1e-7  # noqa: E731
    v = judge_tokens([1, 2, 3], [1, 2, 5], decode, tiny, tie_margin=0.25, row_choice=lambda i: 3)
    assert v.kind == MISMATCH and "chose 'd', not the 'f' it emitted" in v.why


def test_identical_is_clean_only_when_both_replies_ended_alike():
    assert judge_tokens([1, 2, 3], [1, 2, 3], decode, stops=("eos", "eos")).clean
    shorter = judge_tokens([1, 2, 3], [1, 2], decode)  # no stop reasons: only the tokens both have compared
    assert shorter.kind == IDENTICAL and not shorter.complete and not shorter.clean
    assert judge_tokens([1, 2, 3], [1, 2, 3], decode).complete  # as long as each other: all compared
    v = judge_tokens([1, 2, 3], [1, 2], decode, stops=("eos", "cancelled"))
    assert v.kind == IDENTICAL and not v.clean and "stopped" in v.line()


def test_a_text_mismatch_shows_twelve_characters_of_each_side():
    v = judge_text("the answer is forty-two, as said before", "the answer is 41 and nothing else at all")
    assert (v.ref_text, v.other_text) == ("forty-two, a", "41 and nothi")


def test_text_replies_are_complete_only_when_both_ran_as_long():
    whole = judge_text("hello world", "hello world")
    assert whole.complete and whole.clean
    prefix = judge_text("hello world", "hello")
    assert prefix.kind == IDENTICAL and not prefix.complete and not prefix.clean


def test_a_mismatch_between_replies_that_ran_to_their_end_is_complete():
    assert judge_tokens([1, 2, 3], [1, 2, 5], decode, stops=("eos", "eos")).complete
    assert not judge_tokens([1, 2, 3], [1, 2, 5], decode, stops=("eos", "cancelled")).complete


def test_a_verdict_line_names_why_only_when_there_is_a_why():
    bare = Verdict(MISMATCH, 1, "a", "b", None, 2)
    assert "·" not in bare.line() and bare.line().endswith("'b'")
    assert Verdict(MISMATCH, 1, "a", "b", None, 2, why="the reason").line().endswith(" · the reason")


def test_an_engines_differ_line_shows_both_tokens_scores():
    v = Verdict(ENGINES_DIFFER, 2, "x", "c", 0.5, 4, ref_score=10.25, other_score=9.75, why="w")
    assert v.line() == "engines differ at token 2: 'c' (9.7500) (its own target-only) vs 'x' (10.2500) (reference) · w"
    unscored = Verdict(ENGINES_DIFFER, 2, "x", "c", None, 4, why="w")
    assert unscored.line() == "engines differ at token 2: 'c' (its own target-only) vs 'x' (reference) · w"


def test_without_a_strict_prefix_even_the_first_token_can_be_a_near_tie():
    """strict_until defaults to no strict tokens: a caller that says nothing about arithmetic
    gets the margin rule from token 0 on."""
    tiny_gap = lambda i, a, b: (10.0, 10.0 - 1e-6)  # noqa: E731
    v = judge_tokens([1, 2, 3], [4, 2, 3], decode, scores_at=tiny_gap, tie_margin=0.25)
    assert v.index == 0 and v.kind == NEAR_TIE and not v.strict


def test_a_text_mismatch_of_whole_replies_reads_complete():
    assert judge_text("hello world", "hello there").as_dict()["complete"] is True
