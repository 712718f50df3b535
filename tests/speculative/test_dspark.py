"""DSpark: the Markov-corrected draft chain against a hand computation on an independent reference
(Hugging Face hidden states, naive DFlash layers: test_dflash.reference_logits), the anchor-first
layout, the loader's one-line refusals, and speculative == target-only (strict too)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from specchat.backends.base import BackendError, Request, Sampling, run_to_summary
from specchat.backends.native.engine import TorchBackend
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.dflash import DFlashDrafter
from specchat.backends.speculative.dspark import DSparkDrafter, load_dspark
from specchat.verify import fresh
from tests.speculative.conftest import PROMPTS, SAMPLINGS
from tests.speculative.test_dflash import hf_target, prompt_ids, qwen3, qwen3_dir, reference_logits  # noqa: F401
from tests.speculative.tiny_dspark import make_dspark_checkpoint


def drafter_for(target, ck, want_q=False) -> DSparkDrafter:
    return DSparkDrafter(load_dspark(ck, target.model.cfg), target, want_q)


def start(drafter, target, tokens, sampling=Sampling()):
    drafter.start(tokens[:-1], fresh(target).forward(tokens[:-1], 0, drafter.hidden_layers)[1], sampling)


def test_each_draft_is_corrected_from_the_one_before(tmp_path, qwen3_dir, qwen3, hf_target):
    ck = make_dspark_checkpoint(tmp_path / "d", qwen3_dir, block_size=5, markov_scale=3.0)
    w = load_file(str(ck / "model.safetensors"))
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    drafter = drafter_for(qwen3, ck)
    tokens = prompt_ids(qwen3) + [77]
    start(drafter, qwen3, tokens)
    draft = drafter.propose(tokens, 4)
    base, prev, want = reference_logits(hf_target, ck, tokens), tokens[-1], []
    for k in range(4):  # greedy: argmax of the base logits plus w2 . w1[previous draft]
        prev = int((base[k] + w2 @ w1[prev]).argmax())
        want.append(prev)
    assert draft.tokens == want
    assert want != [int(t) for t in base.argmax(-1)]  # the head changed the drafts (else the test shows nothing)


def test_anchor_first_drafts_a_whole_block_from_slot_zero(tmp_path, qwen3_dir, qwen3):
    ck = make_dspark_checkpoint(tmp_path / "d", qwen3_dir, block_size=4, anchor_first=True, confidence=True)
    drafter = drafter_for(qwen3, ck)
    assert drafter.max_depth == 4 and drafter.markov.conf_w.shape == (1, 64 + 8)  # read, shape-checked, unused
    dflash = DFlashDrafter(drafter.model, qwen3)  # the same block drafter in DFlash's layout
    tokens = prompt_ids(qwen3) + [77]
    start(drafter, qwen3, tokens)
    start(dflash, qwen3, tokens)
    # the anchor's own row is the first draft; the rest are DFlash's slots 1..
    torch.testing.assert_close(drafter.draft_logits(tokens, 4)[1:], dflash.draft_logits(tokens, 3))
    start(drafter, qwen3, tokens)
    assert len(drafter.propose(tokens, 9).tokens) == 4


@pytest.mark.parametrize("case, kw, message", [
    ("no markov head", dict(drop=("markov_head.markov_w2.weight",)), "markov_head.markov_w2.weight missing"),
    ("rank differs", dict(shapes={"markov_head.markov_w2.weight": (320, 4)}), "must have the same shape"),
    ("other vocabulary", dict(shapes={"markov_head.markov_w1.weight": (50, 8), "markov_head.markov_w2.weight": (50, 8)}),
     "expected [320, rank]"),
    ("confidence shape", dict(confidence=True, shapes={"confidence_head.proj.weight": (1, 64)}),
     "expected [1, 72]"),
    ("half a confidence head", dict(confidence=True, drop=("confidence_head.proj.bias",)), "needs both"),
    ("foreign tensor", dict(shapes={"markov_head.gate.weight": (4, 4)}), "a DSpark drafter does not have"),
])
def test_loader_refuses_a_broken_markov_head_in_one_line(tmp_path, qwen3_dir, qwen3, case, kw, message):
    ck = make_dspark_checkpoint(tmp_path / "d", qwen3_dir, **kw)
    with pytest.raises(BackendError, match=message.replace("[", r"\[")) as e:
        load_dspark(ck, qwen3.model.cfg)
    assert "\n" not in str(e.value)


def test_a_dflash_drafter_is_refused_as_dspark_and_depth_is_bounded(tmp_path, qwen3_dir):
    from specchat.backends.speculative.backend import SpeculativeSettings, make_drafter
    from tests.speculative.tiny_dflash import make_dflash_checkpoint

    target = TorchBackend(qwen3_dir, "hf_dir", precision="float32", threads=1, context=64)
    with pytest.raises(BackendError, match="method dflash"):
        make_drafter(SpeculativeSettings("dspark", make_dflash_checkpoint(tmp_path / "f", qwen3_dir), depth=2), target)
    ck = make_dspark_checkpoint(tmp_path / "d", qwen3_dir, block_size=4)
    with pytest.raises(BackendError, match="depth 4 is more than this DSpark drafter"):
        make_drafter(SpeculativeSettings("dspark", ck, depth=4), target)
    assert make_drafter(SpeculativeSettings("dspark", ck, depth=3), target).name == "dspark"


@pytest.mark.parametrize("depth", [1, 3, 6])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8", "t1.2-topk-topp"])
def test_speculative_with_dspark_equals_target_only_on_qwen3(tmp_path_factory, qwen3_dir, qwen3, depth, sampling):
    ck = make_dspark_checkpoint(tmp_path_factory.mktemp("d") / "d", qwen3_dir, block_size=7)
    spec = SpeculativeBackend(qwen3, drafter_for(qwen3, ck), depth)
    for messages in PROMPTS + [PROMPTS[1] + [{"role": "assistant", "content": "fine"},
                                            {"role": "user", "content": "the lazy dog"}]]:
        ref = run_to_summary(fresh(qwen3).stream(Request(messages=messages), sampling))
        out = run_to_summary(fresh(spec).stream(Request(messages=messages), sampling))
        assert out.token_ids == ref.token_ids and out.stop_reason == ref.stop_reason
        assert out.draft_tokens > 0 and max(len(d) for d, _ in out.pass_log) == depth


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8", "t1.2-topk-topp"])
def test_strict_dspark_is_bitwise_target_only(tmp_path, tiny_pair, sampling):
    target = TorchBackend(tiny_pair[0], "hf_dir", precision="bfloat16", threads=2, context=256)
    spec = SpeculativeBackend(target, drafter_for(target, make_dspark_checkpoint(tmp_path / "d", tiny_pair[0],
                                                                                block_size=5)), 4, strict=True)
    for messages in PROMPTS:
        ref = run_to_summary(fresh(target).stream(Request(messages=messages), sampling))
        out = run_to_summary(fresh(spec).stream(Request(messages=messages), sampling))
        assert out.token_ids == ref.token_ids


def test_rejection_acceptance_gets_the_distributions_drafts_were_sampled_from(tmp_path, qwen3_dir, qwen3):
    from specchat.backends.native.sampling import probs

    drafter = drafter_for(qwen3, make_dspark_checkpoint(tmp_path / "d", qwen3_dir, block_size=5), want_q=True)
    sampling = Sampling(temperature=0.9, top_k=20, seed=3, max_tokens=20)
    tokens = prompt_ids(qwen3) + [77]
    start(drafter, qwen3, tokens, sampling)
    chosen, logits = drafter.chain(tokens, 4)
    start(drafter, qwen3, tokens, sampling)
    draft = drafter.propose(tokens, 4)
    assert draft.tokens == chosen and torch.equal(draft.q, probs(logits, sampling))
    assert all(draft.q[i, t] > 0 for i, t in enumerate(draft.tokens))
    out = run_to_summary(SpeculativeBackend(fresh(qwen3), drafter, 4, acceptance="rejection")
                         .stream(Request(messages=PROMPTS[1]), sampling))
    assert out.stop_reason in ("eos", "max_tokens") and out.drafts > 0
