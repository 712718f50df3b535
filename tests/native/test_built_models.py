"""A built model kept in the cache (backends/native/built_models.py): a second start maps it instead of
building it, with the same tensors and the same logits bit for bit; the KV cache is sized by the
new start's context; a broken entry is built again; other settings or a changed file are other
entries; only the newest few are kept."""
from __future__ import annotations

import os

import pytest
import torch

from specchat.backends.native import built_models
from specchat.backends.native.engine import TorchBackend

IDS = [1, 17, 42, 99, 5, 23, 64, 7]


@pytest.fixture(autouse=True)
def store_on(monkeypatch):
    monkeypatch.delenv("SPECCHAT_BUILT_MODELS")


def engine(path, cache_dir, **kw) -> TorchBackend:
    e = TorchBackend(path, threads=2, context=kw.pop("context", 64), cache_dir=cache_dir, **kw)
    if e.keeping is not None:
        e.keeping.join()
    return e


def entries(cache_dir) -> list:
    return sorted((cache_dir / built_models.KIND).glob("*.pt"))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "F32"])
def test_a_second_start_maps_the_kept_model_with_the_same_bits(tiny_ggufs, tmp_path, qtype, monkeypatch):
    first = engine(tiny_ggufs[qtype], tmp_path)
    assert first.keeping is not None and len(entries(tmp_path)) == 1
    built = []
    monkeypatch.setattr(built_models, "build_model", lambda *a, **k: built.append(1))  # must not be called
    second = engine(tiny_ggufs[qtype], tmp_path, context=48)
    assert not built and second.keeping is None and second.precision == first.precision
    assert second.model.max_len == 48 and second.model.cache.k[0].shape != first.model.cache.k[0].shape
    ours = dict(second.model.named_parameters())
    for name, p in first.model.named_parameters():
        assert torch.equal(p, ours[name]), name
    ids = torch.tensor(IDS)
    assert torch.equal(first.forward(ids, 0)[0], second.forward(ids, 0)[0])


def test_other_settings_and_a_changed_file_are_other_entries(tiny_ggufs, tmp_path):
    path = tiny_ggufs["Q8_0"]
    engine(path, tmp_path)
    engine(path, tmp_path, precision="float32")
    assert len(entries(tmp_path)) == 2
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(path.read_bytes())
    engine(copy, tmp_path)
    os.utime(copy, ns=(1, 1))  # the same path, touched: read again
    engine(copy, tmp_path)
    assert len(entries(tmp_path)) == 4


def test_a_broken_entry_is_built_again(tiny_ggufs, tmp_path, caplog):
    path = tiny_ggufs["Q4_1"]
    reference = engine(path, tmp_path).forward(torch.tensor(IDS), 0)[0]
    (entry,) = entries(tmp_path)
    entry.write_bytes(entry.read_bytes()[:1000])
    again = engine(path, tmp_path)
    assert "could not be read" in caplog.text and again.keeping is not None
    assert torch.equal(again.forward(torch.tensor(IDS), 0)[0], reference)
    assert entries(tmp_path)[0].stat().st_size > 1000


def test_only_the_newest_entries_are_kept(tiny_ggufs, tmp_path, monkeypatch):
    monkeypatch.setattr(built_models, "KEEP", 2)
    for context in (32, 48, 64):  # the context is not part of the key: one entry a precision
        engine(tiny_ggufs["Q8_0"], tmp_path, context=context)
    for precision in ("float32", "bfloat16"):
        engine(tiny_ggufs["Q8_0"], tmp_path, precision=precision)
    assert len(entries(tmp_path)) == 2


def test_without_a_cache_directory_or_with_the_store_off_nothing_is_kept(tiny_ggufs, tmp_path, monkeypatch):
    assert TorchBackend(tiny_ggufs["Q4_1"], threads=2, context=32).keeping is None
    monkeypatch.setenv("SPECCHAT_BUILT_MODELS", "0")
    assert engine(tiny_ggufs["Q4_1"], tmp_path).keeping is None and not entries(tmp_path)


def test_a_disk_too_full_for_the_entry_keeps_nothing(tiny_ggufs, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(built_models, "SPARE_DISK", 1 << 60)
    e = engine(tiny_ggufs["Q4_1"], tmp_path)
    assert e.keeping is None and not entries(tmp_path) and "is not stored" in caplog.text
