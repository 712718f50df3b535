"""The drafters' own limits: a draft model drafts within its own context, which may be shorter
than the target's."""
from specchat.backends.base import Request, Sampling
from specchat.backends.native.engine import TorchBackend
from specchat.backends.speculative.drafters import DraftModelDrafter, NgramDrafter
from tests.speculative.conftest import PROMPTS, Counting, compare


def test_a_draft_model_drafts_up_to_the_end_of_its_own_context(target, tiny_pair):
    prompt = target.prompt_ids(Request(messages=PROMPTS[0]))
    # the target's context is 256: the reply outgrows the drafter's
    short = TorchBackend(tiny_pair[1], "hf_dir", precision="float32", threads=2, context=len(prompt) + 6)
    drafter = DraftModelDrafter(short)
    proposals = Counting(drafter)
    _, out, verdict = compare(target, drafter, 4, Sampling(max_tokens=24))
    assert verdict.kind == "identical", verdict.line()
    assert out.tokens == 24 and proposals.passes > 0
    assert len(short.cached) <= short.context_length


def test_a_draft_model_ends_its_draft_at_an_end_of_sequence_token(target, tiny_pair):
    prompt = target.prompt_ids(Request(messages=PROMPTS[1])) + [7]
    drafter = DraftModelDrafter(TorchBackend(tiny_pair[1], "hf_dir", precision="float32", threads=2, context=256))
    drafter.start(prompt[:-1], {}, Sampling())
    guess = drafter.propose(prompt, 4).tokens
    assert len(guess) == 4 and drafter.engine.cached == prompt + guess[:3]  # the last guess is never fed back
    assert drafter.propose(prompt, 1).tokens == guess[:1]
    drafter.engine.eos_ids = frozenset([guess[1]])  # the second guess now ends the reply: nothing past it
    assert drafter.propose(prompt, 4).tokens == guess[:2]


def test_a_draft_model_feeds_only_what_its_cache_lacks(target, tiny_pair):
    prompt = target.prompt_ids(Request(messages=PROMPTS[1])) + [7]
    engine = TorchBackend(tiny_pair[1], "hf_dir", precision="float32", threads=2, context=256)
    drafter = DraftModelDrafter(engine)
    drafter.start(prompt[:-1], {}, Sampling())
    guess = drafter.propose(prompt, 4).tokens
    assert engine.cached == prompt + guess[:3]
    fed, forward = [], engine.forward

    def recorded(tokens, start_pos, *args, **kwargs):
        fed.append((list(tokens), start_pos))
        return forward(tokens, start_pos, *args, **kwargs)

    engine.forward = recorded
    own = next(t for t in range(10) if t != guess[2])  # the target kept two guesses, then chose its own token
    committed = prompt + guess[:2] + [own]
    n = len(committed)
    drafter.propose(committed, 3)
    # the cache already holds everything before the target's token: that one alone is fed, then each guess
    assert fed[0] == ([own], n - 1) and [(len(t), p) for t, p in fed[1:]] == [(1, n), (1, n + 1)]


def test_prompt_lookup_drafts_the_profile_depth_outside_a_copying_run():
    drafter = NgramDrafter(1, 3, copy_depth=12)
    assert drafter.plan_depth(2) == 12  # the loop may ask for up to 12, for copying runs
    assert drafter.propose([5, 6, 7, 8, 1, 5, 6, 7], 12).tokens == [8, 1]  # a 3-token match: the profile's 2
