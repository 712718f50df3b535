"""A checkpoint whose config is incomplete or broken is one BackendError line naming the file, the
key and what to do, from the engine and from `specchat run` (exit 2, no traceback)."""
from __future__ import annotations

import json
import shutil

import pytest

from specchat import cli
from specchat.backends.base import BackendError
from specchat.backends.native.config import ModelConfig
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.gguf_loader import GgufIndex, config_from_gguf


def _without_heads(c: dict) -> str:
    del c["num_attention_heads"]
    return json.dumps(c)


BROKEN = {  # how config.json is broken -> (its new text from the old dict, what the message must say)
    "missing key": (_without_heads, "has no `num_attention_heads`: the engine needs it to build the attention layers"),
    "wrong type": (lambda c: json.dumps(c | {"num_attention_heads": "four"}), '`num_attention_heads` is "four"'),
    "not json": (lambda c: json.dumps(c)[:-9], "is not valid JSON"),
    # float fields: Python's json writes NaN as the bare token `NaN`, which its reader (and transformers') accepts
    "eps not a number": (lambda c: json.dumps(c | {"rms_norm_eps": "1e-5"}), '`rms_norm_eps` is "1e-5", not a number'),
    "eps NaN": (lambda c: json.dumps(c | {"rms_norm_eps": float("nan")}), "`rms_norm_eps` is NaN, not a number above 0"),
    "theta negative": (lambda c: json.dumps(c | {"rope_theta": -10000.0}), "`rope_theta` is -10000.0, not a number"),
}


@pytest.fixture
def user_dir(isolated_dirs):
    folder = isolated_dirs / "user-profiles"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def broken_checkpoint(tiny_dirs, folder, how: str):
    d = folder / "dir"
    shutil.copytree(tiny_dirs["llama"], d)
    rewrite, said = BROKEN[how]
    (d / "config.json").write_text(rewrite(json.loads((d / "config.json").read_text())))
    return d, said


@pytest.mark.parametrize("how", list(BROKEN))
def test_the_engine_names_the_file_and_the_key(tiny_dirs, user_dir, how):
    d, said = broken_checkpoint(tiny_dirs, user_dir, how)
    with pytest.raises(BackendError) as e:
        TorchBackend(d, precision="float32", context=64)
    msg = str(e.value)
    assert str(d / "config.json") in msg and said in msg and "\n" not in msg
    assert "complete Hugging Face model directory" in msg


@pytest.mark.parametrize("how", list(BROKEN))
def test_specchat_run_says_it_in_one_line(tiny_dirs, user_dir, capsys, how):
    _, said = broken_checkpoint(tiny_dirs, user_dir, how)
    (user_dir / "broken.yaml").write_text("backend: torch\nmodel: ./dir\ncontext: 64\n")
    assert cli.main(["run", "-p", "broken", "hi"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "--debug" not in err
    assert err.startswith("specchat: error: ") and said in err and "config.json" in err


def test_optional_keys_keep_their_defaults_but_not_a_wrong_type():
    c = {"vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
         "intermediate_size": 32}
    cfg = ModelConfig.from_hf(c | {"num_key_value_heads": None})
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.max_position) == (2, 8, 4096)
    with pytest.raises(BackendError, match=r"x/config.json: `max_position_embeddings` is 1.5, not a whole number"):
        ModelConfig.from_hf(c | {"max_position_embeddings": 1.5}, source="x/config.json")
    with pytest.raises(BackendError, match=r"has no `vocab_size`: the engine needs it to build the embeddings"):
        ModelConfig.from_hf({k: v for k, v in c.items() if k != "vocab_size"})


def test_gguf_metadata_without_a_needed_field_names_it(tmp_path):
    fields = {"general.architecture": "llama", "llama.embedding_length": 16, "llama.block_count": 1,
              "llama.feed_forward_length": 32, "llama.vocab_size": 32}
    with pytest.raises(BackendError) as e:
        config_from_gguf(GgufIndex(fields, {}), str(tmp_path / "m.gguf"))
    msg = str(e.value)
    assert "m.gguf" in msg and "`llama.attention.head_count` is missing" in msg and "\n" not in msg
    assert config_from_gguf(GgufIndex(fields | {"llama.attention.head_count": 2}, {})).n_kv_heads == 2


BASE = {"vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}


@pytest.mark.parametrize("change, said", [
    ({"rms_norm_eps": "tiny"}, '`rms_norm_eps` is "tiny", not a number above 0'),
    ({"rms_norm_eps": 0}, "`rms_norm_eps` is 0, not a number above 0"),
    ({"rms_norm_eps": float("inf")}, "`rms_norm_eps` is Infinity"),
    ({"rms_norm_eps": True}, "`rms_norm_eps` is true"),
    ({"rope_theta": float("nan")}, "`rope_theta` is NaN"),
    ({"rope_theta": [10000]}, "`rope_theta` is [10000]"),
    ({"rope_parameters": {"rope_theta": -1}}, "`rope_theta` is -1"),
    ({"partial_rotary_factor": 1.5}, "`partial_rotary_factor` is 1.5, not a number above 0 and at most 1"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, 'rope_scaling: `factor` is "2"'),
    ({"rope_scaling": {"rope_type": "linear"}}, "`rope_scaling` (linear) has no `factor`"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not supported by the torch engine"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192}}, "high_freq_factor (1.0) is not above"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     "rope_scaling has no `original_max_position_embeddings`"),
    ({"rope_scaling": "llama3"}, '`rope_scaling` is "llama3", not an object'),
])
def test_float_fields_are_checked_like_the_others(change, said):
    with pytest.raises(BackendError) as e:
        ModelConfig.from_hf(BASE | change, source="x/config.json")
    msg = str(e.value)
    assert msg.startswith("x/config.json") and said in msg and "\n" not in msg


def test_float_fields_that_are_sound_are_read():
    cfg = ModelConfig.from_hf(BASE | {"rms_norm_eps": 1e-5, "rope_theta": 500000, "partial_rotary_factor": 0.5,
                                      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 8192}})
    assert (cfg.norm_eps, cfg.rope_theta, cfg.rotary_dim) == (1e-5, 500000.0, 4)
    assert cfg.rope_scaling["rope_type"] == "llama3"
    assert ModelConfig.from_hf(BASE | {"rms_norm_eps": None}).norm_eps == 1e-6  # null: the default
    assert ModelConfig.from_hf(BASE | {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}).rope_theta == 1e6
