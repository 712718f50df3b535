"""Strict verification through the compiled decode graphs (`compile: true` on CPU): every
single-token pass and every verify row goes through compiled graphs (exported, or torch.compile'd in
process), and the replies must
still be bit for bit target-only's, for every drafter, depth and sampling mode, with no
recompilation after the warm-up at load."""
from __future__ import annotations

import pytest
import torch

from specchat.backends.base import Request, run_to_summary
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.shared_weights import SharedWeights
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.dflash import DFlashDrafter, load_dflash
from specchat.backends.speculative.drafters import DraftModelDrafter, NgramDrafter
from specchat.verify import fresh
from tests.native.tiny import make_gguf, make_hf_checkpoint
from tests.speculative.conftest import PROMPTS, SAMPLINGS, mtp_drafter, with_lookup
from tests.speculative.tiny_dflash import make_dflash_checkpoint


@pytest.fixture(scope="module", params=["exported", "in process"])
def compiled(tiny_pair, tmp_path_factory, request):
    """(compiled int4 target, eager int4 engine of the same GGUF, a DFlash checkpoint). The graphs
    exported to a graph store, as a profile has them, or (without a store) compiled in process."""
    root = tmp_path_factory.mktemp("compiled")
    gguf = make_gguf(root / "target.gguf", tiny_pair[0], "Q4_1")
    target = TorchBackend(gguf, precision="int4", threads=2, context=256, compile=True,
                          cache_dir=root / "cache" if request.param == "exported" else None)
    target.warm_up(hidden=True)  # what make_dflash_drafter does for a profile
    eager = TorchBackend(gguf, precision="int4", threads=2, context=256)
    dflash = make_dflash_checkpoint(root / "dflash", tiny_pair[0], block_size=5, target_layer_ids=(0, 2))
    return target, eager, dflash


def make(name, target, eager, dflash, tiny_pair):
    if name == "ngram":
        return NgramDrafter(1, 3)
    if name == "eager-self":  # the same weights on the eager kernels: close, not bitwise, so some rejections
        return DraftModelDrafter(eager)
    if name == "mtp+lookup":
        return with_lookup(mtp_drafter(target, tiny_pair[0]))
    return DFlashDrafter(load_dflash(dflash, target.model.cfg), target)


def strict_or_skip(target: TorchBackend) -> None:
    if not target.model.attention_calls_shared:
        pytest.skip("this CPU's attention kernel changes a row's bits with the rows sharing its call, so compiled "
                    "graphs refuse strict verification here (test_parity.py checks the refusal)")


def test_compiled_target_is_row_exact_and_warm(compiled):
    target, eager, _ = compiled
    assert target.model.compiled is not None and eager.model.compiled is None
    assert target.row_exact_supported == target.model.attention_calls_shared
    if target.graph_store is not None:  # every graph exported, none compiled in process
        assert set(target.model.compiled.ready) == set(target.wanted) and target.model.compiled._graph is None


def on_exported_graphs_only(target: TorchBackend) -> None:
    """With a store, no call fell outside the exported graphs (to a graph compiled in process)."""
    assert target.graph_store is None or target.model.compiled._graph is None


@pytest.mark.parametrize("method", ["ngram", "eager-self", "mtp+lookup", "dflash"])
@pytest.mark.parametrize("depth", [1, 3, 6])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8", "t1.2-topk-topp"])
def test_compiled_speculative_equals_compiled_target_only(compiled, tiny_pair, method, depth, sampling):
    target, eager, dflash = compiled
    strict_or_skip(target)
    drafter = make(method, target, eager, dflash, tiny_pair)
    if method == "dflash":
        depth = min(depth, 4)
    spec = SpeculativeBackend(target, drafter, depth, strict=True)
    with torch._dynamo.config.patch(error_on_recompile=True):  # the warm-up compiled everything needed
        for messages in PROMPTS:
            ref = run_to_summary(fresh(target).stream(Request(messages=messages), sampling))
            out = run_to_summary(fresh(spec).stream(Request(messages=messages), sampling))
            assert out.token_ids == ref.token_ids and out.stop_reason == ref.stop_reason
            if method == "eager-self" and len(out.token_ids) > 3:  # its guesses are mostly right
                assert out.passes < len(out.token_ids)
    on_exported_graphs_only(target)


@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["greedy", "t0.8"])
def test_a_reference_on_the_compiled_engines_weights_is_its_target_only(compiled, tiny_pair, sampling, tmp_path):
    """The A/B and verify reference shares the compiled graphs and weights (shared_weights.py) with
    a cache of its own: token for token a separately loaded compiled target-only engine, while a
    speculative run on the same engine keeps its own cache, with no recompilation."""
    target, eager, dflash = compiled
    strict_or_skip(target)
    spec = SpeculativeBackend(target, make("mtp+lookup", target, eager, dflash, tiny_pair), 3, strict=True)
    reference = SharedWeights(target)
    alone = TorchBackend(make_gguf(tmp_path / "same.gguf", tiny_pair[0], "Q4_1"), precision="int4", threads=2,
                         context=256, compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for messages, other in zip(PROMPTS, PROMPTS[1:] + PROMPTS[:1]):
            out = run_to_summary(spec.stream(Request(messages=messages), sampling))
            cached, n = list(target.cached), target.cache_len
            keys = [k[:, :, :n].clone() for k in target.model.cache.k]
            ref_other = run_to_summary(fresh(reference).stream(Request(messages=other), sampling))
            # another conversation on the reference left the speculative run's cache as it was
            assert target.cached == cached and target.cache_len == n
            assert all(torch.equal(k[:, :, :n], before) for k, before in zip(target.model.cache.k, keys))
            assert ref_other.token_ids == run_to_summary(fresh(alone).stream(Request(messages=other), sampling)).token_ids
            ref = run_to_summary(fresh(reference).stream(Request(messages=messages), sampling))
            assert ref.token_ids == out.token_ids
    on_exported_graphs_only(target)


def test_compiled_decoding_stays_close_to_eager(compiled):
    """Another graph, other rounding: the same model, not the same bits."""
    target, eager, _ = compiled
    ids = target.tokenize_chat(PROMPTS[1])
    rows = {}
    for name, e in (("compiled", target), ("eager", eager)):
        fresh(e).forward(ids, 0)
        rows[name] = torch.cat([e.forward([t], len(ids) + i)[0] for i, t in enumerate(ids[:20])])
    diff = (rows["compiled"] - rows["eager"]).abs()
    assert diff.mean() < 0.05 and diff.max() < 0.5
    assert (rows["compiled"].argmax(-1) == rows["eager"].argmax(-1)).float().mean() > 0.9


def test_compiled_models_in_one_process_each_run_their_own_weights(compiled, tiny_pair, tmp_path):
    """The compiled graphs belong to the code, not to a model, and are guarded on the first layer
    only (see model.first_layer_guards): a second model of the same shapes, and one of another
    shape, decoded in turns with the first, must each still run their own weights."""
    target, eager, _ = compiled
    same_shape = make_gguf(tmp_path / "same.gguf", tiny_pair[1], "Q4_1")
    other_shape = make_hf_checkpoint(tmp_path / "qwen3", "qwen3", seed=5)  # q/k norms, another head size
    pairs = [(target, eager)] + [(TorchBackend(p, precision="int4", threads=2, context=256, compile=True),
                                  TorchBackend(p, precision="int4", threads=2, context=256))
                                 for p in (other_shape, same_shape)]
    ids = target.tokenize_chat(PROMPTS[0])
    for c, e in pairs:
        fresh(c).forward(ids, 0)
        fresh(e).forward(ids, 0)
    for i, t in enumerate(ids[:8]):  # one token of each model in turn
        rows = [(c.forward([t], len(ids) + i)[0], e.forward([t], len(ids) + i)[0]) for c, e in pairs]
        for j, (compiled_row, eager_row) in enumerate(rows):
            own = (compiled_row - eager_row).abs().max()
            assert own < 0.5
            for k, (_, other_eager) in enumerate(rows):
                if k != j and other_eager.shape == compiled_row.shape:
                    assert (compiled_row - other_eager).abs().max() > 2 * own
