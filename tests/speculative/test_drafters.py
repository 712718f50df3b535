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


def test_prompt_lookup_drafts_the_profile_depth_outside_a_copying_run():
    drafter = NgramDrafter(1, 3, copy_depth=12)
    assert drafter.plan_depth(2) == 12  # the loop may ask for up to 12, for copying runs
    assert drafter.propose([5, 6, 7, 8, 1, 5, 6, 7], 12).tokens == [8, 1]  # a 3-token match: the profile's 2
