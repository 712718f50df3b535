"""GGUF loading: llama-arch un-permutation, dequantization, int4 kernel path, tokenizer from metadata."""
from __future__ import annotations

import gguf
import pytest
import torch

from specchat.backends.base import BackendError
from specchat.backends.hf_reference import load_hf_model
from specchat.backends.llamaserver.to_gguf import permute_rows
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.gguf_loader import _unpermute_rows, load_gguf
from specchat.backends.native.kquant import QuantRows
from specchat.backends.native.int4 import Int4Rows
from specchat.backends.native.weights import load_hf_dir

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


def test_unpermute_inverts_llamacpp_permutation():
    w = torch.arange(48 * 3).reshape(48, 3).numpy()
    for n_head in (1, 2, 3, 4):
        permuted = torch.from_numpy(permute_rows(w, n_head))
        assert torch.equal(permuted[_unpermute_rows(48, n_head)], torch.from_numpy(w))


def test_f32_gguf_holds_exactly_the_hf_weights(tiny_ggufs, tiny_dirs):
    gg, hf = load_gguf(tiny_ggufs["F32"]), load_hf_dir(tiny_dirs["llama"])
    assert gg.cfg.n_layers == hf.cfg.n_layers and gg.cfg.rope_theta == hf.cfg.rope_theta
    assert gg.head is None and gg.cfg.tie_embeddings
    for a, b in zip(gg.layers, hf.layers):
        for key in ("q", "k", "v", "o", "gate", "up", "down", "attn_norm", "mlp_norm"):
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1"])
def test_gguf_logits_match_transformers_gguf_loader(tiny_ggufs, qtype):
    path = tiny_ggufs[qtype]
    engine = TorchBackend(path, precision="float32", context=64)
    hf = load_hf_model(path)  # transformers' own GGUF conversion, dequantized to float32
    ids = engine.tokenize_chat(MESSAGES)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    logits, _ = engine.forward(ids, 0)
    assert (logits - ref).abs().max().item() < 1e-4


def test_q8_0_blocks_dequantize_as_the_gguf_library_does(tiny_ggufs):
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from specchat.backends.native.gguf_loader import _dense

    q8 = [t for t in GGUFReader(tiny_ggufs["Q8_0"]).tensors if t.tensor_type.name == "Q8_0"]
    assert q8
    for t in q8:
        expected = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        assert torch.equal(_dense(t), torch.from_numpy(expected).reshape(_dense(t).shape)), t.name


def test_q4_blocks_are_kept_exactly(tiny_ggufs):
    dense = load_gguf(tiny_ggufs["Q4_1"])
    int4 = load_gguf(tiny_ggufs["Q4_1"], keep_int4=True)
    blocks = int4.layers[0]["q"]  # the file's blocks, decoded when the layer is built
    assert isinstance(blocks, QuantRows) and blocks.type == "Q4_1"
    q = blocks.as_int4()
    assert isinstance(q, Int4Rows) and q.q.max() <= 15
    assert torch.allclose(q.dequantize(), dense.layers[0]["q"], atol=1e-6)


def test_int4_kernel_computes_the_q4_weights(tiny_ggufs):
    from specchat.backends.native.matrix import as_linear

    w = load_gguf(tiny_ggufs["Q4_1"], keep_int4=True).layers[1]["gate"].as_int4()
    linear = as_linear([w], [None], torch.bfloat16, int4=True, device=torch.device("cpu"))
    assert linear.quantized
    x = torch.randn(5, w.q.shape[1]).to(torch.bfloat16)
    # torch's kernel keeps scale and zero in bfloat16 (ours in float16): the reference rounds them so
    rounded = Int4Rows(w.q, w.scale.bfloat16().float(), w.zero.bfloat16().float())
    ref = x.float() @ rounded.dequantize().t()
    assert (linear(x).float() - ref).abs().max().item() < 0.01 * ref.abs().max().item()


def test_int4_model_is_close_to_dequantized_float32(tiny_ggufs):
    path = tiny_ggufs["Q4_1"]
    ref_engine = TorchBackend(path, precision="float32", context=64)
    engine = TorchBackend(path, precision="int4", context=64)
    assert engine.precision == "int4"
    assert engine.model.layers[0].attention.qkv.quantized
    ids = engine.tokenize_chat(MESSAGES)
    ref, _ = ref_engine.forward(ids, 0)
    got, _ = engine.forward(ids, 0)
    # bfloat16 activations and scales through 3 layers of large random weights: a few % of the range
    assert (got - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_auto_precision_picks_int4_for_q4_gguf_on_cpu(tiny_ggufs):
    assert TorchBackend(tiny_ggufs["Q4_1"], context=32).precision == "int4"
    assert TorchBackend(tiny_ggufs["F32"], context=32).precision == "float32"


def test_gguf_tokenizer_is_cached_and_identical(tiny_ggufs, tmp_path, monkeypatch):
    from specchat.backends.native import tokenizer as tk

    path = tiny_ggufs["F32"]
    first = tk.ChatTokenizer(path, tmp_path)
    assert (tk.gguf_tokenizer_dir(path, tmp_path) / "tokenizer_config.json").exists()
    second = tk.ChatTokenizer(path, tmp_path)
    text = first.render_chat(MESSAGES)
    assert text == second.render_chat(MESSAGES) and text.endswith("<|im_start|>assistant\n")
    assert first.encode(text) == second.encode(text)
    assert first.eos_ids == second.eos_ids == {first.hf.convert_tokens_to_ids("<|im_end|>")}


def _same_checkpoint(a, b) -> bool:
    def same(x, y):
        if isinstance(x, Int4Rows):
            return all(torch.equal(getattr(x, f), getattr(y, f)) for f in ("q", "scale", "zero"))
        if isinstance(x, QuantRows):
            return x.type == y.type and x.cols == y.cols and torch.equal(x.raw, y.raw)
        return torch.equal(x, y)
    return (a.cfg == b.cfg and same(a.embed, b.embed) and same(a.norm, b.norm)
            and all(la.keys() == lb.keys() and all(same(la[k], lb[k]) for k in la) for la, lb in zip(a.layers, b.layers)))


@pytest.mark.parametrize("qtype", ["F32", "Q4_1"])
def test_gguf_index_is_cached_and_loads_the_same_weights(tiny_ggufs, qtype, monkeypatch, tmp_path):
    """After the first load the metadata and tensor layout come from the cached index, without
    parsing the file's fields (the slow part for a real vocabulary)."""
    import gguf

    from specchat.backends.native import gguf_loader

    path = tiny_ggufs[qtype]
    first = load_gguf(path, keep_int4=True, cache_dir=tmp_path)
    assert gguf_loader.index_path(path, tmp_path).exists()

    def no_parsing(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_parsing)
    assert _same_checkpoint(load_gguf(path, keep_int4=True, cache_dir=tmp_path), first)


def test_a_damaged_gguf_index_is_rebuilt(tiny_ggufs, tmp_path):
    from specchat.backends.native import gguf_loader

    path = tiny_ggufs["Q8_0"]
    first = load_gguf(path, cache_dir=tmp_path)
    index = gguf_loader.index_path(path, tmp_path)
    index.write_text("{not json")
    assert _same_checkpoint(load_gguf(path, cache_dir=tmp_path), first)
    assert index.read_text().startswith('{"fields"')


def test_unsupported_or_broken_gguf_is_one_clear_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(BackendError) as e:
        load_gguf(bad)
    assert "broken.gguf" in str(e.value) and "\n" not in str(e.value)


def test_unknown_weights_are_refused_not_ignored(tiny_dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "extra"
    shutil.copytree(tiny_dirs["llama"], d)
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BackendError, match="o_proj.bias"):
        load_hf_dir(d)


@pytest.mark.parametrize("key, value", [("attention.layer_norm_rms_epsilon", float("nan")),
                                        ("attention.layer_norm_rms_epsilon", -1e-5), ("rope.freq_base", 0.0),
                                        ("rope.freq_base", "10000"), ("rope.freq_base", float("inf")),
                                        ("context_length", -4), ("context_length", 2048.5)])
def test_metadata_numbers_are_checked_like_config_json(tiny_ggufs, key, value):
    import dataclasses

    from specchat.backends.native.gguf_loader import GgufIndex, config_from_gguf

    index = GgufIndex.from_reader(gguf.GGUFReader(tiny_ggufs["Q8_0"]))
    arch = index.fields["general.architecture"]
    assert config_from_gguf(index).arch == arch  # the file as written loads
    broken = dataclasses.replace(index, fields={**index.fields, f"{arch}.{key}": value})
    with pytest.raises(BackendError) as e:
        config_from_gguf(broken, source="model.gguf")
    line = str(e.value)
    assert line.startswith(f"model.gguf: metadata `{arch}.{key}` is ") and "\n" not in line


def test_a_gguf_without_a_vocabulary_size_is_one_line(tiny_ggufs):
    import dataclasses

    from specchat.backends.native.gguf_loader import _VOCAB_COUNT, GgufIndex, config_from_gguf

    index = GgufIndex.from_reader(gguf.GGUFReader(tiny_ggufs["Q8_0"]))
    arch = index.fields["general.architecture"]
    fields = {k: v for k, v in index.fields.items() if k not in (_VOCAB_COUNT, f"{arch}.vocab_size")}
    with pytest.raises(BackendError, match="names no vocabulary size"):
        config_from_gguf(dataclasses.replace(index, fields=fields), source="model.gguf")
