"""Random-weight models of real shapes, built directly on the device, for the speed part.

A shape is a transformers config (no weights are downloaded: the machine has no network).
transformers builds and initialises the model on the device; the engine gets the very same
tensors through its own constructor (`engine_on`), so both run identical weights and the
comparison is of code, not of numbers.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Shapes from each model's published config.json; `context` is the KV cache the shipped profile
# for that model size asks for (profiles/qwen3-8b-dflash.yaml, profiles/smollm2.yaml) or, for
# the CPU run's small shape, enough for its prompt and reply.
SHAPES = {
    "qwen3-8b": dict(arch="qwen3", context=4096, config=dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False)),
    "smollm2-135m": dict(arch="llama", context=4096, config=dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=True)),
    "cpu-small": dict(arch="llama", context=256, config=dict(
        vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=2048, tie_word_embeddings=True)),
}


@dataclass
class RandomModel:
    name: str
    hf: torch.nn.Module  # transformers' model, in the compute dtype, on the device
    tokenizer_dir: Path  # a tokenizer with one token per vocabulary row and a chat template
    context: int
    parameters: int = field(init=False)

    def __post_init__(self):
        self.parameters = sum(p.numel() for p in self.hf.parameters())


def build(name: str, device: torch.device, dtype: torch.dtype, workdir: Path) -> RandomModel:
    from transformers import LlamaConfig, Qwen3Config, AutoModelForCausalLM

    shape = SHAPES[name]
    config = (Qwen3Config if shape["arch"] == "qwen3" else LlamaConfig)(**shape["config"], bos_token_id=0,
                                                                         eos_token_id=1)
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return RandomModel(name, hf, vocabulary_tokenizer(workdir / f"{name}-tokenizer", config.vocab_size),
                       shape["context"])


def vocabulary_tokenizer(out: Path, vocab: int) -> Path:
    """A word-level tokenizer with exactly `vocab` ids (so every id the random model emits
    detokenizes) and tests/native/tiny.py's ChatML template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.native.tiny import CHATML

    words = {"<|im_start|>": 0, "<|im_end|>": 1} | {f"w{i}": i for i in range(2, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<|im_end|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|im_end|>", pad_token="<|im_end|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    return out


def checkpoint_of(hf: torch.nn.Module):
    """The engine's `Checkpoint` holding transformers' own tensors (no copies: on the device already)."""
    from specchat.backends.native.config import ModelConfig
    from specchat.backends.native.weights import Checkpoint, hf_layer

    sd = dict(hf.state_dict())
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    layers = [hf_layer(sd, f"model.layers.{i}.") for i in range(cfg.n_layers)]
    head = None if cfg.tie_embeddings else sd["lm_head.weight"]
    return Checkpoint(cfg, sd["model.embed_tokens.weight"], sd["model.norm.weight"], head, layers, source="random")


@contextmanager
def weights_in_memory(model: RandomModel):
    """While open, a TorchBackend made on `model.tokenizer_dir` gets `model`'s weights instead of
    reading files: its own constructor still chooses the precision, builds the model on the
    device, sets up static shapes or compiled graphs and loads the tokenizer. (Writing 16 GB of
    safetensors to read them back would cost more of the device's minutes than the measurement.)"""
    from specchat.backends.native import built_models

    original = built_models.load_checkpoint
    built_models.load_checkpoint = lambda path, kind, **options: checkpoint_of(model.hf)  # options: the engine's own
    try:
        yield
    finally:
        built_models.load_checkpoint = original


def engine_on(model: RandomModel, **settings):
    """A TorchBackend of `model`'s weights; `settings`: its keyword arguments (device, precision...)."""
    from specchat.backends.native.engine import TorchBackend

    with weights_in_memory(model):
        engine = TorchBackend(model.tokenizer_dir, "hf_dir", context=model.context, **settings)
    engine.eos_ids = frozenset()  # forced-length replies (as scripts/bench_engine.py)
    return engine
