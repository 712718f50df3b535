"""A chat's next turn reuses what the previous turn left in the caches (the target's KV cache and
the drafter's own state: its KV cache, the hidden states it was handed) and prefills only what is
new, without changing a token."""
import pytest
import torch

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.loop import common_prefix
from specchat.verify import fresh
from tests.speculative.conftest import PROMPTS

SAMPLINGS = [Sampling(max_tokens=24), Sampling(temperature=0.8, seed=3, max_tokens=24)]
DRAFTERS = ["ngram", "draft", "mtp", "mtp-prenorm", "mtp+lookup", "dflash", "dflash+lookup", "dspark", "eagle3"]


def next_turn(first_messages, first_reply: str) -> Request:
    return Request(messages=list(first_messages) + [{"role": "assistant", "content": first_reply},
                                                   {"role": "user", "content": "and the lazy dog, once more?"}])


def two_turns(backend, target, sampling):
    """(second turn's summary, its prompt, the positions the first turn left cached for it)."""
    first = run_to_summary(fresh(backend).stream(Request(messages=PROMPTS[0]), sampling))
    second_request = next_turn(PROMPTS[0], first.text)
    prompt = target.prompt_ids(second_request)
    shared = common_prefix(target.cached, prompt)
    assert shared > len(target.prompt_ids(Request(messages=PROMPTS[0]))) // 2  # the turns share a real prefix
    return run_to_summary(backend.stream(second_request, sampling)), second_request, min(shared, len(prompt) - 1)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8"])
def test_target_only_prefills_only_the_new_turn(target, sampling):
    second, request, reusable = two_turns(target, target, sampling)
    assert second.prefill_start == reusable
    assert second.token_ids == run_to_summary(fresh(target).stream(request, sampling)).token_ids


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8"])
@pytest.mark.parametrize("name", DRAFTERS)
def test_every_drafter_prefills_only_the_new_turn(target, drafters, name, sampling):
    drafter = drafters[name]("exact")
    spec = SpeculativeBackend(target, drafter, 3)
    second, request, reusable = two_turns(spec, target, sampling)
    assert second.prefill_start == reusable, f"{name} re-read {reusable - second.prefill_start} cached positions"
    assert second.token_ids == run_to_summary(fresh(target).stream(request, sampling)).token_ids


def record_draft_states(drafter) -> list:
    """The drafter's hidden states behind each guess (the MTP head's output, the DFlash block's rows),
    recorded as it drafts: two runs that guess from the same state record the same tensors."""
    model = getattr(drafter, "model", drafter) if hasattr(drafter, "index") else drafter  # LookupFirst
    seen = []
    owner, attr = (model.head, "greedy") if hasattr(model, "entries") else (model, "logits")
    inner = getattr(owner, attr)

    def recording(h):
        seen.append(h.detach().clone())
        return inner(h)
    setattr(owner, attr, recording)
    return seen


@pytest.mark.parametrize("edited", [False, True], ids=["grown", "edited"])
@pytest.mark.parametrize("name", ["mtp", "mtp-prenorm", "dflash", "dspark", "mtp+lookup", "eagle3"])
def test_a_drafter_drafts_after_reuse_from_the_state_it_builds_from_scratch(target, drafters, name, edited):
    """The drafter state kept from the first turn is the state a fresh drafter builds over the same
    positions: every guess of the second turn comes from the same hidden states with reuse as
    without (to float32 rounding: the kept states came from verify passes, the fresh ones from one
    prefill), also when the conversation changed inside what the drafter holds (an edited reply)."""
    sampling = Sampling(max_tokens=24)
    drafter = drafters[name]("exact")
    spec = SpeculativeBackend(target, drafter, 3)
    first = run_to_summary(fresh(spec).stream(Request(messages=PROMPTS[0]), sampling))
    reply = first.text[:len(first.text) // 2] + " edited" if edited else first.text
    second = next_turn(PROMPTS[0], reply)
    with_reuse = record_draft_states(drafter)
    reused = run_to_summary(spec.stream(second, sampling))
    drafter = drafters[name]("exact")  # a new drafter that never saw the first turn
    without = record_draft_states(drafter)
    scratch = run_to_summary(fresh(SpeculativeBackend(target, drafter, 3)).stream(second, sampling))
    assert reused.prefill_start > 0 and scratch.prefill_start == 0
    assert reused.token_ids == scratch.token_ids
    assert len(with_reuse) > 3 and len(with_reuse) == len(without)
    for i, (a, b) in enumerate(zip(with_reuse, without)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), f"guess {i}: {(a - b).abs().max():.2e}"


@pytest.mark.parametrize("name", ["mtp", "dflash", "mtp+lookup", "eagle3"])
def test_a_drafter_reuses_only_what_it_holds_when_the_target_ran_something_else(target, drafters, name):
    """Between two speculative turns the target decoded another conversation on its own (a
    target-only reference run): its cache shares the new prompt's prefix, the drafter's state does
    not, so the drafter's own state decides how far the prefill may start."""
    sampling = Sampling(max_tokens=24)
    drafter = drafters[name]("exact")
    spec = SpeculativeBackend(target, drafter, 3)
    run_to_summary(fresh(spec).stream(Request(messages=PROMPTS[0]), sampling))
    other = run_to_summary(fresh(target).stream(Request(messages=PROMPTS[1]), sampling))
    request = next_turn(PROMPTS[1], other.text)
    held = drafter.reusable(target.prompt_ids(request))
    assert common_prefix(target.cached, target.prompt_ids(request)) > held + 5
    with_reuse = record_draft_states(drafter)
    out = run_to_summary(spec.stream(request, sampling))
    assert out.prefill_start == held
    scratch_drafter = drafters[name]("exact")
    without = record_draft_states(scratch_drafter)
    run_to_summary(fresh(SpeculativeBackend(target, scratch_drafter, 3)).stream(request, sampling))
    assert len(with_reuse) == len(without) > 3
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(with_reuse, without))
