"""The loop's verify step computes the target's LM head only as far as acceptance looks; its prefill
reuses what the cache holds."""
import pytest
import torch

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.speculative.acceptance import accept_exact
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.drafters import NgramDrafter
from specchat.backends.speculative.loop import keyed_generator, target_choices
from specchat.verify import fresh
from tests.speculative.conftest import PROMPTS


class CountingHead:
    """A target whose 'state' rows are already one-hot logits; counts the head's calls."""

    def __init__(self, rows):
        self.rows, self.calls = rows, []

    def verify_chunk(self, sampling):
        return self.rows

    def choose(self, states, positions, sampling):
        self.calls.append(len(states))
        assert len(positions) == len(states)
        return states.argmax(-1)


def states_for(tokens, vocab=10):
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def test_head_stops_after_the_chunk_with_the_first_rejection():
    target_tokens = [1, 2, 3, 4, 5]  # the target's choice at each of the 5 block positions
    target = CountingHead(2)
    chosen = target_choices(target, states_for(target_tokens), [1, 9, 3, 4], list(range(5)), Sampling())
    assert target.calls == [2] and chosen == [1, 2]  # draft 1 rejected: rows 2..4 never reach the head
    assert accept_exact([1, 9, 3, 4], chosen).tokens([1, 9, 3, 4]) == [1, 2]


def test_every_row_when_every_draft_is_accepted():
    target = CountingHead(2)
    chosen = target_choices(target, states_for([1, 2, 3, 4, 5]), [1, 2, 3, 4], list(range(5)), Sampling())
    assert target.calls == [2, 2, 1] and chosen == [1, 2, 3, 4, 5]  # the bonus token too
    assert accept_exact([1, 2, 3, 4], chosen).tokens([1, 2, 3, 4]) == [1, 2, 3, 4, 5]


def test_first_draft_rejected_and_no_chunking():
    target = CountingHead(None)
    assert target_choices(target, states_for([7, 2, 3]), [1, 2], [4, 5, 6], Sampling()) == [7, 2, 3]
    assert target.calls == [3]
    target = CountingHead(2)
    assert target_choices(target, states_for([7, 2, 3]), [1, 2], [4, 5, 6], Sampling()) == [7, 2]
    assert target.calls == [2]


def test_a_prompt_the_cache_already_holds_runs_its_first_sends_prefill_again(target):
    """Its last token alone would choose the first token with other arithmetic than the first send's
    prefill row (engine.prefill_with_hidden)."""
    spec = SpeculativeBackend(target, NgramDrafter(1, 3), 3)
    request, sampling = Request(messages=PROMPTS[0]), Sampling(max_tokens=8)
    first = run_to_summary(fresh(spec).stream(request, sampling))
    again = run_to_summary(spec.stream(request, sampling))  # the cache holds the prompt and the reply
    assert first.prefill_start == 0 and again.prefill_start == 0
    assert again.token_ids == first.token_ids


def test_rejection_noise_is_keyed_by_seed_and_position():
    draws = [float(torch.rand((), generator=keyed_generator(seed, pos, "accept"))) for seed in (1, 2) for pos in range(8)]
    assert len(set(draws)) == len(draws)  # no two (seed, position) pairs share a draw
    assert draws[3] == float(torch.rand((), generator=keyed_generator(1, 3, "accept")))  # and each is reproducible
    # pinned, as the sampling noise is: a seeded reply must stay the same reply across versions
    assert draws[0] == pytest.approx(0.0056073666, abs=1e-9) and draws[3] == pytest.approx(0.4842618704, abs=1e-9)
