"""A specchat draft model converted for llama-server computes what the original computes."""
from __future__ import annotations

import json

import pytest

from specchat.backends.base import BackendError, Request, Sampling, run_to_summary
from specchat.backends.llamacpp import LlamaCppBackend
from specchat.backends.llamaserver.to_gguf import draft_model_to_gguf
from specchat.backends.native.engine import TorchBackend
from tests.native.tiny import make_gguf, make_hf_checkpoint

PROMPT = [3, 7, 11, 5, 9, 2, 14]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("convert")
    target = make_gguf(folder / "target.gguf", make_hf_checkpoint(folder / "target", "llama", seed=1))
    return target, make_hf_checkpoint(folder / "drafter", "llama", seed=2)


def test_the_converted_drafter_decodes_as_the_original(pair, tmp_path):
    target, drafter = pair
    converted = draft_model_to_gguf(drafter, target, tmp_path / "drafter.gguf")
    want = run_to_summary(TorchBackend(drafter, "hf_dir", context=64).stream(Request(prompt_ids=PROMPT),
                                                                            Sampling(max_tokens=12)))
    # llama.cpp itself (its Q8_0 matrices) and specchat's GGUF loader (undoing the Q/K permutation)
    by_llama_cpp = LlamaCppBackend(converted, context=64, threads=1)
    try:
        got = run_to_summary(by_llama_cpp.stream(Request(prompt_ids=PROMPT), Sampling(max_tokens=12)))
    finally:
        by_llama_cpp.close()
    again = run_to_summary(TorchBackend(converted, "gguf", context=64).stream(Request(prompt_ids=PROMPT),
                                                                              Sampling(max_tokens=12)))
    assert got.token_ids == want.token_ids == again.token_ids


def test_a_drafter_that_does_not_fit_is_one_line(pair, tmp_path):
    target, drafter = pair
    config = json.loads((drafter / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    (other / "model.safetensors").write_bytes((drafter / "model.safetensors").read_bytes())
    with pytest.raises(BackendError, match="not a drafter for this target"):
        draft_model_to_gguf(other, target, tmp_path / "x.gguf")
    (other / "config.json").write_text(json.dumps({**config, "model_type": "qwen3"}))
    with pytest.raises(BackendError, match="only Llama draft models"):
        draft_model_to_gguf(other, target, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
