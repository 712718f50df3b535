"""A specchat draft model (a Hugging Face Llama directory, as `specchat train draft` writes it) as a
GGUF file llama-server can load with `-md`.

The tensors are laid out as llama.cpp's own converter (convert_hf_to_gguf.py) lays out a Llama:
its names, Q and K rows permuted for llama.cpp's rotary layout, matrices in Q8_0. The tokenizer
is copied from the target's GGUF, key for key: the drafter was trained on the target's tokenizer,
and llama-server accepts a draft model only when its vocabulary is the target's.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..base import BackendError
from ..weight_files import gguf_reader, load_safetensors

TENSOR_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rotary halves -> llama.cpp's interleaved pairs, per head (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_llama_hparams(w, cfg: dict) -> None:
    """A Hugging Face Llama config's hyperparameters as llama.cpp's `llama.*` keys."""
    n_head = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)}
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])


def copy_tokenizer(w, target) -> None:
    """The target GGUF's tokenizer, key for key: llama-server takes a drafter only when its
    vocabulary is the target's."""
    import gguf

    for key, field in target.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)


def draft_model_to_gguf(hf_dir: Path, target_gguf: Path, dest: Path) -> Path:
    import gguf

    hf_dir, dest = Path(hf_dir), Path(dest)
    try:
        cfg = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise BackendError(f"{hf_dir}: no readable config.json ({e})") from None
    if cfg.get("model_type") != "llama":
        raise BackendError(f"{hf_dir}: a {cfg.get('model_type')!r} model; only Llama draft models convert to GGUF here")
    weights = sorted(hf_dir.glob("*.safetensors"))
    if len(weights) != 1:
        raise BackendError(f"{hf_dir}: expected one model.safetensors, found {len(weights)}")
    target = gguf_reader(target_gguf)
    target_vocab = len(target.fields["tokenizer.ggml.tokens"].data)
    if cfg["vocab_size"] != target_vocab:
        raise BackendError(f"{hf_dir}: vocabulary of {cfg['vocab_size']} tokens, the target's has {target_vocab}: "
                           "not a drafter for this target")
    sd = {k: v.float().numpy() for k, v in load_safetensors(weights[0]).items()}  # bfloat16 needs torch's loader
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(part), "llama")
    w.add_name(f"specchat draft model ({hf_dir.name})")
    add_llama_hparams(w, cfg)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    copy_tokenizer(w, target)

    q8 = gguf.GGMLQuantizationType.Q8_0

    def matrix(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a), q8), raw_dtype=q8)

    matrix("token_embd.weight", sd["model.embed_tokens.weight"])
    if not cfg.get("tie_word_embeddings", False):
        matrix("output.weight", sd["lm_head.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gg_name in TENSOR_NAMES.items():
            a = sd[f"model.layers.{i}.{hf_name}.weight"]
            if gg_name.endswith("norm"):
                w.add_tensor(f"blk.{i}.{gg_name}.weight", a)
                continue
            if gg_name in ("attn_q", "attn_k"):
                a = permute_rows(a, n_head if gg_name == "attn_q" else n_kv)
            matrix(f"blk.{i}.{gg_name}.weight", a)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    os.replace(part, dest)
    return dest

