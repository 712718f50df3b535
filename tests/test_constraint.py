"""backends/constraint.py: constraints compiled against a model's vocabulary, the matcher's mask,
advance and rollback, and checking finished texts; backends/constrained.py's verify-row masks."""
import json

import pytest
import torch

from specchat.backends.base import BackendError, Constraint
from specchat.backends.constrained import RowMasks
from specchat.backends.constraint import compile_grammar, matcher_for, text_problem
from tests.native.tiny import VOCAB, make_tokenizer

SCHEMA = Constraint("json_schema", json.dumps({
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"], "additionalProperties": False}), "person.json")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def matcher(tok, constraint=SCHEMA):
    return matcher_for(constraint, tok, VOCAB, [tok.eos_token_id])


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_mask_follows_the_schema_and_allows_the_end_only_where_the_reply_may_end(tok):
    m = matcher(tok)
    first = m.allowed()
    assert first.shape == (VOCAB,) and first.dtype == torch.bool
    assert {tok.decode([i]) for i in first.nonzero().flatten().tolist()} <= {"{", '{"'}
    assert not first[tok.eos_token_id]
    reply = ids(tok, '{"name": "fox", "ok": true}')
    for i, t in enumerate(reply):
        mask = m.allowed()
        assert mask[t], f"token {i} of a valid reply masked"
        assert not mask[tok.eos_token_id]
        assert m.advance([t]) == 1
    assert m.finished and m.accepting
    last = m.allowed()
    assert last.nonzero().flatten().tolist() == [tok.eos_token_id]  # complete: only the end


def test_advance_stops_at_the_first_forbidden_token_and_the_matcher_stays_usable(tok):
    m = matcher(tok)
    good, bad = ids(tok, '{"name":'), ids(tok, "}}")
    assert m.advance(good + bad + good) == len(good)
    assert m.consumed == len(good)
    assert m.allowed() is not None and m.advance(ids(tok, " \"")) == len(ids(tok, " \""))


def test_rollback_returns_to_the_earlier_state(tok):
    m, fresh = matcher(tok), matcher(tok)
    reply = ids(tok, '{"name": "dog", "ok": false}')
    m.advance(reply[:3])
    fresh.advance(reply[:3])
    before = m.allowed()
    m.advance(reply[3:9])
    m.rollback(6)
    assert m.consumed == 3 and torch.equal(m.allowed(), before) and torch.equal(fresh.allowed(), before)
    with pytest.raises(RuntimeError):
        m.rollback(4)  # more than it advanced through


def advanced_through(tok, tokens):
    m = matcher(tok)
    assert m.advance(tokens) == len(tokens)
    return m


def test_row_masks_give_each_row_its_own_prefix_and_roll_back_with_the_verdict(tok):
    """The matcher rolled back after rejected drafts: pinned against a fresh matcher advanced
    through the committed tokens only."""
    reply = ids(tok, '{"name": "owl", "ok": true}')
    committed, draft = reply[:2], reply[2:7]
    m = advanced_through(tok, committed)
    rows = RowMasks(m, draft, frozenset([tok.eos_token_id]))
    assert rows.draft == draft and rows.allowed.shape == (len(draft) + 1, VOCAB)
    for i in range(len(draft) + 1):  # row i: the mask after committed + draft[:i]
        assert torch.equal(rows.allowed[i], advanced_through(tok, committed + draft[:i]).allowed())
    own = reply[4]  # the target kept two drafts, then chose its own token (here the reply's own)
    rows.settle(2, own, frozenset([tok.eos_token_id]))
    expected = advanced_through(tok, committed + draft[:2] + [own])
    assert m.consumed == expected.consumed == len(committed) + 3
    assert torch.equal(m.allowed(), expected.allowed())


def test_a_forbidden_draft_is_kept_to_be_rejected_and_what_follows_it_is_left_out(tok):
    reply = ids(tok, '{"name": "owl", "ok": true}')
    m = advanced_through(tok, reply[:2])
    forbidden = ids(tok, "}")[0]
    rows = RowMasks(m, [reply[2], forbidden, reply[3], reply[4]], frozenset([tok.eos_token_id]))
    assert rows.draft == [reply[2], forbidden]  # rejected at row 1: its mask cannot hold it
    assert not rows.allowed[1, forbidden]
    assert m.consumed == 3  # through the one allowed draft only
    rows.settle(1, reply[3], frozenset([tok.eos_token_id]))
    assert m.consumed == 4


def test_an_end_of_sequence_draft_is_left_to_the_target_s_own_row(tok):
    eos = tok.eos_token_id
    reply = ids(tok, '{"name": "a", "ok": true}')
    m = advanced_through(tok, reply[:-1])
    rows = RowMasks(m, [reply[-1], eos, reply[0]], frozenset([eos]))
    assert rows.draft == [reply[-1]] and rows.allowed[1].nonzero().flatten().tolist() == [eos]


class Dying:
    """A matcher over 4 tokens that allows every one until `limit` tokens are in, then none."""

    def __init__(self, consumed: int, limit: int):
        self.consumed, self.limit = consumed, limit

    def allowed(self):
        return None if self.consumed >= self.limit else torch.ones(4, dtype=torch.bool)

    def advance(self, tokens):
        self.consumed += len(tokens)
        return len(tokens)

    def rollback(self, n):
        self.consumed -= n


def test_drafts_that_lead_where_no_token_may_follow_are_cut_and_a_dead_end_is_said():
    m = Dying(consumed=2, limit=4)
    rows = RowMasks(m, [0, 1, 2, 3], frozenset())
    # rows 0 and 1 have masks, row 2 (after two drafts) none: the block verifies one draft, and the
    # next pass meets the dead end at its first row, as target-only decoding would after those tokens
    assert rows.draft == [0] and rows.allowed.shape == (2, 4) and m.consumed == 3 and not rows.dead_end
    rows.settle(1, 1, frozenset())
    assert m.consumed == 4
    assert RowMasks(m, [2, 3], frozenset()).dead_end and m.consumed == 4
    assert RowMasks(Dying(4, 4), [], frozenset()).dead_end


def test_drafts_that_all_pass_but_end_where_no_token_may_follow_lose_only_the_last():
    m = Dying(consumed=0, limit=3)
    rows = RowMasks(m, [0, 1, 2], frozenset())
    # every draft is allowed, but after the third no token may follow: the block verifies the first
    # two (rows 0..2 have masks), and the next pass meets the dead end at its first row
    assert rows.draft == [0, 1] and rows.allowed.shape == (3, 4) and m.consumed == 2 and not rows.dead_end
    rows.settle(2, 2, frozenset())
    assert m.consumed == 3 and RowMasks(m, [3], frozenset()).dead_end


def test_drafts_after_an_end_of_sequence_draft_are_never_read():
    m = Dying(consumed=0, limit=10)
    rows = RowMasks(m, [0, 3, 1, 2], frozenset([3]))  # 3 ends the sequence; 1 and 2 would be allowed after it
    assert rows.draft == [0] and rows.allowed.shape == (2, 4) and m.consumed == 1


def test_a_draft_past_the_mask_s_vocabulary_is_rejected_at_its_row():
    """A drafter whose vocabulary is wider than the constraint's (a padded draft model) may propose
    a token the mask has no entry for: forbidden, like any token the mask does not hold."""
    m = Dying(consumed=0, limit=10)
    for beyond in (4, 5):  # the first id past the mask, and one further
        rows = RowMasks(m, [0, beyond, 1], frozenset())
        assert rows.draft == [0, beyond] and rows.allowed.shape == (3, 4) and m.consumed == 1
        rows.settle(1, 2, frozenset())
        assert m.consumed == 2
        m.rollback(2)


@pytest.mark.parametrize("kind, text, problem", [
    ("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}', "invalid JSON schema: Unsatisfiable"),
    ("json_schema", '{"type": "objecx"}', "invalid JSON schema"),
    ("regex", "a(b", "invalid regular expression"),
    ("grammar", "start: (", "invalid grammar"),
    ("grammar", 'root ::= undefined', "invalid grammar"),
    ("grammar", 'start: foo', "unknown name: \"foo\""),
])
def test_a_bad_constraint_is_one_line_naming_its_origin(kind, text, problem):
    with pytest.raises(BackendError) as e:
        compile_grammar(Constraint(kind, text, "where.txt"))
    assert str(e.value).startswith("where.txt: invalid ") and problem in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("grammar", ['start: <|nonexistent|>', "start: <[99999]>"])
def test_a_grammar_this_vocabulary_cannot_satisfy_is_refused_in_one_line(tok, grammar):
    with pytest.raises(BackendError) as e:
        matcher(tok, Constraint("grammar", grammar, "g.lark"))
    assert str(e.value).startswith("g.lark: this model's vocabulary cannot follow it") and "\n" not in str(e.value)


def test_compiled_matchers_are_kept_per_tokenizer_and_constraint(tok):
    from specchat.backends import constraint as module

    matcher(tok)
    kept = len(module._MATCHERS)
    a, b = matcher(tok), matcher(tok)
    assert len(module._MATCHERS) == kept and a.ll is not b.ll  # one compilation, a matcher each
    a.advance(ids(tok, "{"))
    assert b.consumed == 0 and b.allowed()[ids(tok, "{")[0]]


@pytest.mark.parametrize("kind, text, good, bad", [
    ("regex", r"\d{3}-\d{4}", "555-1234", "555-12345"),
    ("grammar", 'root ::= "yes" | "no"', "no", "nope"),
    ("grammar", 'start: "a"+ "b"', "aaab", "aaa"),
])
def test_text_problem_judges_whole_texts(kind, text, good, bad):
    c = Constraint(kind, text, "x")
    assert text_problem(c, good) is None
    assert text_problem(c, bad) is not None
