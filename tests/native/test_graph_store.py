"""Compiled decode graphs kept on disk (graph_store.py): a second start loads them instead of
compiling, decodes bit for bit as the first, and anything that could make them stale, or a file
that is broken, makes the engine compile again instead of trusting them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native import graph_store
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.graph_store import Variant, store_key

SETTINGS = dict(precision="int4", context=128)
CHAT = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog, the quick brown fox"}]


def compiled(gguf, cache_dir) -> TorchBackend:
    return TorchBackend(gguf, precision="int4", threads=2, context=128, compile=True, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def first_start(tiny_ggufs, tmp_path_factory):
    """A model file of its own, a cache directory, and the engine of a first start (which compiled
    and saved its graphs there)."""
    root = tmp_path_factory.mktemp("graph-store")
    gguf = shutil.copy(tiny_ggufs["Q4_1"], root / "model.gguf")
    engine = compiled(gguf, root / "cache")
    return gguf, root / "cache", engine


def saved(cache_dir) -> list[str]:
    return sorted(p.name for p in (cache_dir / "graphs").glob("*/*.pt2"))


def test_a_first_start_saves_its_graphs_and_a_second_loads_them_bit_for_bit(first_start):
    gguf, cache_dir, first = first_start
    variants = set(first.model.compiled.ready)
    assert Variant(True, False) in variants
    assert saved(cache_dir) == sorted(v.file for v in variants)
    second = compiled(gguf, cache_dir)
    assert set(second.model.compiled.ready) == variants
    # loaded, not compiled: the load took no compiling (a first start takes many times longer)
    assert second.load_s < first.load_s / 3
    for sampling in (Sampling(max_tokens=24), Sampling(temperature=0.8, seed=3, max_tokens=24)):
        a = run_to_summary(first.stream(Request(messages=CHAT), sampling))
        b = run_to_summary(second.stream(Request(messages=CHAT), sampling))
        assert a.token_ids == b.token_ids and len(a.token_ids) > 5


def test_the_store_is_keyed_by_what_the_graphs_depend_on(first_start, monkeypatch):
    gguf, _, _ = first_start
    key = store_key(gguf, SETTINGS)
    assert store_key(gguf, SETTINGS) == key
    assert store_key(gguf, SETTINGS | {"context": 256}) != key
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert store_key(gguf, SETTINGS) != key  # another torch
    monkeypatch.undo()
    monkeypatch.setattr(graph_store, "cpu_tag", lambda: "another-cpu")
    assert store_key(gguf, SETTINGS) != key
    monkeypatch.undo()
    stat = os.stat(gguf)
    try:
        os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the model file changed
        assert store_key(gguf, SETTINGS) != key
    finally:
        os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_another_torch_compiles_again_and_removes_the_stale_graphs(first_start, tmp_path, monkeypatch):
    """A changed torch version stamp (or model file, CPU, engine source: another key, as above)."""
    gguf, cache_dir, first = first_start
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir, cache)
    before = first.model.compiled.store.root.name
    for beside in (".lock", ".log", ".failed"):  # a background preparation's files go with their store
        (cache / "graphs" / f"{before}{beside}").write_text("")
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    engine = compiled(gguf, cache)
    after = engine.model.compiled.store.root.name
    assert after != before and set(engine.model.compiled.ready) == set(first.model.compiled.ready)
    assert [p.name for p in (cache / "graphs").iterdir()] == [after]  # compiled again, the stale store removed
    same_as_the_next_start(engine, gguf, cache)


def same_as_the_next_start(engine, gguf, cache):
    """A start that loads what `engine` saved decodes bit for bit as `engine` does (a graph compiled
    in another process state may round differently from the first start's: the one saved is the
    one every later start runs)."""
    later = compiled(gguf, cache)
    assert set(later.model.compiled.ready) == set(engine.model.compiled.ready)
    sampling = Sampling(max_tokens=24)
    assert (run_to_summary(later.stream(Request(messages=CHAT), sampling)).token_ids
            == run_to_summary(engine.stream(Request(messages=CHAT), sampling)).token_ids)


@pytest.mark.parametrize("damage", ["truncated", "other fingerprint"])
def test_a_broken_graph_is_compiled_again_never_trusted(first_start, tmp_path, damage):
    gguf, cache_dir, first = first_start
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir, cache)
    name = Variant(True, False).file
    one = cache / "graphs" / first.model.compiled.store.root.name / name
    fingerprint = one.with_suffix(".fingerprint")
    if damage == "truncated":
        one.write_bytes(one.read_bytes()[: one.stat().st_size // 2])
    else:  # a graph that no longer computes what it did when saved
        torch.save(torch.load(fingerprint) + 1, fingerprint)
    saved_at = one.stat().st_mtime_ns
    engine = compiled(gguf, cache)
    assert Variant(True, False) in engine.model.compiled.ready
    assert one.stat().st_mtime_ns != saved_at  # compiled and saved again, not used as it was
    same_as_the_next_start(engine, gguf, cache)


def test_a_later_start_loads_its_graphs_without_tracing_or_compiling(first_start):
    """The stored graphs are AOTInductor packages: a later start neither imports dynamo (seconds)
    nor runs a C++ compiler, and decodes on them past the first key span (from there a span is
    the whole context, which the precompiled graphs left to a graph compiled in process)."""
    gguf, cache_dir, first = first_start
    probe = f"""
import subprocess, sys
calls = []
real_popen = subprocess.Popen.__init__
def popen(self, args, *a, **k):
    calls.append(args)
    return real_popen(self, args, *a, **k)
subprocess.Popen.__init__ = popen
from pathlib import Path
from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native.engine import TorchBackend
engine = TorchBackend(Path({str(gguf)!r}), precision="int4", threads=2, context=128, compile=True,
                      cache_dir=Path({str(cache_dir)!r}))
loaded_dynamo = "torch._dynamo" in sys.modules
prompt = [{{"role": "user", "content": "count: " + " ".join(str(i) for i in range(30))}}]
ids = engine.tokenize_chat(prompt)
summary = run_to_summary(engine.stream(Request(messages=prompt), Sampling(max_tokens=128 - len(ids))))
import json
print(json.dumps([loaded_dynamo, len(ids) + len(summary.token_ids), engine.model.compiled._graph is None,
                  [str(c if isinstance(c, str) else c[0]) for c in calls]]))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded_dynamo, end, no_graph_in_process, programs = json.loads(out.stdout.splitlines()[-1])
    assert not loaded_dynamo and no_graph_in_process
    assert end > 64  # past the first key span, to where a span is the whole context
    assert not {Path(p.split()[0]).name for p in programs} & {"g++", "gcc", "c++", "cc", "clang", "clang++"}
