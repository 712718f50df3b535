"""`rejection` acceptance is lossless in distribution: the emitted token is distributed as the
target's p, whatever the drafter's q. Checked statistically on exact distributions, then end to
end on a tiny model."""
from collections import Counter

import pytest
import torch

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native import sampling as sampler
from specchat.backends.speculative.acceptance import accept_rejection
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.drafters import DraftModelDrafter
from specchat.verify import fresh
from tests.speculative.conftest import PROMPTS, Counting


def total_variation(counts: Counter, p: torch.Tensor, n: int) -> float:
    emp = torch.zeros_like(p)
    for tok, c in counts.items():
        emp[tok] = c / n
    return 0.5 * float((emp - p).abs().sum())


def draw(p, q, n, rule, seed=0):
    """Emit one token n times: draft ~ q, then the acceptance rule; count what comes out."""
    g = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=g))
        u = torch.rand(1, generator=g)
        verdict = rule([x], p, q, u, lambda dist, i: int(torch.multinomial(dist / dist.sum(), 1, generator=g)))
        counts[verdict.tokens([x])[0]] += 1
    return counts


def test_rejection_rule_reproduces_p():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    n = 6000
    assert total_variation(draw(p, q, n, accept_rejection), p[0], n) < 0.03


@pytest.mark.parametrize("q_row", [[0.1, 0.2, 0.3, 0.4, 0.0, 0.0], [0.1, 0.2, 0.3, 0.2, 0.2]],
                         ids=["draft-head-wider", "draft-head-wider-with-mass-past-the-target"])
def test_rejection_rule_with_heads_of_different_widths(q_row):
    # a draft model whose vocabulary is padded to another size than the target's
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    n = 6000
    assert total_variation(draw(p, torch.tensor([q_row]), n, accept_rejection), p[0], n) < 0.03
    narrow = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0, 0.0], [0.2] * 5 + [0.0]])  # the target's head is wider
    assert total_variation(draw(narrow, torch.tensor([[0.1, 0.2, 0.3, 0.4]]), n, accept_rejection), narrow[0], n) < 0.03


def test_a_token_the_target_rules_out_is_never_accepted():
    # u = 0 is a possible draw: "accept when u * q <= p" would keep a draft whose p is 0
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    verdict = accept_rejection([0], p, torch.tensor([[1.0, 0.0]]), torch.zeros(1), lambda dist, i: int(dist.argmax()))
    assert verdict.accepted == 0 and verdict.tokens([0]) == [1]


@pytest.mark.parametrize("sampling, calls", [(Sampling(temperature=1.0, seed=2, max_tokens=16), True),
                                             (Sampling(max_tokens=16), False)], ids=["t1.0", "greedy"])
def test_the_rejection_rule_decides_when_sampling_and_only_then(target, drafters, monkeypatch, sampling, calls):
    from specchat.backends.speculative import loop

    used = []
    monkeypatch.setattr(loop, "accept_rejection", lambda *a: used.append(1) or accept_rejection(*a))
    exact = SpeculativeBackend(target, drafters["draft"]("exact"), 3)
    run_to_summary(fresh(exact).stream(Request(messages=PROMPTS[0]), sampling))
    assert not used  # exact acceptance never does
    spec = SpeculativeBackend(target, drafters["draft"]("rejection"), 3, acceptance="rejection")
    run_to_summary(fresh(spec).stream(Request(messages=PROMPTS[0]), sampling))
    assert bool(used) == calls  # greedy: the target's own choice, as exact acceptance


def test_a_draft_the_drafter_gave_no_probability_falls_back_to_the_target():
    # p == q and the draft has q = 0 (it did not come from q): rejected, and the residual p - q is all
    # zero, so the token comes from p itself, never from a zero distribution
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    verdict = accept_rejection([0], p, p[:1].clone(), torch.full((1,), 0.5), lambda dist, i: int(dist.argmax()))
    assert verdict.accepted == 0 and verdict.token == 1


def test_each_draft_meets_the_rule_after_an_accepted_one():
    p = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])  # the target wants 0, then 1
    q = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # the drafter proposed 0 twice
    verdict = accept_rejection([0, 0], p, q, torch.full((2,), 0.5), lambda dist, i: int(dist.argmax()))
    assert verdict.accepted == 1 and verdict.token == 1  # the first kept, the second rejected for p's 1


def test_a_broken_rule_is_caught():
    def accept_always(draft, p, q, u, sample_from):
        return type(accept_rejection(draft, p, q, u, sample_from))(len(draft), 0)

    def residual_not_renormalised(draft, p, q, u, sample_from):  # samples the residual from q instead
        return accept_rejection(draft, p, q, u, lambda dist, i: sample_from(q[i] if i < len(q) else dist, i))

    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    n = 6000
    assert total_variation(draw(p, q, n, accept_always), p[0], n) > 0.2
    assert total_variation(draw(p, q, n, residual_not_renormalised), p[0], n) > 0.1


@pytest.mark.timeout(600)
def test_end_to_end_drafted_token_follows_the_target(target, tiny_pair, tmp_path):
    """The second token of each reply comes from the rejection rule (depth 1). Its frequency must
    match the target's exact distribution given the first token, averaged over the runs. The
    drafter is the target quantized to Q4_1: close to p but not equal, so drafts are both kept
    and rejected."""
    from specchat.backends.native.engine import TorchBackend
    from tests.native.tiny import make_gguf

    quantized = make_gguf(tmp_path / "q4.gguf", tiny_pair[0], "Q4_1")
    draft = DraftModelDrafter(TorchBackend(quantized, "gguf", precision="float32", threads=2, context=256), want_q=True)
    spec = SpeculativeBackend(target, draft, depth=1, acceptance="rejection")
    base = Sampling(temperature=1.0, top_k=3, max_tokens=3)
    prompt = target.prompt_ids(Request(messages=PROMPTS[0]))
    conditional = {}  # first token -> the target's distribution of the second

    def p_after(first: int) -> torch.Tensor:
        if first not in conditional:
            conditional[first] = sampler.probs(fresh(target).prefill(prompt + [first])[-1:], base)[0]
        return conditional[first]

    n, counts, drafted, accepted = 1000, Counter(), 0, 0
    expected = torch.zeros(target.model.cfg.vocab_size)
    for seed in range(n):
        s = run_to_summary(fresh(spec).stream(Request(prompt_ids=prompt), Sampling(**{**base.__dict__, "seed": seed})))
        counts[s.token_ids[1]] += 1
        expected += p_after(s.token_ids[0])
        drafted += s.draft_tokens
        accepted += s.accepted_tokens
    assert drafted >= n  # every second token went through the rule
    assert 0 < accepted < drafted
    assert total_variation(counts, expected / n, n) < 0.08


def test_lookup_passes_fall_back_to_exact_acceptance(target, drafters):
    """Under `rejection`, lookup drafts (no distribution) are judged by `exact` and the model
    drafter's by the rejection rule; mixing the two per pass runs to the end."""
    drafter = drafters["draft+lookup"]("rejection")
    lookup, model = Counting(drafter.index), Counting(drafter.model)
    spec = SpeculativeBackend(target, drafter, 2, "rejection")
    sampling = Sampling(temperature=0.8, seed=4, max_tokens=40)
    out = run_to_summary(fresh(spec).stream(Request(messages=PROMPTS[0]), sampling))
    assert out.tokens == 40 and out.error is None
    assert lookup.passes > 0 and model.passes > 0


def test_a_draft_its_own_distribution_gave_no_probability_is_rejected():
    """A drafted token q says could not be drafted (q(x) = 0: a drafter whose guesses and
    distributions disagree) has no acceptance ratio: it is rejected and the target's residual decides,
    whatever the uniform draw, so such a drafter cannot bias the output towards its guesses."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    for u in (0.0, 0.5, 0.99):
        v = accept_rejection([1], p, q, torch.tensor([u]), lambda dist, i: int(torch.argmax(dist)))
        assert (v.accepted, v.token) == (0, 1)  # the residual max(p - q, 0) = [0, 0.5, 0]: token 1 from p's side
