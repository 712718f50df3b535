"""The position-keyed Gumbel sampler."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specchat.backends.base import Sampling
from specchat.backends.native import sampling as sampler
from specchat.backends.native.sampling import filtered_logits, gumbel_noise, probs, sample, uniform_noise


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    assert sample(logits, [0, 1], Sampling()).tolist() == [1, 0]


def test_same_seed_and_position_give_the_same_token_every_time():
    logits = torch.randn(1, 50)
    s = Sampling(temperature=1.0, seed=7)
    first = sample(logits, [13], s)
    assert all(torch.equal(sample(logits.clone(), [13], s), first) for _ in range(5))


def test_noise_is_pinned():
    """The noise must not drift across versions or platforms: these values are part of the
    contract (a recorded seeded transcript must replay)."""
    u = uniform_noise(seed=1234, positions=[0, 99], ids=4)
    assert u.dtype == torch.float64
    assert (u * (1 << 24) - 0.5).long().tolist() == [[1550758, 15336449, 10142830, 11689204],
                                                     [10667555, 13837167, 10735167, 11493684]]
    assert uniform_noise(seed=1235, positions=[0], ids=4)[0].tolist() != u[0].tolist()


def test_noise_is_uniform_and_uncorrelated_across_neighbours():
    u = uniform_noise(seed=0, positions=list(range(64)), ids=4096)
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs(u.var().item() - 1 / 12) < 0.003
    x = (u - 0.5).flatten()
    assert abs((x[1:] * x[:-1]).mean().item()) < 0.002  # neighbouring ids
    assert abs(((u[1:] - 0.5) * (u[:-1] - 0.5)).mean().item()) < 0.002  # neighbouring positions


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), start=st.integers(0, 10_000), k=st.integers(1, 8),
       temperature=st.floats(0.2, 2.0), top_k=st.integers(0, 20), top_p=st.floats(0.05, 1.0))
def test_batched_sampling_equals_per_position_sampling(seed, start, k, temperature, top_k, top_p):
    s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    logits = torch.randn(k, 40, generator=torch.Generator().manual_seed(seed))
    positions = list(range(start, start + k))
    batched = sample(logits, positions, s)
    single = torch.cat([sample(logits[i:i + 1], [p], s) for i, p in enumerate(positions)])
    assert torch.equal(batched, single)


def test_every_row_is_filtered_on_its_own(monkeypatch):
    # CPU reductions over a batch of rows (top-p's logsumexp over the vocabulary) can round
    # differently from the same reduction over one row, and a verify block samples several rows
    # at once where target-only decoding samples one: each row must see single-row arithmetic.
    # (A flipped token needs a top-p cut within one rounding step, too rare to provoke in a test.)
    from specchat.backends.native import sampling

    rows_seen = []
    real = sampling.candidates
    monkeypatch.setattr(sampling, "candidates", lambda logits, s: rows_seen.append(len(logits)) or real(logits, s))
    for rows in (5, 2):  # a verify block of two rows too
        rows_seen.clear()
        sample(torch.randn(rows, 49152), list(range(rows)), Sampling(temperature=0.9, top_p=0.9, seed=1))
        assert rows_seen == [1] * rows


def _empirical(logits: torch.Tensor, s: Sampling, n: int = 20000) -> torch.Tensor:
    """Token frequencies over n positions (each position has independent noise)."""
    tokens = sample(logits.expand(n, -1), list(range(n)), s)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / n


@pytest.mark.parametrize("s", [Sampling(temperature=1.0), Sampling(temperature=0.5),
                               Sampling(temperature=1.5, top_k=3), Sampling(temperature=1.0, top_p=0.7),
                               Sampling(temperature=0.8, top_k=4, top_p=0.9)])
def test_frequencies_match_the_filtered_distribution(s):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5]])
    target = probs(logits, s)[0].double()
    freq = _empirical(logits, s)
    n = 20000
    # every token within 5 standard errors, and tokens outside top-k/top-p never drawn
    se = (target * (1 - target) / n).sqrt()
    assert ((freq - target).abs() <= 5 * se + 1e-12).all(), (freq, target)
    assert (freq[target == 0] == 0).all()


def test_probs_apply_temperature_top_k_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = probs(logits, Sampling(temperature=1.0))[0]
    assert torch.allclose(p, torch.softmax(logits[0], -1))
    p = probs(logits, Sampling(temperature=2.0, top_k=2))[0]
    assert p[2:].sum() == 0 and math.isclose(p[0] / p[1], math.exp(0.5), rel_tol=1e-5)
    p_full = torch.softmax(logits[0], -1)  # 0.644, 0.237, 0.087, 0.032
    p = probs(logits, Sampling(temperature=1.0, top_p=0.8))[0]
    assert (p > 0).tolist() == [True, True, False, False]
    assert torch.allclose(p[:2], p_full[:2] / p_full[:2].sum())
    assert probs(logits, Sampling())[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert probs(torch.tensor([[0.0, 2.0, 1.0], [3.0, 1.0, 0.0]]), Sampling()).tolist() == [[0, 1, 0], [1, 0, 0]]
    assert (probs(logits, Sampling(temperature=1.0, top_k=1))[0] > 0).tolist() == [True, False, False, False]
    assert probs(torch.tensor([[0.0, 0.0, -30.0]]), Sampling(temperature=1.0, top_k=3))[0, 2] > 0  # k tokens, however unlikely
    # top-p keeps the fewest best tokens whose mass reaches p: reaching it exactly is enough
    halves = torch.tensor([[0.0, 0.0, -30.0]])  # probabilities 0.5, 0.5 (exactly, in float32), ~0
    assert (probs(halves, Sampling(temperature=1.0, top_p=0.5))[0] > 0).sum() == 1
    # a nucleus wider than the first look (the best 1,024 tokens) is found in the whole vocabulary
    flat = torch.zeros(1, 5000)
    assert 4400 < (probs(flat, Sampling(temperature=1.0, top_p=0.9))[0] > 0).sum() < 4600  # ~90% of 5,000
    sloped = probs(torch.linspace(0, 1, 5000)[None], Sampling(temperature=1.0, top_p=0.9))[0]
    assert sloped[-1] > 0 and sloped[0] == 0  # the nucleus is the best tokens, the worst fall outside


@pytest.mark.parametrize("s", [Sampling(temperature=0.7), Sampling(temperature=0.7, top_k=50),
                               Sampling(temperature=1.0, top_p=0.9), Sampling(temperature=3.0, top_p=0.99),
                               Sampling(temperature=0.9, top_k=3000, top_p=0.95)])
def test_sampling_candidates_equal_the_dense_gumbel_max(s):
    """Noise is drawn only for candidate tokens; the pick must be what argmax over the whole
    vocabulary with full noise gives (temperature 3 makes the nucleus exceed the first guess)."""
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(1)) * 4
    positions = list(range(100, 106))
    dense = (filtered_logits(logits, s) + gumbel_noise(s.seed, positions, 5000)).argmax(-1)
    assert torch.equal(sample(logits, positions, s), dense)


@pytest.mark.parametrize("s", [Sampling(), Sampling(temperature=0.8, seed=2), Sampling(temperature=1.0, seed=5, top_k=7),
                               Sampling(temperature=0.7, seed=9, top_p=0.8)], ids=["greedy", "t0.8", "top-k", "top-p"])
def test_a_sub_vocabulary_samples_as_the_full_one_with_minus_inf_outside(s):
    vocab = torch.tensor([3, 8, 11, 19, 20, 31, 40, 41, 57, 60])
    sub = torch.randn(4, len(vocab), generator=torch.Generator().manual_seed(1)) * 3
    full = torch.full((4, 64), float("-inf"))
    full[:, vocab] = sub
    positions = [5, 6, 7, 8]
    assert torch.equal(sample(sub, positions, s, token_ids=vocab), sample(full, positions, s))


def test_the_argmax_head_serves_greedy_and_plain_temperature_sampling_only():
    # plain temperature sampling is an argmax of logits / T + noise: the int8 argmax head's job
    assert sampler.argmax_over_vocabulary(Sampling()) and sampler.argmax_over_vocabulary(Sampling(temperature=0.7))
    assert sampler.argmax_over_vocabulary(Sampling(temperature=0.7, top_p=1.0, top_k=0))
    assert not sampler.argmax_over_vocabulary(Sampling(temperature=0.7, top_p=0.9))
    assert not sampler.argmax_over_vocabulary(Sampling(temperature=0.7, top_k=40))
