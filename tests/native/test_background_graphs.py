"""Compiled graphs prepared in the background (background_graphs.py): the engine answers at once on
eager passes, a low-priority process stores the graphs, and between replies the engine moves to
them, its speculative runs and its reference starting their caches again, every reply staying
identical to target-only decoding on the same arithmetic."""
from __future__ import annotations

import shutil

import pytest
import torch

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native.background_graphs import side_file
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.shared_weights import SharedWeights
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.drafters import NgramDrafter

CHAT = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog, the quick brown fox"}]
GREEDY, SEEDED = Sampling(max_tokens=24), Sampling(temperature=0.8, seed=3, max_tokens=24)


def engine(gguf, cache_dir, background=True, start=True) -> TorchBackend:
    target = TorchBackend(gguf, precision="int4", threads=2, context=128, compile=True, cache_dir=cache_dir,
                          compile_in_background=background)
    if start:
        target.prepare_in_background()
    return target


def reply(backend, sampling=GREEDY) -> list[int]:
    return run_to_summary(backend.stream(Request(messages=CHAT), sampling)).token_ids


@pytest.fixture
def model_copy(tiny_ggufs, tmp_path):
    """A model file of its own (so that no other test's graph store serves it) and a cache."""
    return shutil.copy(tiny_ggufs["Q4_1"], tmp_path / "model.gguf"), tmp_path / "cache"


def test_eager_replies_at_once_then_compiled_graphs_between_replies(model_copy):
    gguf, cache_dir = model_copy
    target = engine(gguf, cache_dir, start=False)
    # planned, not started: a reply the command was started for runs on every thread, undisturbed
    assert target.model.compiled is None and target.background is None and target.background_status() is None
    assert torch.get_num_threads() == 2
    assert len(reply(target)) > 0 and target.background is None
    target.prepare_in_background()
    # one thread fewer from here: the eager passes' bits change, so the cache starts again
    assert target.background is not None and target.cache_len == 0
    assert torch.get_num_threads() == 1  # a core left to the process preparing the graphs
    assert "compiling decode graphs in the background (0/" in target.background_status()
    spec = SpeculativeBackend(target, NgramDrafter(1, 3), 3, strict=True)
    reference = SharedWeights(target)
    eager = {s: reply(reference, s) for s in (GREEDY, SEEDED)}
    for s in (GREEDY, SEEDED):
        assert reply(spec, s) == eager[s]

    assert target.background.wait(timeout=900).ready
    assert target.background_status() == "compiled graphs ready: used from the next reply"
    assert target.cache_len > 0 and reference.cache_len > 0
    stored = {f: f.stat().st_mtime_ns for f in target.graph_store.root.iterdir()}
    assert spec.switch_if_ready().startswith("switched to compiled decode graphs")
    # loaded as stored, not compiled again (their check must not depend on what the cache held)
    assert {f: f.stat().st_mtime_ns for f in target.graph_store.root.iterdir()} == stored
    assert target.model.compiled is not None and set(target.model.compiled.ready) == set(target.wanted)
    assert torch.get_num_threads() == 2
    # the eager passes' keys and values are not the graphs' bits: every cache on these weights starts again
    assert target.cache_len == 0 and reference.cache_len == 0 and target.cached == [] == reference.cached
    assert spec.switch_if_ready() is None and target.background_status() is None

    # as a later start, which loads the stored graphs, decodes the same replies in turn (a reply that
    # reuses the cache computes its prompt's last token on its own, as the eager passes did above)
    fresh = engine(gguf, cache_dir, background=False)
    for s in (GREEDY, SEEDED, GREEDY):
        assert reply(spec, s) == reply(fresh, s) == reply(reference, s)
    assert target.cache_len > 0 and reference.cache_len > 0


def test_a_later_start_uses_the_stored_graphs_from_its_first_reply(model_copy):
    gguf, cache_dir = model_copy
    engine(gguf, cache_dir, background=False)  # stores the graphs
    later = engine(gguf, cache_dir)
    assert later.model.compiled is not None and later.background is None
    assert later.background_status() is None and later.switch_if_ready() is None


def test_a_failed_background_process_leaves_eager_passes_and_says_why(model_copy):
    gguf, cache_dir = model_copy
    probe = engine(gguf, cache_dir)  # to learn where its process keeps its lock
    probe.background.stop()
    side_file(probe.graph_store, ".lock").unlink(missing_ok=True)
    side_file(probe.graph_store, ".lock").mkdir()  # the process cannot take its lock
    target = engine(gguf, cache_dir)
    before = reply(target)
    assert not target.background.wait(timeout=300).ready
    assert target.background_status() == "eager passes (compiled graphs unavailable)"
    line = target.switch_if_ready()
    assert line.startswith("compiled decode graphs unavailable, staying on eager passes: ")
    assert "Is a directory" in line and "(log: " in line and "\n" not in line
    assert target.model.compiled is None and target.switch_if_ready() is None
    # remembered: a later start stays eager at once and says why, once, without a new process
    later = engine(gguf, cache_dir)
    assert later.background is None and later.background_status() == "eager passes (compiled graphs unavailable)"
    said = later.switch_if_ready()
    assert "Is a directory" in said and f"delete {side_file(later.graph_store, '.failed')}" in said
    assert later.switch_if_ready() is None
    assert target.background_status() == "eager passes (compiled graphs unavailable)"
    # its cache started again with all its threads back: the next reply is a first reply's
    assert target.cache_len == 0 and torch.get_num_threads() == 2
    assert reply(target) == before == reply(TorchBackend(gguf, precision="int4", threads=2, context=128))


def test_without_a_cxx_compiler_the_engine_stays_eager_and_says_how_to_fix_it(model_copy, monkeypatch):
    gguf, cache_dir = model_copy
    monkeypatch.setenv("CXX", "no-such-compiler++")  # the compiler torch's CPU code would use
    target = engine(gguf, cache_dir)
    assert target.background is None and target.model.compiled is None
    assert target.background_status() == "eager passes (compiled graphs unavailable)"
    line = target.switch_if_ready()
    assert "needs a C++ compiler (no-such-compiler++)" in line and "set compile: false" in line
    assert len(reply(target)) > 5
