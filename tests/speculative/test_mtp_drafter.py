"""The MTP drafter's bookkeeping: what it proposes in the loop is what the head predicts when
recomputed from scratch over the committed sequence."""
import shutil

import pytest
import torch

from specchat.backends.base import BackendError, Request, Sampling, run_to_summary
from specchat.backends.native.model import FINAL
from specchat.backends.native.sampling import sample
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.loading import load_speculative
from specchat.profiles import Profile
from specchat.verify import fresh
from tests.speculative.conftest import PROMPTS, compare, mtp_drafter


@pytest.mark.parametrize("hidden_source", ["post_norm", "pre_norm"])
@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("sampling", [Sampling(max_tokens=30), Sampling(temperature=0.8, seed=3, max_tokens=30)],
                         ids=["greedy", "t0.8"])
def test_proposals_equal_a_fresh_recomputation(target, tiny_pair, hidden_source, depth, sampling):
    drafter = mtp_drafter(target, tiny_pair[0], hidden_source=hidden_source)
    proposals = []
    propose = drafter.propose

    def recording(tokens, d):
        draft = propose(tokens, d)
        proposals.append((len(tokens), draft.tokens[:1]))
        return draft

    drafter.propose = recording
    spec = SpeculativeBackend(fresh(target), drafter, depth)
    out = run_to_summary(spec.stream(Request(messages=PROMPTS[1]), sampling))
    seq = target.prompt_ids(Request(messages=PROMPTS[1])) + out.token_ids
    # from scratch: the target's states over the whole sequence, every (h[t], x[t+1]) entry at once
    key = FINAL if hidden_source == "post_norm" else target.model.cfg.n_layers - 1
    _, hidden = fresh(target).forward(seq, 0, (key,))
    fresh_head = mtp_drafter(target, tiny_pair[0]).head
    g = fresh_head.forward(hidden[key][:-1], torch.tensor(seq[1:]), 0)
    logits = fresh_head.logits(g)  # logits[t]: the guess for x[t+2], sampled with that position's noise
    predicted = [int(sample(logits[t:t + 1], [t + 2], sampling)[0]) for t in range(len(logits))]
    assert len(proposals) > 5
    for n, first in proposals:
        assert first == [predicted[n - 2]], f"proposal for position {n}"


def test_the_first_hidden_state_is_enough_to_propose(target, tiny_pair):
    """A one-token prompt leaves one hidden state after prefill: the head's first guess needs no more."""
    drafter = mtp_drafter(target, tiny_pair[0])
    proposals = []
    propose = drafter.propose

    def recording(tokens, depth):
        draft = propose(tokens, depth)
        proposals.append((len(tokens), len(draft.tokens)))
        return draft

    drafter.propose = recording
    first = target.prompt_ids(Request(messages=PROMPTS[0]))[:1]
    _, _, verdict = compare(target, drafter, 3, Sampling(max_tokens=6), prompt_ids=first)
    assert verdict.kind == "identical", verdict.line()
    assert proposals[0] == (2, 3)  # the prompt token and the first reply token: a full draft already


def test_proposing_again_with_nothing_committed_proposes_the_same(target, tiny_pair):
    """The second call finds no new hidden state and recomputes the head's last entry, in place."""
    drafter = mtp_drafter(target, tiny_pair[0], "rejection")  # its drafts carry the head's distributions
    prompt = target.prompt_ids(Request(messages=PROMPTS[1]))
    _, hidden = fresh(target).forward(prompt, 0, (FINAL,))
    drafter.start(prompt, hidden, Sampling(temperature=1.0, seed=2))
    tokens = prompt + [7]
    first, again = drafter.propose(tokens, 3), drafter.propose(tokens, 3)
    assert len(first.tokens) == 3 and again.tokens == first.tokens
    assert torch.allclose(again.q, first.q, rtol=1e-3, atol=1e-8)  # one row against a batch: rounding only


def test_a_draft_ends_at_an_end_of_sequence_token(target, tiny_pair):
    prompt = target.prompt_ids(Request(messages=PROMPTS[1]))
    _, hidden = fresh(target).forward(prompt, 0, (FINAL,))
    drafter = mtp_drafter(target, tiny_pair[0])
    drafter.start(prompt, hidden, Sampling())
    guess = drafter.propose(prompt + [7], 3).tokens
    drafter.eos_ids = frozenset([guess[1]])  # the second guess now ends the reply: nothing is drafted past it
    drafter.start(prompt, hidden, Sampling())
    assert drafter.propose(prompt + [7], 3).tokens == guess[:2]


def test_mtp_keeps_parity_across_turns_and_with_rejection(target, drafters):
    convo = PROMPTS[1] + [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "the lazy dog"}]
    for messages in (PROMPTS[1], convo):
        _, _, verdict = compare(target, drafters["mtp"]("exact"), 3, Sampling(max_tokens=30), messages)
        assert verdict.kind == "identical", verdict.line()
    _, out, _ = compare(target, drafters["mtp"]("rejection"), 3,
                        Sampling(temperature=1.0, seed=4, max_tokens=30), acceptance="rejection")
    assert out.tokens == 30 and out.draft_tokens > 0


def test_profiles_load_a_builtin_or_separate_head(tiny_pair, tmp_path):
    target_dir = tiny_pair[0]
    head_dir = tmp_path / "head"
    head_dir.mkdir()
    shutil.copy(target_dir / "mtp.safetensors", head_dir)
    shutil.copy(target_dir / "config.json", head_dir)
    sampling = Sampling(max_tokens=20)
    outs = []
    for drafter in (None, str(head_dir)):
        profile = Profile(name="t", model=str(target_dir), dtype="float32", context=256,
                          speculative={"method": "mtp", "depth": 2, "drafter": drafter})
        spec = load_speculative(profile)
        outs.append(run_to_summary(spec.stream(Request(messages=PROMPTS[0]), sampling)).token_ids)
        spec.close()
    assert outs[0] == outs[1]
    # a directory without any MTP head
    profile = Profile(name="t", model=str(target_dir), dtype="float32", context=256,
                      speculative={"method": "mtp", "drafter": str(tiny_pair[1])})
    with pytest.raises(BackendError, match="no MTP head found"):
        load_speculative(profile)


@pytest.mark.parametrize("depth", [2, 4])
def test_deeper_guesses_take_their_own_positions_noise(target, tiny_pair, depth):
    """Each guess of a proposal is sampled with the noise of the position it guesses (the target's
    position-keyed sampler), so at temperature > 0 a guess shares the target's noise there."""
    drafter = mtp_drafter(target, tiny_pair[0])
    asked = []
    choose = drafter._choose

    def recording(g, position):
        asked.append(position)
        return choose(g, position)
    drafter._choose = recording
    proposals = []
    propose = drafter.propose

    def recording_propose(tokens, d):
        start = len(asked)
        draft = propose(tokens, d)
        proposals.append((len(tokens), asked[start:], len(draft.tokens)))
        return draft
    drafter.propose = recording_propose
    spec = SpeculativeBackend(fresh(target), drafter, depth)
    run_to_summary(spec.stream(Request(messages=PROMPTS[1]), Sampling(temperature=0.8, seed=3, max_tokens=30)))
    assert any(n_drafted > 1 for _, _, n_drafted in proposals)
    for n, positions, n_drafted in proposals:
        assert positions == list(range(n, n + n_drafted)), f"proposal after {n} tokens"
