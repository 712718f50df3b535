"""Compiled decode graphs on a hybrid target (Gated DeltaNet + attention, Qwen3.5 style): the
recurrent state goes into and out of the one-row graph (graph_state.py), verify rows run through
it one by one, and strict speculative decoding stays bit for bit the compiled target-only run,
with rollback into verify blocks and turn checkpoints. One graph export per session (about a
minute on 2 cores)."""
from __future__ import annotations

import pytest
import torch

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.graph_store import Variant
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.drafters import DraftModelDrafter, NgramDrafter
from specchat.verify import fresh
from tests.native.tiny import add_mtp_head, make_hybrid_checkpoint, perturbed_copy
from tests.speculative.conftest import PROMPTS, SAMPLINGS, mtp_drafter

pytestmark = pytest.mark.timeout(600)  # the module fixture exports a graph (a minute alone; more beside other work)


def load(path, cache_dir, compile=True) -> TorchBackend:
    return TorchBackend(path, "hf_dir", precision="bfloat16", threads=2, context=256, compile=compile,
                        cache_dir=cache_dir)


@pytest.fixture(scope="module")
def compiled_hybrid(tmp_path_factory):
    """(compiled bfloat16 hybrid target with its graph store, eager engine of a near copy, paths)."""
    root = tmp_path_factory.mktemp("compiled-hybrid")
    target_path = make_hybrid_checkpoint(root / "target", "qwen3_5", seed=31)
    near_path = perturbed_copy(target_path, root / "near", seed=32)
    add_mtp_head(target_path, "qwen3_next", seed=33)
    target = load(target_path, root / "cache")
    near = load(near_path, None, compile=False)
    return target, near, target_path, root / "cache"


def test_one_row_graph_is_exported_and_stored_for_a_hybrid(compiled_hybrid):
    target, _, path, cache = compiled_hybrid
    assert target.model.compiled is not None and target.model.compiled.hybrid
    assert set(target.model.compiled.ready) == {Variant(True, False)} and target.model.compiled._graph is None
    assert target.row_exact_supported
    assert "layers" in (target.graph_store.root / "origin.txt").read_text()  # the layer layout keys the store
    again = load(path, cache)  # a later start loads the stored graph
    assert set(again.model.compiled.ready) == {Variant(True, False)} and again.model.compiled._graph is None


def test_verify_rows_and_rollback_equal_one_token_passes(compiled_hybrid):
    """A row-exact block's rows are the one-token passes' bits, and after rolling back into the
    block decoding goes on as if only the kept rows had been fed."""
    target, _, _, _ = compiled_hybrid
    ids = target.tokenize_chat(PROMPTS[1])
    n = len(ids)
    more = [5, 17, 9, 40, 33, 21]
    fresh(target).forward(ids, 0, all_logits=False)
    one = torch.cat([target.forward([t], n + i)[0] for i, t in enumerate(more)])
    target.truncate(n)
    block, _ = target.forward(more, n, row_exact=True)
    assert torch.equal(block, one)
    target.truncate(n + 2)  # keep two rows of the block
    after, _ = target.forward([77, 78], n + 2, row_exact=True)
    fresh(target).forward(ids, 0, all_logits=False)
    want = torch.cat([target.forward([t], n + i)[0] for i, t in enumerate(more[:2] + [77, 78])])
    assert torch.equal(after, want[2:])


@pytest.mark.parametrize("method", ["ngram", "near", "mtp"])
@pytest.mark.parametrize("depth", [1, 4])
@pytest.mark.parametrize("sampling", SAMPLINGS[:2], ids=["greedy", "t0.8"])
def test_compiled_hybrid_speculative_equals_compiled_target_only(compiled_hybrid, method, depth, sampling):
    target, near, path, _ = compiled_hybrid
    drafter = {"ngram": lambda: NgramDrafter(1, 3), "near": lambda: DraftModelDrafter(near),
               "mtp": lambda: mtp_drafter(target, path)}[method]()
    spec = SpeculativeBackend(target, drafter, depth, strict=True)
    for messages in PROMPTS:
        ref = run_to_summary(fresh(target).stream(Request(messages=messages), sampling))
        out = run_to_summary(fresh(spec).stream(Request(messages=messages), sampling))
        assert out.token_ids == ref.token_ids and out.stop_reason == ref.stop_reason
        if method == "near":  # rejections happen, so rollback into verify blocks is exercised
            assert out.accepted_tokens < out.draft_tokens
    assert target.model.compiled._graph is None  # every call on the exported graph


def test_changed_reply_restarts_from_the_turn_checkpoint_compiled(compiled_hybrid):
    """The next turn re-renders the reply: speculative decoding restarts from where the reply
    started (a turn checkpoint), and replies as a fresh compiled target-only run."""
    target, near, path, cache = compiled_hybrid
    sampling = Sampling(temperature=0.8, seed=6, max_tokens=16)
    spec = SpeculativeBackend(target, DraftModelDrafter(near), 3, strict=True)
    turn = [PROMPTS[0][0]]
    first = target.prompt_ids(Request(messages=turn))
    run_to_summary(fresh(spec).stream(Request(messages=turn), sampling))
    convo = turn + [{"role": "assistant", "content": "no idea"}, {"role": "user", "content": "hello world"}]
    again = run_to_summary(spec.stream(Request(messages=convo), sampling))
    assert again.prefill_start == len(first)
    assert again.token_ids == run_to_summary(load(path, cache).stream(Request(messages=convo), sampling)).token_ids
