"""The speculative run's own verify rows, recomputed independently of the loop, choose exactly
the tokens a correct run emitted (strict or not, every drafter, greedy and seeded sampling)."""
import pytest

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.replay import verify_row_choice
from specchat.verify import fresh
from tests.speculative.conftest import PROMPTS, SAMPLINGS, engine


@pytest.mark.parametrize("method", ["ngram", "draft", "self", "mtp+lookup", "dflash"])  # self: long first blocks
@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["greedy", "t0.8"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_recomputed_rows_choose_what_the_run_emitted(tiny_pair, drafters, method, sampling, precision):
    target = engine(tiny_pair[0], precision)
    spec = SpeculativeBackend(target, drafters_for(drafters, method, target, tiny_pair), 4, strict=None)
    request = Request(messages=PROMPTS[1])
    out = run_to_summary(fresh(spec).stream(request, sampling))
    assert out.drafts > 0 and out.prefill_start == 0
    prompt = target.prompt_ids(request)
    chosen = [verify_row_choice(target, prompt, out.token_ids, out.pass_log, i, sampling, spec.strict)
              for i in range(len(out.token_ids))]
    assert chosen == out.token_ids


def drafters_for(drafters, method, target, tiny_pair):
    """The conftest drafters run on its float32 target; the model-free and draft-model ones suit any."""
    if method in ("ngram", "draft", "self"):
        return drafters[method]("exact")
    from tests.speculative.conftest import mtp_drafter, with_lookup
    if method == "mtp+lookup":
        return with_lookup(mtp_drafter(target, tiny_pair[0]))
    from specchat.backends.speculative.dflash import DFlashDrafter
    return DFlashDrafter(drafters["dflash"]("exact").model, target)


def test_the_strict_flag_says_how_rows_were_computed(tiny_pair, drafters):
    """Summary.exact_tokens: every token under strict verification, up to the first multi-row
    pass without it; a target-only run is exact throughout."""
    sampling = Sampling(max_tokens=30)
    request = Request(messages=PROMPTS[0])
    for strict in (True, False):
        target = engine(tiny_pair[0], "bfloat16")
        out = run_to_summary(fresh(SpeculativeBackend(target, drafters["ngram"]("exact"), 3, strict=strict))
                             .stream(request, sampling))
        first_block = next(sum(n for _, n in out.pass_log[:j]) for j, (d, _) in enumerate(out.pass_log) if d)
        assert out.exact_tokens == (out.tokens if strict else first_block)
        ref = run_to_summary(fresh(target).stream(request, sampling))
        assert ref.exact_tokens == ref.tokens and ref.prefill_start == 0


def test_the_replay_runs_on_an_engine_whose_cache_is_empty(tiny_pair, drafters):
    """A fresh engine (say, another process's, or one just emptied) replays a run as well as the
    one that made it: the replay empties the cache itself and needs nothing in it."""
    target = engine(tiny_pair[0])
    spec = SpeculativeBackend(target, drafters["ngram"]("exact"), 3)
    request, sampling = Request(messages=PROMPTS[0]), Sampling(max_tokens=12)
    out = run_to_summary(fresh(spec).stream(request, sampling))
    other = engine(tiny_pair[0])  # nothing cached
    prompt = target.prompt_ids(request)
    assert [verify_row_choice(other, prompt, out.token_ids, out.pass_log, i, sampling, spec.strict)
            for i in (0, len(out.token_ids) - 1)] == [out.token_ids[0], out.token_ids[-1]]


def test_a_token_past_the_reply_is_refused(tiny_pair, drafters):
    target = engine(tiny_pair[0])
    spec = SpeculativeBackend(target, drafters["ngram"]("exact"), 3)
    request, sampling = Request(messages=PROMPTS[0]), Sampling(max_tokens=8)
    out = run_to_summary(fresh(spec).stream(request, sampling))
    prompt = target.prompt_ids(request)
    for index in (-1, len(out.token_ids)):
        with pytest.raises(ValueError, match=f"token {index} is not in a reply of {len(out.token_ids)} tokens"):
            verify_row_choice(target, prompt, out.token_ids, out.pass_log, index, sampling, spec.strict)


def test_recomputed_rows_choose_under_the_runs_constraint(tiny_pair, drafters):
    """A constrained run's rows chose among the tokens its constraint allowed at each one; the
    replay applies the same mask (the tiny model's unconstrained choices are mostly not allowed)."""
    from tests.speculative.test_constrained_parity import MAX, REGEX

    target = engine(tiny_pair[0], "float32")
    spec = SpeculativeBackend(target, drafters["self"]("exact"), 4, strict=None)
    request = Request(messages=PROMPTS[1], constraint=REGEX)
    sampling = Sampling(max_tokens=MAX)
    out = run_to_summary(fresh(spec).stream(request, sampling))
    assert out.drafts > 0 and out.prefill_start == 0
    prompt = target.prompt_ids(request)
    chosen = [verify_row_choice(target, prompt, out.token_ids, out.pass_log, i, sampling, spec.strict, REGEX)
              for i in range(len(out.token_ids))]
    assert chosen == out.token_ids
    free = [verify_row_choice(target, prompt, out.token_ids, out.pass_log, i, sampling, spec.strict)
            for i in range(len(out.token_ids))]
    assert free != out.token_ids  # the mask changed what some row chose: the test can see a replay without it
