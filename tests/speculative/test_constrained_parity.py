"""Parity under constraints: constrained speculative output == constrained target-only output for
every drafter, depth and sampling mode, and every reply keeps its constraint; a planted bug that
gives verify rows the mask of the wrong prefix is a mismatch; a dead end stops both alike."""
import json

import pytest

from specchat.backends.base import STOP_CONSTRAINT, STOP_EOS, Constraint, Request, Sampling
from specchat.backends.speculative import backend as backend_module
from specchat.backends.speculative import loop as loop_module
from specchat.backends.speculative.loop import Draft, Drafter
from specchat.compare import MISMATCH
from specchat.constraints import reply_problem
from specchat.verify import check_prompt
from tests.speculative.conftest import PROMPTS, compare
from tests.speculative.test_planted_bugs import mutate

SCHEMA = Constraint("json_schema", json.dumps({
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["fox", "dog"]}},
    "required": ["n", "tag"], "additionalProperties": False}), "tiny.json")
REGEX = Constraint("regex", r"(the|a) (quick|lazy) [a-z]{1,4}( [0-9]{1,2})?", "--regex")
GRAMMAR = Constraint("grammar", 'root ::= "answer: " ("yes" | "no") (", " [a-z]{1,3}){0,2}', "answer.gbnf")
CONSTRAINTS = {"schema": SCHEMA, "regex": REGEX, "grammar": GRAMMAR}
KINDS = list(CONSTRAINTS)
MAX = 48  # room for the longest reply each allows on the tiny model's 320-token vocabulary
# (depth, sampling): greedy and seeded sampling, plain and with top-k / top-p, at several depths
CASES = [(2, Sampling(max_tokens=MAX)), (5, Sampling(temperature=0.8, seed=3, max_tokens=MAX)),
         (3, Sampling(temperature=1.2, top_k=20, top_p=0.9, seed=5, max_tokens=MAX))]
CASE_IDS = ["greedy-d2", "t0.8-d5", "t1.2-topk-topp-d3"]
METHODS = ["ngram", "ngram-copy", "draft", "self", "mtp", "mtp-prenorm", "dflash", "eagle3", "mtp+lookup",
           "draft+lookup", "dspark"]


def constrained(messages, constraint):
    return Request(messages=messages, constraint=constraint)


def check_reply(summary, constraint):
    assert summary.stop_reason == STOP_EOS, f"{summary.stop_reason}: {summary.text!r}"
    assert reply_problem(constraint, summary.text) is None, summary.text


@pytest.mark.parametrize("method, case", [(m, (i + j) % len(CASES)) for i, m in enumerate(METHODS) for j in (0, 1)],
                         ids=[f"{m}-{CASE_IDS[(i + j) % len(CASES)]}" for i, m in enumerate(METHODS) for j in (0, 1)])
def test_constrained_speculative_equals_constrained_target_only(target, drafters, method, case):
    """Every drafter under two of the three (depth, sampling) cases, the cases rotating over drafters."""
    depth, sampling = CASES[case]
    kind = KINDS[(METHODS.index(method) + case) % len(KINDS)]  # each drafter meets every kind of constraint
    constraint = CONSTRAINTS[kind]
    ref, out, verdict = compare(target, drafters[method]("exact"), depth, sampling, PROMPTS[case % 2],
                                constraint=constraint)
    assert verdict.kind == "identical", f"{kind}: {verdict.line()}"
    assert out.token_ids == ref.token_ids and out.stop_reason == ref.stop_reason
    check_reply(ref, constraint)
    assert out.passes <= ref.passes


class Oracle(Drafter):
    """Drafts the constrained target-only reply itself: every draft is what the target's masked
    choice will be, so each is kept only if every verify row has the mask of its own prefix."""

    name = "oracle"

    def __init__(self, prompt_len: int, reply: list[int]):
        self.prompt_len, self.reply = prompt_len, reply

    def propose(self, tokens, depth):
        done = len(tokens) - self.prompt_len
        return Draft(self.reply[done:done + depth])


def oracle(target, request, sampling, depth=4):
    """A speculative backend whose drafter proposes the constrained target-only reply to `request`."""
    from specchat.backends.base import run_to_summary
    from specchat.verify import fresh

    reply = run_to_summary(fresh(target).stream(request, sampling)).token_ids
    return backend_module.SpeculativeBackend(target, Oracle(len(target.prompt_ids(request)), reply), depth)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sampling", [CASES[0][1], CASES[2][1]], ids=["greedy", "t1.2-topk-topp"])
def test_drafts_of_the_constrained_reply_are_all_kept(target, kind, sampling):
    from specchat.backends.base import run_to_summary
    from specchat.verify import fresh

    request = constrained(PROMPTS[0], CONSTRAINTS[kind])
    ref = run_to_summary(fresh(target).stream(request, sampling))
    check_reply(ref, CONSTRAINTS[kind])
    depth = 4
    out = run_to_summary(fresh(oracle(target, request, sampling, depth)).stream(request, sampling))
    assert out.token_ids == ref.token_ids and out.stop_reason == ref.stop_reason
    assert out.accepted_tokens == out.draft_tokens > 0
    assert out.passes == 1 + -(-(ref.tokens - 1) // (depth + 1))  # the prefill's token, then full passes


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_rejection_acceptance_samples_the_masked_distribution(target, drafters, method):
    """Rejection sampling is lossless in distribution, not seed for seed: its replies keep the
    constraint (a draft the mask forbids has target probability 0 and is never kept)."""
    from specchat.backends.base import run_to_summary
    from specchat.verify import fresh

    spec = backend_module.SpeculativeBackend(target, drafters[method]("rejection"), 4, "rejection")
    for seed, constraint in enumerate(CONSTRAINTS.values()):
        out = run_to_summary(fresh(spec).stream(constrained(PROMPTS[seed % 2], constraint),
                                                Sampling(temperature=1.0, seed=seed, max_tokens=MAX)))
        check_reply(out, constraint)


def test_a_dead_end_stops_speculative_and_target_only_alike(target, drafters, monkeypatch):
    """Where no token may follow, both stop with constraint_dead_end after the same tokens."""
    from specchat.backends.constraint import TokenMatcher

    allowed = TokenMatcher.allowed
    monkeypatch.setattr(TokenMatcher, "allowed", lambda self: None if self.consumed >= 5 else allowed(self))
    for method in ("self", "ngram", "draft"):
        ref, out, verdict = compare(target, drafters[method]("exact"), 4, Sampling(max_tokens=MAX), constraint=SCHEMA)
        assert verdict.kind == "identical", verdict.line()
        assert ref.stop_reason == out.stop_reason == STOP_CONSTRAINT and ref.tokens == out.tokens == 5


# the oracle drafts the constrained reply, so a row masked from the wrong prefix shows at once
PLANTED_RUNS = [(constrained(PROMPTS[0], SCHEMA), Sampling(max_tokens=MAX)),
                (constrained(PROMPTS[1], GRAMMAR), Sampling(temperature=0.9, seed=4, max_tokens=MAX))]
WRONG_PREFIX = {  # the matcher left at the committed tokens: every row gets the first row's mask
    "every verify row masked with the block's first prefix": [
        ("            matcher.advance([token])\n            self.advanced += 1\n",
         "            pass  # the drafts never advance the matcher\n"),
        ("        self.matcher.rollback(self.advanced - accepted)\n",
         "        self.matcher.advance(self.draft[:accepted])\n"),
        ("            if self.matcher.advance([token]) != 1:", "            if self.matcher.advance([token]) > 1:")],
}


@pytest.mark.parametrize("bug", sorted(WRONG_PREFIX))
def test_verify_reports_a_mismatch_for_a_row_masked_from_the_wrong_prefix(bug, target, monkeypatch):
    import specchat.backends.constrained as constrained_module

    mutant = mutate(constrained_module, WRONG_PREFIX[bug])
    monkeypatch.setattr(loop_module, "RowMasks", mutant.RowMasks)
    kinds = {check_prompt(oracle(target, request, sampling), target, request, sampling)[2].kind
             for request, sampling in PLANTED_RUNS}
    assert MISMATCH in kinds, f"{bug} went unnoticed: {sorted(kinds)}"


def test_the_unmutated_row_masks_pass_the_same_check(target):
    for request, sampling in PLANTED_RUNS:
        _, out, verdict = check_prompt(oracle(target, request, sampling), target, request, sampling)
        assert verdict.kind == "identical", verdict.line()
        check_reply(out, request.constraint)
