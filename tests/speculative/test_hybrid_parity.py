"""The central invariant on a hybrid target (Gated DeltaNet + gated attention, Qwen3.5 style):
speculative == target-only for every drafter, depth, sampling mode and rollback mode, over
several turns; the classic recurrent-rollback bugs, planted, are reported as mismatches."""
import pytest

from specchat.backends.base import Request, Sampling
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.recurrent_state import ROLLBACK_MODES
from specchat.backends.speculative import backend as backend_module
from specchat.backends.speculative.drafters import DraftModelDrafter, NgramDrafter
from specchat.compare import MISMATCH
from specchat.verify import check_prompt
from tests.native.tiny import add_mtp_head, make_hf_checkpoint, make_hybrid_checkpoint, perturbed_copy
from tests.speculative.conftest import PROMPTS, SAMPLINGS, compare, mtp_drafter
from tests.speculative.test_planted_bugs import mutate


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """A hybrid target with a built-in (random) Qwen3-Next-layout MTP head; a hybrid draft model
    close to it (a noisy copy: it agrees often, not always); a dense one with the same tokenizer."""
    root = tmp_path_factory.mktemp("hybrid-spec")
    target = make_hybrid_checkpoint(root / "target", "qwen3_5", seed=21)
    near = perturbed_copy(target, root / "near", seed=24)
    add_mtp_head(target, "qwen3_next", seed=22)
    return target, near, make_hf_checkpoint(root / "draft", "llama", seed=23)


def engine(path, rollback="snapshot", precision="float32") -> TorchBackend:
    return TorchBackend(path, "hf_dir", precision=precision, threads=2, context=256, rollback=rollback)


@pytest.fixture(scope="module", params=ROLLBACK_MODES)
def hybrid(request, hybrid_pair):
    """(target, drafter factories) in one rollback mode."""
    from specchat.backends.speculative.dflash import DFlashDrafter, load_dflash
    from tests.speculative.tiny_dflash import make_dflash_checkpoint

    target_path, near_path, dense_path = hybrid_pair
    target, near, dense = engine(target_path, request.param), engine(near_path), engine(dense_path)
    # conditioned on a linear-attention layer (0) and an attention layer (1) of the target
    dflash = load_dflash(make_dflash_checkpoint(target_path.parent / f"dflash-{request.param}", target_path,
                                                block_size=7, target_layer_ids=(0, 1)), target.model.cfg)
    return target, {
        "dflash": lambda: DFlashDrafter(dflash, target),
        "ngram": lambda: NgramDrafter(1, 3),
        "near": lambda: DraftModelDrafter(near),  # a hybrid drafter: its own state rolls back too
        "dense": lambda: DraftModelDrafter(dense),  # rejects nearly everything: rollback to the block's start
        "mtp": lambda: mtp_drafter(target, target_path),
    }


@pytest.mark.parametrize("method", ["ngram", "near", "dense", "mtp", "dflash"])
@pytest.mark.parametrize("depth", [1, 3, 6])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8", "t1.2-topk-topp"])
def test_speculative_equals_target_only_on_a_hybrid(hybrid, method, depth, sampling):
    target, drafters = hybrid
    for messages in PROMPTS:
        ref, out, verdict = compare(target, drafters[method](), depth, sampling, messages)
        assert verdict.kind == "identical", verdict.line()
        assert out.tokens == ref.tokens and out.stop_reason == ref.stop_reason
        assert out.passes <= ref.passes


def test_rejections_happen_so_rollback_is_exercised(hybrid):
    target, drafters = hybrid
    _, out, _ = compare(target, drafters["near"](), 4, Sampling(max_tokens=40))
    assert 0 < out.accepted_tokens < out.draft_tokens
    # passes that kept some of their drafts but not all: rollback into the middle of a block
    assert any(1 < emitted <= len(drafted) for drafted, emitted in out.pass_log)


def test_multi_turn_keeps_parity_on_a_hybrid(hybrid):
    target, drafters = hybrid
    convo = PROMPTS[1] + [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "the lazy dog"}]
    for messages in (PROMPTS[1], convo, PROMPTS[0]):
        for method in ("near", "mtp"):
            _, _, verdict = compare(target, drafters[method](), 3, Sampling(temperature=0.8, seed=2, max_tokens=30),
                                    messages)
            assert verdict.kind == "identical", verdict.line()


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_strict_bfloat16_on_a_hybrid_is_target_only(hybrid_pair, mode):
    """Row-exact verify blocks: the linear layers run every row with a one-token step's arithmetic."""
    target = engine(hybrid_pair[0], mode, "bfloat16")
    assert target.row_exact_supported
    spec = backend_module.SpeculativeBackend(target, DraftModelDrafter(engine(hybrid_pair[1], precision="bfloat16")),
                                             4, strict=True)
    for sampling in (Sampling(max_tokens=40), Sampling(temperature=0.8, seed=3, max_tokens=40)):
        for messages in PROMPTS:
            _, _, verdict = check_prompt(spec, target, Request(messages=messages), sampling)
            assert verdict.kind == "identical", verdict.line()


import specchat.backends.native.recurrent_state as state_module  # noqa: E402

ROLLBACK_BUGS = {
    ("snapshot", "recurrent state not rolled back"): [
        ("                self.conv[j], self.ssm[j] = self.snapshots[j][rows]\n", "")],
    ("snapshot", "conv state not rolled back"): [
        ("                self.conv[j], self.ssm[j] = self.snapshots[j][rows]\n",
         "                self.ssm[j] = self.snapshots[j][rows][1]\n")],
    ("replay", "recurrent state not rolled back"): [
        ("            self.pending = rows\n", "")],
    ("replay", "conv state not rolled back"): [
        ("            self.conv[j], self.ssm[j] = conv, ssm\n", "            self.ssm[j] = ssm\n")],
    ("replay", "off-by-one in the replay"): [
        ("            self.inputs = [x[:rows] for x in self.inputs]\n",
         "            self.inputs = [x[:rows + 1] for x in self.inputs]\n")],
}


@pytest.mark.parametrize("mode,bug", sorted(ROLLBACK_BUGS))
def test_verify_reports_a_mismatch_for_each_rollback_bug(hybrid_pair, mode, bug, monkeypatch):
    import specchat.backends.native.model as model_module

    mutant = mutate(state_module, ROLLBACK_BUGS[mode, bug])
    monkeypatch.setattr(model_module, "RecurrentState", mutant.RecurrentState)
    target = engine(hybrid_pair[0], mode)
    sampling = Sampling(temperature=0.9, seed=4, max_tokens=40)
    kinds = set()
    for drafter in (DraftModelDrafter(engine(hybrid_pair[1])), NgramDrafter(1, 3)):
        spec = backend_module.SpeculativeBackend(target, drafter, 4)
        for messages in PROMPTS:
            kinds.add(check_prompt(spec, target, Request(messages=messages), sampling)[2].kind)
    assert MISMATCH in kinds, f"{bug} ({mode}) went unnoticed"


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_the_unmutated_rollback_passes_the_same_check(hybrid_pair, mode):
    target = engine(hybrid_pair[0], mode)
    sampling = Sampling(temperature=0.9, seed=4, max_tokens=40)
    for drafter in (DraftModelDrafter(engine(hybrid_pair[1])), NgramDrafter(1, 3)):
        spec = backend_module.SpeculativeBackend(target, drafter, 4)
        for messages in PROMPTS:
            assert check_prompt(spec, target, Request(messages=messages), sampling)[2].kind == "identical"


@pytest.mark.parametrize("depth", [1, 4])
def test_a_hybrid_draft_model_never_prefills_again(hybrid, hybrid_pair, depth):
    """Its state returns into its own proposals' passes (the positions it holds returnable), so
    after the first pass each proposal starts where what it has fed and what it is given part:
    it feeds only the tokens it has not seen, never one it could have returned to."""
    from specchat.backends.speculative.loop import common_prefix

    target, _ = hybrid
    drafter = DraftModelDrafter(engine(hybrid_pair[1]))  # its own: what earlier runs held stays held
    passes, seen = [], []
    forward = drafter.engine.forward

    def recorded(tokens, start, *a, **k):
        full = seen[:start] + list(tokens)
        passes.append((start, len(tokens), min(common_prefix(seen, full), len(full) - 1)))
        seen[:] = full
        return forward(tokens, start, *a, **k)

    drafter.engine.forward = recorded
    try:
        _, out, verdict = compare(target, drafter, depth, Sampling(max_tokens=40))
    finally:
        drafter.engine.forward = forward
    assert verdict.kind == "identical" and out.accepted_tokens > 0
    assert passes[0][0] == 0 and len(passes) > 20
    assert all(start == earliest for start, _, earliest in passes[1:]), passes
    assert all(n <= depth + 1 for _, n, _ in passes[1:]), passes  # catch-up passes of at most depth + 1 tokens


def test_a_hybrid_draft_model_returns_into_a_catch_up_pass_after_its_own_guesses(hybrid_pair):
    """Behind another drafter (draft+lookup) the draft model may catch up depth + 1 tokens it never
    drafted, then guess depth - 1 more: its next proposal must still be able to return to any of
    those 2 * depth positions (it holds 2 * depth + 2 returnable) instead of prefilling again."""
    depth = 4
    drafter = DraftModelDrafter(engine(hybrid_pair[1]))
    prompt = engine(hybrid_pair[0]).prompt_ids(Request(messages=PROMPTS[0]))
    drafter.start(prompt[:-1], {}, Sampling())
    first = drafter.propose(prompt, depth).tokens
    others = [t for t in range(3, 40) if t not in first][:depth + 1]  # what the other drafter's run committed
    drafter.propose(prompt + others, depth)  # a catch-up pass of depth + 1 tokens, then its guesses
    fed, forward = [], drafter.engine.forward

    def recorded(tokens, start, *a, **k):
        fed.append((start, len(tokens)))
        return forward(tokens, start, *a, **k)

    drafter.engine.forward = recorded
    own = next(t for t in range(3, 40) if t not in others)
    for kept in (1, depth):  # into the catch-up pass, and just past it
        fed.clear()
        committed = prompt + others[:kept] + [own]
        drafter.propose(committed, depth)
        assert fed[0] == (len(committed) - 1, 1), fed  # only the token it has not seen
        drafter.propose(prompt + others, depth)
