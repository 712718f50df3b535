"""specchat's EAGLE-3 heads, DFlash and DSpark drafters exported in the GGUF layouts llama.cpp loads: what
the file holds (read back by the gguf package), that it is what llama.cpp's own converter writes,
and one line for a drafter that does not fit."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from specchat import paths
from specchat.backends.base import BackendError
from specchat.backends.llamaserver.build import binding_version
from specchat.backends.llamaserver.drafter_export import export
from specchat.backends.llamaserver.to_gguf import permute_rows
from specchat.backends.weight_files import gguf_reader
from tests.native.tiny import make_gguf, make_hf_checkpoint
from tests.speculative.tiny_dflash import make_dflash_checkpoint
from tests.speculative.tiny_dspark import make_dspark_checkpoint
from tests.speculative.tiny_eagle3 import make_eagle3_checkpoint, raw_tensors


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    target_dir = make_hf_checkpoint(folder / "target", "llama", seed=1)
    target = make_gguf(folder / "target.gguf", target_dir)
    # the tap ids at the top level too, as specchat's trainer writes them: llama.cpp's converter reads
    # only those (a SpecForge head's nested ids it replaces by the default taps; the export reads both)
    eagle3 = make_eagle3_checkpoint(folder / "eagle3", target_dir, "specforge", taps=(1, 2, 2), draft_vocab=96,
                                    config_edits={"eagle_aux_hidden_state_layer_ids": [1, 2, 2]})
    dflash = make_dflash_checkpoint(folder / "dflash", target_dir, layers=2, block_size=5, target_layer_ids=(0, 2))
    return folder, target_dir, target, eagle3, dflash


def contents(path):
    r = gguf_reader(path)
    keys = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return keys, {t.name: t for t in r.tensors}


def values(t) -> np.ndarray:
    import gguf

    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.I64):
        return np.array(t.data)
    return gguf.quants.dequantize(t.data, t.tensor_type)


def test_an_eagle3_head_is_written_as_llama_cpps_eagle3(tiny, tmp_path):
    _, _, target, head, _ = tiny
    keys, tensors = contents(export("eagle3", head, target, tmp_path / "e.gguf"))
    raw = raw_tensors(head)
    assert keys["general.architecture"] == "eagle3"
    # specchat's taps are the inputs of target layers, as llama.cpp extracts them
    assert keys["eagle3.target_layers"] == [1, 2, 2] and keys["eagle3.target_hidden_size"] == 64
    assert keys["eagle3.block_count"] == 1 and keys["eagle3.norm_before_residual"] is False
    target_keys, _ = contents(target)
    assert keys["tokenizer.ggml.tokens"] == target_keys["tokenizer.ggml.tokens"]  # the target's own vocabulary
    assert set(tensors) == {"fc.weight", "output.weight", "output_norm.weight", "d2t"} | {
        f"blk.0.{n}.weight" for n in ("attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_output",
                                      "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
    assert tensors["output.weight"].shape.tolist() == [64, 96]  # the draft vocabulary's rows
    assert tensors["blk.0.attn_q.weight"].shape.tolist() == [128, 64]  # attention over [embedding, features]
    d2t = values(tensors["d2t"])
    assert (d2t == raw["d2t"].numpy() + np.arange(96)).all()  # absolute target ids
    q = permute_rows(raw["self_attn.q_proj.weight"].numpy(), 4)  # llama.cpp's rotary pairs
    assert np.allclose(values(tensors["blk.0.attn_q.weight"]).reshape(q.shape), q)
    assert np.allclose(values(tensors["blk.0.attn_norm_2.weight"]), raw["hidden_norm.weight"].numpy())


def test_a_dflash_drafter_is_written_as_llama_cpps_dflash(tiny, tmp_path):
    _, _, target, _, drafter = tiny
    keys, tensors = contents(export("dflash", drafter, target, tmp_path / "d.gguf"))
    config = json.loads((drafter / "config.json").read_text())
    assert keys["general.architecture"] == "dflash"
    # the released ids name layer outputs; llama.cpp taps the next layer's input
    assert keys["dflash.target_layers"] == [1, 3] and keys["dflash.block_size"] == 5
    assert keys["tokenizer.ggml.mask_token_id"] == config["dflash_config"]["mask_token_id"]
    layer = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
             "ffn_gate", "ffn_up", "ffn_down"}
    assert set(tensors) == {"fc.weight", "enc.output_norm.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(2) for n in layer}
    assert tensors["fc.weight"].shape.tolist() == [128, 64]  # two target layers fused


def test_a_dspark_drafter_is_the_dflash_file_plus_the_markov_head(tiny, tmp_path):
    from safetensors.torch import load_file

    _, target_dir, target, _, _ = tiny
    ck = make_dspark_checkpoint(tmp_path / "ds", target_dir, layers=2, block_size=5, target_layer_ids=(0, 2),
                                rank=8, confidence=True)
    keys, tensors = contents(export("dspark", ck, target, tmp_path / "d.gguf"))
    dflash_keys, dflash_tensors = contents(export("dflash", ck, target, tmp_path / "f.gguf"))
    assert keys["general.architecture"] == "dflash" and keys["dflash.block_size"] == 5
    # specchat's DSpark drafts from slot 1 as DFlash does: llama.cpp's bonus-anchor layout
    assert keys["dflash.sample_from_anchor"] is False and keys["dflash.has_confidence_head"] is True
    assert set(tensors) == set(dflash_tensors) | {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight",
                                                   "conf_proj.bias"}
    w = load_file(str(ck / "model.safetensors"))
    vocab = w["markov_head.markov_w1.weight"].shape[0]
    assert tensors["markov_w1.weight"].shape.tolist() == [8, vocab]  # ggml's {rank, n_vocab}
    assert tensors["conf_proj.weight"].shape.tolist() == [64 + 8, 1]
    np.testing.assert_allclose(values(tensors["markov_w2.weight"]).reshape(vocab, 8),
                               w["markov_head.markov_w2.weight"].numpy(), rtol=1e-3, atol=1e-3)
    bare = make_dflash_checkpoint(tmp_path / "bare", target_dir, block_size=5)
    with pytest.raises(BackendError, match="markov_head.markov_w1.weight missing"):
        export("dspark", bare, target, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


CONVERT = """
import sys
root = {root!r}
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"  # the tiny tokenizer is none it knows

def no_sentencepiece(self):
    raise FileNotFoundError("a BPE tokenizer")

base.TextModel._set_vocab_sentencepiece = no_sentencepiece
import convert_hf_to_gguf
for argv in {jobs!r}:
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()
"""


def test_the_files_are_what_llama_cpps_converter_writes(tiny, tmp_path):
    """Every metadata key and value, tensor name, shape and value as convert_hf_to_gguf.py writes
    them for the same directory (given the target as a Hugging Face directory, which it needs)."""
    folder, target_dir, target, head, drafter = tiny
    root = paths.cache_dir() / "llama-convert" / binding_version()
    if not (root / "convert_hf_to_gguf.py").exists():
        pytest.skip("llama.cpp's converter is not in the cache (tests/native/convert.py fetches it)")
    jobs = [[str(src), "--outfile", str(tmp_path / f"{kind}-conv.gguf"), "--outtype", "f32",
             "--target-model-dir", str(target_dir)] for kind, src in (("eagle3", head), ("dflash", drafter))]
    done = subprocess.run([sys.executable, "-c", CONVERT.format(root=str(root), jobs=jobs)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    for kind, src in (("eagle3", head), ("dflash", drafter)):
        want_keys, want = contents(tmp_path / f"{kind}-conv.gguf")
        got_keys, got = contents(export(kind, src, target, tmp_path / f"{kind}.gguf"))
        model_keys = {k for k in want_keys if k.startswith(f"{kind}.")} | {"tokenizer.ggml.mask_token_id"}
        assert {k: got_keys.get(k) for k in model_keys} == {k: want_keys.get(k) for k in model_keys}
        assert set(got) == set(want)
        for name, t in want.items():
            assert got[name].shape.tolist() == t.shape.tolist(), name
            assert np.allclose(values(got[name]), values(t)), name


def test_a_drafter_for_another_target_is_one_line(tiny, tmp_path):
    folder, target_dir, target, _, _ = tiny
    other = make_eagle3_checkpoint(tmp_path / "e", target_dir, "specforge", taps=(1, 2, 2),
                                   config_edits={"vocab_size": 999})
    with pytest.raises(BackendError, match="vocabulary"):
        export("eagle3", other, target, tmp_path / "x.gguf")
    wide = make_dflash_checkpoint(tmp_path / "d", target_dir, target_layer_ids=(0, 7))
    with pytest.raises(BackendError, match="not a drafter for this target"):
        export("dflash", wide, target, tmp_path / "x.gguf")
    with pytest.raises(BackendError, match="not 'mtp'"):
        export("mtp", wide, target, tmp_path / "x.gguf")
    assert not list(tmp_path.glob("x.gguf*"))  # nothing half-written


def test_train_export_gguf_writes_the_file_or_says_why_not(tiny, isolated_dirs, capsys):
    from specchat import cli

    _, _, target, head, _ = tiny
    profiles = isolated_dirs / "user-profiles"
    profiles.mkdir()
    (profiles / "tiny.yaml").write_text(f"model: {target}\n")
    out = isolated_dirs / "head.gguf"
    assert cli.main(["train", "export-gguf", str(head), "--target", "tiny", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)  # the method read from config.json
    assert contents(out)[0]["general.architecture"] == "eagle3"
    mtp = isolated_dirs / "mtp"
    mtp.mkdir()
    (mtp / "config.json").write_text(json.dumps({"architectures": ["SpecchatMTPHead"], "specchat_mtp": {}}))
    assert cli.main(["train", "export-gguf", str(mtp), "--target", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "llama.cpp has no file layout for" in err and len(err.strip().splitlines()) == 1


def test_mtp_without_a_file_needs_mtp_layers_in_the_target(tiny, isolated_dirs):
    from specchat.profiles import get_profile
    from specchat.server_drafters import server_drafter

    _, _, target, _, _ = tiny
    profiles = isolated_dirs / "user-profiles"
    profiles.mkdir()
    (profiles / "m.yaml").write_text(f"backend: llamaserver\nmodel: {target}\nspeculative: {{method: mtp}}\n")
    with pytest.raises(BackendError, match=r"target's own MTP \(nextn\) layers, and target.gguf \(llama\) has none"):
        server_drafter(get_profile("m"))


def test_a_profiles_drafter_directory_is_exported_once_into_the_cache(tiny, isolated_dirs, monkeypatch):
    from specchat.profiles import get_profile
    from specchat.server_drafters import server_drafter

    _, _, target, head, drafter = tiny
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(isolated_dirs / "cache"))
    profiles = isolated_dirs / "user-profiles"
    profiles.mkdir()
    for method, path in (("eagle3", head), ("dflash", drafter)):
        (profiles / f"{method}.yaml").write_text(f"backend: llamaserver\nmodel: {target}\n"
                                                 f"speculative: {{method: {method}, drafter: {path}}}\n")
        first = server_drafter(get_profile(method))
        assert first.parent == isolated_dirs / "cache" / f"{method}-gguf" and first.suffix == ".gguf"
        written = first.stat().st_mtime_ns
        assert server_drafter(get_profile(method)) == first and first.stat().st_mtime_ns == written  # reused
        assert contents(first)[0]["general.architecture"] == method
