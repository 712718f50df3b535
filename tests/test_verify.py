"""Which reply tokens two runs computed with the same arithmetic (verify.shared_arithmetic): the
tokens a divergence among which is a bug whatever the margin; and a target that does not reproduce
its own reply (verify --repeat), which no drafter is blamed for."""
import pytest

from specchat.backends.base import STOP_MAX_TOKENS, Request, Sampling, Summary, run_to_summary
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.drafters import NgramDrafter
from specchat.backends.native.engine import TorchBackend
from specchat.verify import (PromptCheck, check_prompt, fresh, judge_replies, row_choice_function, shared_arithmetic,
                             summarize)
from tests.native.tiny import make_hf_checkpoint
from tests.scripted import ScriptedBackend, piece_id


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("verify") / "target", "llama", seed=11)


def engine(path, precision="float32") -> TorchBackend:
    return TorchBackend(path, "hf_dir", precision=precision, threads=1, context=128)


@pytest.fixture(scope="module")
def target(checkpoint):
    return engine(checkpoint)


def summary(exact: int, prefill_start: int = 0) -> Summary:
    return Summary(STOP_MAX_TOKENS, token_ids=list(range(exact + 3)), exact_tokens=exact, prefill_start=prefill_start)


def test_the_same_engine_shares_arithmetic_up_to_the_shorter_exact_run(target, checkpoint):
    same = shared_arithmetic(target, target, summary(12), summary(8))
    assert same.exact_until == 8
    assert shared_arithmetic(target, target, summary(12), summary(0)).exact_until == 0
    assert shared_arithmetic(target, target, summary(0), summary(12)).exact_until == 0
    twin = engine(checkpoint)  # another engine with the same model and settings: the same arithmetic
    assert shared_arithmetic(target, twin, summary(12), summary(8)).exact_until == 8
    assert "float32 rows" in same.beyond(9)
    drafted = summary(12)
    drafted.pass_log = [([], 1), ([4, 5, 6], 4), ([], 1)]  # the prefill's token, a 4-row block, a single pass
    beyond = shared_arithmetic(target, target, summary(12), drafted).beyond
    assert "token 3 from a 4-row verify block" in beyond(3)
    assert "a single-token pass after multi-row ones" in beyond(5)
    drafted.pass_log = [([], 1), ([4], 2), ([], 1)]  # the smallest verify block: one draft, two rows
    assert "token 2 from a 2-row verify block" in shared_arithmetic(target, target, summary(12), drafted).beyond(2)


def test_a_backend_that_does_not_say_how_it_computed_shares_nothing(target):
    remote = ScriptedBackend(["hello there"])
    for ref, other in ((remote, target), (target, remote)):
        shared = shared_arithmetic(ref, other, summary(12), summary(12))
        assert shared.exact_until == 0 and "does not say" in shared.beyond


def test_other_settings_or_a_reused_prefix_share_nothing(target, checkpoint):
    bfloat16 = engine(checkpoint, "bfloat16")
    assert shared_arithmetic(target, bfloat16, summary(12), summary(12)).exact_until == 0
    reused = shared_arithmetic(target, target, summary(12), summary(12, prefill_start=5))
    assert reused.exact_until == 0 and "reused 5 cached tokens" in reused.beyond


def test_a_verify_row_is_recomputed_only_for_a_local_speculative_run(target):
    request, sampling = Request(prompt_ids=[5, 6, 7, 5, 6, 7, 5, 6]), Sampling(max_tokens=12)
    prompt = target.prompt_ids(request)
    spec = SpeculativeBackend(target, NgramDrafter(1, 3), 3)
    out = run_to_summary(fresh(spec).stream(request, sampling))
    choice = row_choice_function(spec, prompt, out, sampling)
    assert choice is not None and [choice(i) for i in range(len(out.token_ids))] == out.token_ids
    sampled = Sampling(temperature=0.8, seed=1, max_tokens=12)
    out = run_to_summary(fresh(spec).stream(request, sampled))
    assert row_choice_function(spec, prompt, out, sampled) is not None  # exact acceptance: seed-identical rows
    rejection = SpeculativeBackend(target, NgramDrafter(1, 3), 3, acceptance="rejection")
    assert row_choice_function(rejection, prompt, out, sampled) is None  # lossless in distribution only
    plain = run_to_summary(target.stream(request, sampling))
    assert row_choice_function(target, prompt, plain, sampling) is None  # target-only: no verify rows
    empty = Summary(STOP_MAX_TOKENS, prefill_start=0)
    assert row_choice_function(spec, prompt, empty, sampling) is None
    reused = Summary(STOP_MAX_TOKENS, token_ids=out.token_ids, pass_log=out.pass_log, prefill_start=3)
    assert row_choice_function(spec, prompt, reused, sampling) is None  # its prefill is not the replay's


def test_replies_are_compared_by_token_where_both_carry_ids_else_by_text(target):
    request, sampling = Request(prompt_ids=[5, 6, 7]), Sampling(max_tokens=4)
    ref = run_to_summary(target.stream(request, sampling))
    assert judge_replies(target, request, ref, ref, sampling).by == "tokens"
    text_only = Summary(STOP_MAX_TOKENS, text=ref.text)  # a server that returned no token ids
    assert judge_replies(target, request, ref, text_only, sampling).by == "text"


def test_the_backend_that_made_a_reply_tells_whether_its_divergence_was_strict(target):
    request, sampling = Request(prompt_ids=[5, 6, 7]), Sampling(max_tokens=6)
    ref = run_to_summary(fresh(target).stream(request, sampling))  # the whole prompt prefilled
    ids = list(ref.token_ids)
    ids[3] = (ids[3] + 1) % 50
    other = Summary(STOP_MAX_TOKENS, token_ids=ids, exact_tokens=ref.exact_tokens, prefill_start=0)
    v = judge_replies(target, request, ref, other, sampling, other_backend=target)
    assert v.index == 3 and v.kind == "mismatch" and v.strict  # single-token passes on both sides
    assert v.ref_score is not None and v.other_score is not None  # the reference's own scores, recomputed
    assert not judge_replies(target, request, ref, other, sampling).strict  # nothing says how it was computed


def test_a_local_speculative_runs_divergence_is_judged_by_its_own_recomputed_row(target):
    """Not strict (float32 rows): the reply's own verify row, recomputed, says whether the pass
    chose the token it emitted; a token it did not choose is a bug, named as such."""
    request, sampling = Request(prompt_ids=[5, 6, 7, 5, 6, 7, 5, 6]), Sampling(max_tokens=12)
    spec = SpeculativeBackend(target, NgramDrafter(1, 3), 3, strict=False)
    ref = run_to_summary(fresh(target).stream(request, sampling))
    out = run_to_summary(fresh(spec).stream(request, sampling))
    assert out.drafts > 0 and out.token_ids == ref.token_ids
    planted = list(out.token_ids)
    planted[4] = (planted[4] + 1) % 50  # what a wrong acceptance would have emitted there
    bug = Summary(STOP_MAX_TOKENS, token_ids=planted, pass_log=out.pass_log, prefill_start=0,
                  exact_tokens=out.exact_tokens)
    v = judge_replies(target, request, ref, bug, sampling, tie_margin=1e9, other_backend=spec)  # any gap a "tie"
    assert v.index == 4 and v.kind == "mismatch" and "not the" in v.why and "it emitted" in v.why


def test_without_the_backend_that_made_it_no_token_counts_as_strict(target):
    """A reply judged without its backend (nothing says how it was computed): even a divergence at
    its first token is judged by the margin, never called strict."""
    request, sampling = Request(prompt_ids=[5, 6, 7]), Sampling(max_tokens=6)
    ref = run_to_summary(fresh(target).stream(request, sampling))
    ids = list(ref.token_ids)
    ids[0] = (ids[0] + 1) % 50
    other = Summary(STOP_MAX_TOKENS, token_ids=ids, exact_tokens=ref.exact_tokens, prefill_start=0)
    v = judge_replies(target, request, ref, other, sampling)
    assert v.index == 0 and not v.strict


def test_a_servers_reported_alternatives_tell_a_near_tie_from_a_mismatch():
    server = ScriptedBackend(["a b c d"])  # a backend with no engine to recompute rows on
    t = {n: piece_id(f" t{n}") for n in range(1, 10)}
    request, greedy = Request(messages=[{"role": "user", "content": "x"}]), Sampling(max_tokens=4)
    ref = Summary(STOP_MAX_TOKENS, tokens=4, token_ids=[t[1], t[2], t[3], t[4]],
                  alternatives=[[(t[1], -0.1), (t[7], -3.0)], [(t[2], -0.50), (t[9], -0.62)],
                                [(t[3], -0.1), (t[8], -2.0)], None])
    close = Summary(STOP_MAX_TOKENS, tokens=4, token_ids=[t[1], t[9], t[3], t[4]])
    far = Summary(STOP_MAX_TOKENS, tokens=4, token_ids=[t[1], t[2], t[8], t[4]])
    unlisted = Summary(STOP_MAX_TOKENS, tokens=4, token_ids=[t[1], t[5], t[3], t[4]])
    tie = judge_replies(server, request, ref, close, greedy)
    assert tie.kind == "near-tie" and tie.index == 1 and tie.margin == pytest.approx(0.12)
    assert judge_replies(server, request, ref, far, greedy).kind == "mismatch"  # a gap of 1.9
    assert judge_replies(server, request, ref, unlisted, greedy).kind == "mismatch"  # not listed, and the
    # listed ones already end within the margin: how far it was is unknown, so no near-tie is assumed
    wide = Summary(STOP_MAX_TOKENS, tokens=4, token_ids=[t[5], t[2], t[3], t[4]])  # past the 3.0 gap to the last
    v = judge_replies(server, request, ref, wide, greedy)
    assert v.kind == "mismatch" and v.margin == pytest.approx(2.9)
    sampled = Sampling(max_tokens=4, temperature=0.7)  # logprobs are no score gap when sampling
    assert judge_replies(server, request, ref, close, sampled).kind == "mismatch"


def test_a_reference_that_gives_another_reply_when_run_again_is_not_reproducible():
    """A server whose second and third replies part from its first at token 2: the prompt's verdict
    is the target's, never a mismatch, and says where its runs part, how many differ and which
    run the speculative reply equals."""
    reference = ScriptedBackend(["a b c d", "a b x d"])  # the last reply repeats
    spec = ScriptedBackend(["a b x d"])
    request, greedy = Request(messages=[{"role": "user", "content": "q"}]), Sampling(max_tokens=4)
    ref, out, v = check_prompt(spec, reference, request, greedy, repeat=3)
    assert v.kind == "target not reproducible" and v.index == 2
    assert (v.ref_text, v.other_text) == (" c", " x")
    assert "2 of 3 target-only runs differ" in v.why and "equals run 2, 3" in v.why
    assert not ref.text.endswith("x d") and len(reference.requests) == 3
    assert v.ok and "target not reproducible" in v.line()
    once = ScriptedBackend(["a b c d", "a b x d"])
    assert check_prompt(ScriptedBackend(["a b x d"]), once, request, greedy)[2].kind == "mismatch"  # unrepeated
    shorter = ScriptedBackend(["a b c d", "a b c"])
    v = check_prompt(ScriptedBackend(["a b c d"]), shorter, request, greedy, repeat=2)[2]
    assert v.kind == "target not reproducible" and v.index == 3 and v.other_text == "<end>"
    assert "equals run 1" in v.why


def test_a_reproducible_target_is_never_called_unreproducible(target):
    request = Request(prompt_ids=[5, 6, 7, 5, 6, 7, 5, 6])
    spec = SpeculativeBackend(target, NgramDrafter(1, 3), 3)
    for sampling in (Sampling(max_tokens=12), Sampling(temperature=0.8, seed=4, max_tokens=12)):
        ref, out, v = check_prompt(spec, target, request, sampling, repeat=3)
        assert v.kind == "identical" and out.drafts > 0


def test_the_summary_counts_the_targets_run_to_run_agreement():
    from specchat.compare import Verdict
    from specchat.prompts import PromptItem

    def check(kind: str) -> PromptCheck:
        return PromptCheck(PromptItem("1", ["q"]), Summary(STOP_MAX_TOKENS), Summary(STOP_MAX_TOKENS), Verdict(kind),
                           reference_runs=3)

    totals = summarize([check("identical"), check("target not reproducible"), check("mismatch"), check("identical"),
                        check("engines differ")])
    assert (totals["identical"], totals["mismatches"], totals["target_not_reproducible"]) == (2, 1, 1)
    assert totals["engines_differ"] == 1
    assert totals["reference_runs"] == 3 and totals["target_reproducible_rate"] == 0.8


def test_a_reference_on_another_engine_is_judged_as_one():
    """-r naming another engine: the speculative reply is judged against its own target-only (the
    drafter's part) and that against the reference (the engines' part), never blaming the drafter
    for the engines."""
    request, greedy = Request(messages=[{"role": "user", "content": "q"}]), Sampling(max_tokens=4)
    other_engine = ScriptedBackend(["a b x d"])
    ref, out, v = check_prompt(ScriptedBackend(["a b c d"]), other_engine, request, greedy,
                               own=ScriptedBackend(["a b c d"]))
    assert v.kind == "engines differ" and v.index == 2 and v.ok
    assert (v.ref_text, v.other_text) == (" x", " c")  # the reference's token first, as in every verdict
    assert "is its own target-only reply" in v.why and "(its own target-only) vs ' x' (reference)" in v.line()
    v = check_prompt(ScriptedBackend(["a q c d"]), ScriptedBackend(["a b x d"]), request, greedy,
                     own=ScriptedBackend(["a b c d"]))[2]
    assert v.kind == "mismatch" and v.index == 1 and "against its own target-only reply" in v.why  # the drafter's
    v = check_prompt(ScriptedBackend(["a b c d"]), ScriptedBackend(["a b c d"]), request, greedy,
                     own=ScriptedBackend(["a b c d"]))[2]
    assert v.kind == "identical"
    assert check_prompt(ScriptedBackend(["a b c d"]), ScriptedBackend(["a b x d"]), request, greedy)[2].kind == \
        "mismatch"  # without its own target-only, nothing tells the engines from the drafter
