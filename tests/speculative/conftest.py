"""A tiny target, a different tiny draft model with the same tokenizer, and helpers to compare
speculative output with target-only output."""
from __future__ import annotations

import pytest

from specchat.backends.base import Request, Sampling, Step, Summary
from specchat.backends.native.engine import TorchBackend
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.dflash import DFlashDrafter, load_dflash
from specchat.backends.speculative.dspark import DSparkDrafter, load_dspark
from specchat.backends.speculative.drafters import DraftModelDrafter, LookupFirst, NgramDrafter
from specchat.compare import judge_tokens
from specchat.verify import fresh, margin_function
from tests.native.tiny import add_mtp_head, make_hf_checkpoint
from tests.speculative.tiny_dflash import make_dflash_checkpoint
from tests.speculative.tiny_dspark import make_dspark_checkpoint
from tests.speculative.tiny_eagle3 import make_eagle3_checkpoint

PROMPTS = [[{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}],
           [{"role": "user", "content": "hello world, how are you today? Paris is the capital of France."}]]


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = make_hf_checkpoint(root / "target", "llama", seed=11)
    add_mtp_head(target, "deepseek", seed=13)  # a built-in (random) MTP head; the main model ignores it
    return target, make_hf_checkpoint(root / "draft", "llama", seed=12)


def engine(path, precision="float32") -> TorchBackend:
    return TorchBackend(path, "hf_dir", precision=precision, threads=2, context=256)


@pytest.fixture(scope="session")
def target(tiny_pair):
    return engine(tiny_pair[0])


def eagle3_drafter(target, path, acceptance="exact"):
    from specchat.backends.native.eagle3 import Eagle3Head, read_eagle3
    from specchat.backends.speculative.eagle3 import Eagle3Drafter

    head = Eagle3Head(read_eagle3(path, target.model.cfg), target.model, target.context_length)
    return Eagle3Drafter(head, target.eos_ids, want_q=acceptance == "rejection")


@pytest.fixture(scope="session")
def eagle3_head(tiny_pair, tmp_path_factory):
    """A random EAGLE-3 head (SpecForge's layout) for the tiny target."""
    return make_eagle3_checkpoint(tmp_path_factory.mktemp("eagle3") / "e", tiny_pair[0], seed=14)


def mtp_drafter(target, path, acceptance="exact", hidden_source="post_norm"):
    from specchat.backends.native.mtp import MtpHead, read_mtp
    from specchat.backends.speculative.mtp import MtpDrafter

    head = MtpHead(read_mtp(path, target.model.cfg), target.model, target.context_length)
    return MtpDrafter(head, target.eos_ids, hidden_source, want_q=acceptance == "rejection")


@pytest.fixture(scope="session")
def drafters(tiny_pair, target, eagle3_head, tmp_path_factory):
    """name -> factory(acceptance) of drafters: n-gram, a different model, the target itself, the
    target's MTP head (fed the final or the pre-norm hidden state), a random DFlash drafter, a
    random DSpark drafter (DFlash's with a Markov head), a random EAGLE-3 head."""
    draft_engine, self_engine = engine(tiny_pair[1]), engine(tiny_pair[0])
    dflash = load_dflash(make_dflash_checkpoint(tmp_path_factory.mktemp("dflash") / "d", tiny_pair[0], block_size=7),
                         target.model.cfg)
    dspark = load_dspark(make_dspark_checkpoint(tmp_path_factory.mktemp("dspark") / "d", tiny_pair[0], block_size=7),
                         target.model.cfg)
    return {
        "mtp": lambda acceptance: mtp_drafter(target, tiny_pair[0], acceptance),
        "mtp-prenorm": lambda acceptance: mtp_drafter(target, tiny_pair[0], acceptance, "pre_norm"),
        "dflash": lambda acceptance: DFlashDrafter(dflash, target, want_q=acceptance == "rejection"),
        "dspark": lambda acceptance: DSparkDrafter(dspark, target, want_q=acceptance == "rejection"),
        "eagle3": lambda acceptance: eagle3_drafter(target, eagle3_head, acceptance),
        "ngram": lambda acceptance: NgramDrafter(1, 3),
        "ngram-copy": lambda acceptance: NgramDrafter(2, 3, copy_depth=12),  # longer drafts in copying runs
        "draft": lambda acceptance: DraftModelDrafter(draft_engine, want_q=acceptance == "rejection"),
        "self": lambda acceptance: DraftModelDrafter(self_engine, want_q=acceptance == "rejection"),
        # prompt lookup in front of each model drafter (single-token matches, so random models use both;
        # model_depth 8 until the backend sets the profile's depth)
        "mtp+lookup": lambda acceptance: with_lookup(mtp_drafter(target, tiny_pair[0], acceptance)),
        "dflash+lookup": lambda acceptance: with_lookup(
            DFlashDrafter(dflash, target, want_q=acceptance == "rejection")),
        "dspark+lookup": lambda acceptance: with_lookup(
            DSparkDrafter(dspark, target, want_q=acceptance == "rejection")),
        "eagle3+lookup": lambda acceptance: with_lookup(eagle3_drafter(target, eagle3_head, acceptance)),
        "draft+lookup": lambda acceptance: with_lookup(
            DraftModelDrafter(draft_engine, want_q=acceptance == "rejection")),
        "mtp+lookup-copy": lambda acceptance: with_lookup(mtp_drafter(target, tiny_pair[0], acceptance), 12),
    }


def with_lookup(model_drafter, copy_depth: int = 0) -> LookupFirst:
    return LookupFirst(model_drafter, lookup_depth=4, n_min=1, n_max=3, model_depth=8, copy_depth=copy_depth)


class Counting:
    """Wraps a drafter's (or an n-gram index's) propose: how many passes it drafted, and its longest draft."""

    def __init__(self, drafter):
        self.passes = self.longest = 0
        self._propose = drafter.propose
        drafter.propose = self

    def __call__(self, tokens, depth, *more):
        draft = self._propose(tokens, depth, *more)
        guessed = draft if isinstance(draft, list) else draft.tokens
        self.passes += bool(guessed)
        self.longest = max(self.longest, len(guessed))
        return draft


def streamed(events) -> Summary:
    """The stream's summary, after checking that what streamed is the reply: only steps, then one
    summary, whose tokens are the steps' in order (a user reads the steps, verify the summary)."""
    events = list(events)
    steps, summary = events[:-1], events[-1]
    assert isinstance(summary, Summary) and all(isinstance(e, Step) for e in steps), [type(e) for e in events]
    assert [t for s in steps for t in s.token_ids] == summary.token_ids
    assert all(s.accepted <= s.drafted for s in steps) and (not steps or steps[0].drafted == 0)  # the prefill drafts nothing
    assert summary.text.startswith("".join(s.text for s in steps))  # + the detokenizer's held-back tail
    return summary


def compare(target, drafter, depth, sampling, messages=PROMPTS[0], acceptance="exact", prompt_ids=None,
            constraint=None):
    """(reference summary, speculative summary, verdict) for one prompt (chat messages, or token ids),
    both runs under `constraint` where one is given."""
    spec = SpeculativeBackend(target, drafter, depth, acceptance)
    request = (Request(prompt_ids=prompt_ids, constraint=constraint) if prompt_ids is not None
               else Request(messages=messages, constraint=constraint))
    ref = streamed(fresh(target).stream(request, sampling))
    out = streamed(fresh(spec).stream(request, sampling))
    prompt = target.prompt_ids(request)
    verdict = judge_tokens(ref.token_ids, out.token_ids, target.detokenize,
                           margin_function(target, prompt, ref.token_ids, sampling), 1e-4,
                           stops=(ref.stop_reason, out.stop_reason))
    return ref, out, verdict


SAMPLINGS = [Sampling(max_tokens=40), Sampling(temperature=0.8, seed=3, max_tokens=40),
             Sampling(temperature=1.2, top_k=20, top_p=0.9, seed=5, max_tokens=40)]
