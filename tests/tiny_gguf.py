"""Write tiny random-weight llama-architecture GGUF files with a working byte-level tokenizer
and a ChatML chat template, for fast tests of the GGUF paths (llama.cpp and the torch engine)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r", "a n"]  # a few, so the BPE tokenizer is complete


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode map: one printable character per byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The Q/K row permutation llama.cpp's converter applies (HF rotate-half -> interleaved rope)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_llama_tensors(n_layer=2, dim=64, n_head=4, n_kv=2, ffn=128, vocab=259, tied=True, seed=0) -> dict:
    """HF-named float32 weights of a tiny llama (HF layout: rotate-half rope)."""
    rng = np.random.default_rng(seed)
    hd = dim // n_head

    def w(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"model.embed_tokens.weight": w(vocab, dim, scale=0.05), "model.norm.weight": 1 + w(dim, scale=0.1)}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + w(dim, scale=0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + w(dim, scale=0.1)
        t[p + "self_attn.q_proj.weight"] = w(n_head * hd, dim)
        t[p + "self_attn.k_proj.weight"] = w(n_kv * hd, dim)
        t[p + "self_attn.v_proj.weight"] = w(n_kv * hd, dim)
        t[p + "self_attn.o_proj.weight"] = w(dim, n_head * hd)
        t[p + "mlp.gate_proj.weight"] = w(ffn, dim)
        t[p + "mlp.up_proj.weight"] = w(ffn, dim)
        t[p + "mlp.down_proj.weight"] = w(dim, ffn)
    if not tied:
        t["lm_head.weight"] = w(vocab, dim, scale=0.05)
    return t


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(path: Path, n_layer=2, dim=64, n_head=4, n_kv=2, ffn=128, tied=True, seed=0,
                    quant: str = "F32", rope_theta=10000.0, context=512) -> Path:
    """A tiny llama GGUF; `quant` is F32, F16, Q8_0 or Q4_1 for the 2-D matrices."""
    import gguf

    tokens = _byte_tokens() + [m.replace(" ", "") for m in MERGES] + SPECIALS
    vocab = len(tokens)
    hf = random_llama_tensors(n_layer, dim, n_head, n_kv, ffn, vocab, tied, seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(context)
    w.add_embedding_length(dim)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(dim // n_head)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * (vocab - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_pad_token_id(vocab - 3)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    qtype = getattr(gguf.GGMLQuantizationType, quant)

    def add(name: str, arr: np.ndarray, quantize: bool):
        if quantize and qtype != gguf.GGMLQuantizationType.F32:
            if qtype == gguf.GGMLQuantizationType.F16:
                w.add_tensor(name, arr.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)

    add("token_embd.weight", hf["model.embed_tokens.weight"], True)
    add("output_norm.weight", hf["model.norm.weight"], False)
    if not tied:
        add("output.weight", hf["lm_head.weight"], True)
    for i in range(n_layer):
        for hf_name, g_name in _GGUF_NAMES.items():
            suffix = ".weight"
            arr = hf[f"model.layers.{i}.{hf_name}{suffix}"]
            if hf_name == "self_attn.q_proj":
                arr = llama_permute(arr, n_head)
            elif hf_name == "self_attn.k_proj":
                arr = llama_permute(arr, n_kv)
            add(f"blk.{i}.{g_name}.weight", arr, arr.ndim == 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
