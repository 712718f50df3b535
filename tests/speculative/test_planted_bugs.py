"""Plant the classic speculative-decoding bugs into a copy of the real code and show that the
checks catch each one: `specchat verify`'s comparison reports a mismatch, or (for drafter bugs,
which exact acceptance makes harmless to the output) the self-drafting bookkeeping check fails.
Each mutation names the exact line it changes, so these tests break loudly if the code moves."""
import inspect
import sys
import types

import pytest

import specchat.backends.speculative.drafters as drafters_module
import specchat.backends.speculative.loop as loop_module
from specchat.backends.base import Request, Sampling
from specchat.backends.speculative import backend as backend_module
from specchat.compare import MISMATCH
from specchat.verify import check_prompt
from tests.speculative.conftest import PROMPTS, engine

LOOP_BUGS = {
    "off-by-one in the accepted count": [  # keeps the first rejected draft too, cache and all
        ("new = verdict.tokens(d)", "new = list(d[:verdict.accepted + 1]) + [verdict.token]"),
        ("target.truncate(n + verdict.accepted)", "target.truncate(min(n + verdict.accepted + 1, n + len(d)))")],
    "KV cache not rolled back": [  # rejected drafts stay in the cache; the next block goes after them
        ("target.truncate(n + verdict.accepted)", "target.truncate(n + len(d))"),
        ("target.forward([tokens[-1]] + d, n - 1, layers, row_exact=strict, head=False)",
         "target.forward([tokens[-1]] + d, len(target.cached), layers, row_exact=strict, head=False)")],
    "bonus token dropped": [
        ("step, hit_eos = emit(new, d, verdict.accepted, strict or not d, source, why)",
         "step, hit_eos = emit(new[:-1] if d and verdict.accepted == len(d) else new, d, verdict.accepted, strict or not d,"
         " source, why)")],
    "target verified at the wrong positions": [
        ("positions = list(range(n, n + len(d) + 1))", "positions = list(range(n + 1, n + len(d) + 2))")],
}

DRAFTER_BUGS = {
    "drafter fed the previous position's token": [
        ("state, _ = e.forward(tokens[reuse:], reuse, all_logits=False, head=False)",
         "state, _ = e.forward(list(tokens[reuse:-1]) + [tokens[-2]], reuse, all_logits=False, head=False)")],
    "drafter samples with the wrong position's noise": [
        ("token = self._pick(state, n + i, qs)", "token = self._pick(state, n + i + 1, qs)")],
}


def mutate(module, edits) -> types.ModuleType:
    source = inspect.getsource(module)
    for old, new in edits:
        assert source.count(old) == 1, f"the line to mutate is gone or ambiguous: {old}"
        source = source.replace(old, new)
    mutant = types.ModuleType(module.__name__ + "_mutant")
    sys.modules[mutant.__name__] = mutant  # dataclasses look their module up there
    exec(compile(source, module.__file__, "exec"), mutant.__dict__)
    return mutant


@pytest.fixture
def self_drafter(tiny_pair):
    return lambda cls: cls.DraftModelDrafter(engine(tiny_pair[0]))


@pytest.mark.parametrize("bug", sorted(LOOP_BUGS))
def test_verify_reports_a_mismatch_for_each_loop_bug(bug, target, drafters, monkeypatch):
    mutant = mutate(loop_module, LOOP_BUGS[bug])
    monkeypatch.setattr(backend_module, "speculative_stream", mutant.speculative_stream)
    sampling = Sampling(temperature=0.9, seed=4, max_tokens=40)
    kinds = set()
    for method in ("draft", "ngram", "self"):
        spec = backend_module.SpeculativeBackend(target, drafters[method]("exact"), 4)
        for messages in PROMPTS:
            _, _, verdict = check_prompt(spec, target, Request(messages=messages), sampling)
            kinds.add(verdict.kind)
    assert MISMATCH in kinds, f"{bug} went unnoticed"


def test_the_unmutated_loop_passes_the_same_check(target, drafters):
    sampling = Sampling(temperature=0.9, seed=4, max_tokens=40)
    for method in ("draft", "ngram", "self"):
        spec = backend_module.SpeculativeBackend(target, drafters[method]("exact"), 4)
        for messages in PROMPTS:
            assert check_prompt(spec, target, Request(messages=messages), sampling)[2].kind == "identical"


@pytest.mark.parametrize("bug", sorted(DRAFTER_BUGS))
def test_drafter_bugs_cannot_change_output_but_the_bookkeeping_check_sees_them(bug, target, tiny_pair):
    mutant = mutate(drafters_module, DRAFTER_BUGS[bug])
    sampling = Sampling(temperature=0.9, seed=4, max_tokens=40)
    spec = backend_module.SpeculativeBackend(target, mutant.DraftModelDrafter(engine(tiny_pair[0])), 4)
    _, out, verdict = check_prompt(spec, target, Request(messages=PROMPTS[0]), sampling)
    assert verdict.kind == "identical"  # exact acceptance: a drafter only proposes
    assert out.acceptance_rate < 1.0  # self-drafting must accept everything; this one does not


def accept_one_too_many(draft, target_choice):
    """`accept_exact` with the bug a sceptical user planted: after a match of 2 or more, the first
    rejected draft is kept too."""
    from specchat.backends.speculative.acceptance import Verdict

    n = 0
    while n < len(draft) and draft[n] == target_choice[n]:
        n += 1
    if 2 <= n < len(draft):
        return Verdict(n + 1, int(target_choice[n + 1]))
    return Verdict(n, int(target_choice[n]))


@pytest.mark.slow
@pytest.mark.timeout(600)  # three real-model verify runs; on a busy 2-core machine past the default
@pytest.mark.parametrize("strict", ["true", "false"])
def test_verify_reports_an_acceptance_bug_as_a_mismatch_strict_or_not(strict, default_gguf, tmp_path, capsys,
                                                                      monkeypatch):
    """`specchat verify -p smollm2-ngram` exits 1 with a mismatch, never a near-tie: under strict
    verification any difference is a bug, and without it the speculative run's own verify row did
    not choose the token the bug emitted."""
    import json

    from specchat import cli

    from tests.test_prompts import SPEC_BENCH

    if not SPEC_BENCH.exists():
        pytest.skip(f"{SPEC_BENCH}: Spec-Bench's prompts are not on this machine")
    # a translation and a summarization prompt on which the bug fires within 56 tokens (token 42 and 15)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(line + "\n" for line in SPEC_BENCH.read_text().splitlines()
                               if json.loads(line)["question_id"] in (162, 241)))
    args = ["verify", "-p", "smollm2-ngram", "--prompts", str(prompts), "--max-tokens", "56", "--json",
            "--set", f"speculative.strict={strict}"]

    def run() -> tuple[int, dict]:
        code = cli.main(args)
        return code, json.loads(capsys.readouterr().out)

    clean = run()[1] if strict == "false" else None  # the real near-ties of this arithmetic
    monkeypatch.setattr(loop_module, "accept_exact", accept_one_too_many)
    code, out = run()
    assert code == 1 and out["mismatches"] >= 1 and out["strict"] is (strict == "true")
    mismatch = next(c for c in out["prompts_checked"] if c["verdict"] == "mismatch")
    if strict == "true":
        assert out["near_ties"] == 0 and mismatch["strict"]
    else:  # a near-tie is only ever one the unplanted loop meets too, where the run's own row chose the token
        assert "own verify row chose" in mismatch["why"] and clean["mismatches"] == 0
        ties = {(c["id"], c["index"]) for c in clean["prompts_checked"] if c["verdict"] == "near-tie"}
        assert all((c["id"], c["index"]) in ties for c in out["prompts_checked"] if c["verdict"] == "near-tie")
