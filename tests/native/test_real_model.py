"""The engine on the real default model (SmolLM2-135M-Instruct, GGUF Q4_1)."""
from __future__ import annotations

import pytest
import torch

from specchat.backends.base import STOP_EOS, Request, Sampling, run_to_summary
from specchat.backends.hf_reference import load_hf_model
from specchat.backends.native.engine import TorchBackend
from specchat.paths import cache_dir

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def fp32_engine(real_gguf):
    return TorchBackend(real_gguf, precision="float32", context=512, cache_dir=cache_dir())


def test_chat_template_renders_smollm2_chatml(fp32_engine):
    ids = fp32_engine.tokenize_chat(QUESTION)
    text = fp32_engine.tokenizer.hf.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert ids.count(fp32_engine.tokenizer.hf.convert_tokens_to_ids("<|im_start|>")) == 3  # no extra BOS
    assert fp32_engine.eos_ids == {2}  # <|im_end|>


def test_logits_match_transformers_on_dequantized_weights(fp32_engine, real_gguf):
    hf = load_hf_model(real_gguf)
    ids = fp32_engine.tokenize_chat(QUESTION)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    fp32_engine.truncate(0)
    logits, _ = fp32_engine.forward(ids, 0)
    assert (logits - ref).abs().max().item() < 2e-3  # logits are O(30); 30 layers of float32
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("precision", ["float32", "int4"])
def test_greedy_reply_is_sensible(real_gguf, fp32_engine, precision):
    engine = fp32_engine if precision == "float32" else TorchBackend(real_gguf, precision=precision, context=512, cache_dir=cache_dir())
    summary = run_to_summary(engine.stream(Request(messages=QUESTION), Sampling(max_tokens=40)))
    assert summary.stop_reason == STOP_EOS
    assert "Paris" in summary.text


def test_int4_verify_block_is_bitwise_a_decode_pass(real_gguf):
    engine = TorchBackend(real_gguf, precision="int4", context=256, cache_dir=cache_dir())
    assert engine.row_exact_supported
    ids = engine.tokenize_chat(QUESTION)
    engine.forward(ids, 0)
    block = [504, 3458, 282, 4649, 314, 216]
    logits, _ = engine.forward(block, len(ids), row_exact=True)
    engine.truncate(len(ids))
    singles = torch.cat([engine.forward([t], len(ids) + i)[0] for i, t in enumerate(block)])
    assert torch.equal(logits, singles)


def test_int4_long_verify_blocks_are_bitwise_decode_passes(real_gguf):
    """Blocks of 2..24 rows (copy runs verify up to 65) over real text, placed across attention-pad
    boundaries so that their rows split into groups of every size: each row equals its
    single-token pass bit for bit (a group of 11 rows once did not; see model.attend_rows)."""
    engine = TorchBackend(real_gguf, precision="int4", context=512, cache_dir=cache_dir())
    text = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
            "one hundred and twelve steps as his father had taught him, and lit the lamp that warned "
            "the fishing boats away from the rocks. ") * 5
    ids = engine.tokenize_chat([{"role": "user", "content": text}])
    assert len(ids) > 200
    for start in (100, 120, 127, 150, 180):
        engine.truncate(0)
        engine.forward(ids[:start], 0)
        singles = torch.cat([engine.forward([t], start + i, head=False)[0] for i, t in enumerate(ids[start:start + 24])])
        for k in range(2, 25):
            block, _ = engine.forward(ids[start:start + k], start, row_exact=True, head=False)
            bad = [i for i in range(k) if not torch.equal(block[i], singles[i])]
            assert not bad, (start, k, bad)
