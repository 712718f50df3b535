"""scripts/shaped_gguf.py: the tiny shape, random weights, quantized by llama.cpp's own quantizer into
Q4_0 and Q4_K_M files that hold those types and the shape's metadata; a re-run keeps them; bad input
is refused in one line."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "shaped_gguf.py"


def _load():
    spec = importlib.util.spec_from_file_location("shaped_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


shaped = _load()


@pytest.mark.slow
def test_tiny_shape_quantized_by_llama_cpp(default_gguf, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed; the script quantizes with it")
    results = shaped.make("tiny", ["Q4_0", "Q4_K_M"], tmp_path, tokenizer_gguf=default_gguf, threads=2)
    assert [(p.name, written) for p, written in results] == [("tiny-Q4_0.gguf", True), ("tiny-Q4_K_M.gguf", True)]
    shape = shaped.SHAPES["tiny"]
    (q4_0, _), (q4_k_m, _) = results
    meta_0, types_0 = shaped.read_back(q4_0)
    meta_k, types_k = shaped.read_back(q4_k_m)
    assert types_0["Q4_0"] > 0 and "Q4_K" not in types_0
    assert types_k["Q4_K"] > 0 and "Q4_0" not in types_k
    for meta, types in ((meta_0, types_0), (meta_k, types_k)):
        assert meta["general.architecture"] == "llama"
        assert meta["llama.block_count"] == shape.layers
        assert meta["llama.embedding_length"] == shape.dim
        assert meta[shaped.SOURCE_KEY] == shaped.stamp("tiny", shape, 0)
        assert sum(types.values()) == 9 * shape.layers + 2  # token_embd, 9 a layer, output_norm (tied)
        assert types["F32"] == 2 * shape.layers + 1  # the norms stay float32
    # the F16 source is gone, no partial file is left, and a re-run keeps both files as they are
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-Q4_0.gguf", "tiny-Q4_K_M.gguf"]
    again = shaped.make("tiny", ["Q4_0", "Q4_K_M"], tmp_path, tokenizer_gguf=default_gguf, threads=2)
    assert [written for _, written in again] == [False, False]
    assert "tiny-Q4_K_M.gguf" in shaped.describe(q4_k_m) and " GB  Q4_K x " in shaped.describe(q4_k_m)


@pytest.mark.parametrize("argv, says", [
    (["--shape", "nope"], "unknown shape 'nope'"),
    (["--shape", "tiny", "--types", "Q4_0,Q3_X"], "unknown type Q3_X"),
    (["--shape", "tiny", "--layers", "0"], "--layers 0"),
])
def test_bad_input_is_refused_in_one_line(argv, says, tmp_path, capsys):
    assert shaped.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_an_unwritable_out_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert shaped.main(["--shape", "tiny", "--out", str(tmp_path / "file")]) == 2
    assert "not a directory" in capsys.readouterr().err
