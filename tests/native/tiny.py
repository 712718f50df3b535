"""Tiny random-weight checkpoints for engine tests, written with transformers' and gguf's own writers.

- `make_tokenizer(dir)`: a small byte-level BPE tokenizer with a ChatML template.
- `make_hf_checkpoint(dir, layout)`: a transformers model (llama / llama3-rope / qwen2 / qwen3)
  saved with `save_pretrained`, plus the tokenizer.
- `make_gguf(path, hf_dir, qtype)`: the same weights as a llama-arch GGUF, Q/K rows permuted the
  way llama.cpp's converter does, matrices stored as F32 / Q8_0 / Q4_1, tokenizer metadata included.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from specchat.backends.llamaserver.to_gguf import add_llama_hparams, permute_rows

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
          "speculative decoding is lossless when verified", "user assistant system: numbers 0123456789",
          "Paris is the capital of France. Berlin is the capital of Germany."] * 4
VOCAB = 320


def make_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(out))
    return fast


def hf_config(layout: str, vocab: int, hidden: int = 64, ffn: int = 128):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if layout == "llama":
        return LlamaConfig(**common, rope_theta=100000.0, tie_word_embeddings=True)
    if layout == "llama3":
        return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if layout == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
    if layout == "qwen3":
        return Qwen3Config(**common, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False)
    raise ValueError(layout)


LAYOUTS = ("llama", "llama3", "qwen2", "qwen3")
# hybrids: Gated DeltaNet layers between gated full-attention layers (layers 1 and 3 attention)
HYBRIDS = ("qwen3_5", "qwen3_next")


def hybrid_config(family: str, vocab: int, layer_types=None):
    """Shapes small but with every feature: grouped value heads (2 per key head), a 4-tap conv,
    partial rotary (a quarter of each head), gated attention, zero-centred norms; widths chosen
    as multiples of 32 so that no elementwise op gives a row a scalar tail."""
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False, layer_types=layer_types or
                  ["linear_attention", "full_attention", "linear_attention", "full_attention"])
    if family == "qwen3_5":
        return Qwen3_5TextConfig(**common)
    if family == "qwen3_next":  # its dense form: every layer an MLP-only layer
        return Qwen3NextConfig(**common, mlp_only_layers=[0, 1, 2, 3], num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32)
    raise ValueError(family)


def make_hybrid_checkpoint(out: Path, family: str = "qwen3_5", seed: int = 0, layer_types=None) -> Path:
    """A random hybrid model (transformers' own class), saved as safetensors with the tokenizer."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hybrid_config(family, len(tok), layer_types), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:  # the gated norm is applied as w
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:  # zero-centred: applied as 1 + w
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if "embed" in name else 0.15))
    model.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return out


def make_hf_checkpoint(out: Path, layout: str, seed: int = 0, hidden: int = 64, ffn: int = 128) -> Path:
    """A random model whose logits are far from uniform (weights scaled up), saved as safetensors;
    `hidden` and `ffn` of 256 and more (multiples of 256) let llama.cpp store K-quant blocks."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    cfg = hf_config(layout, len(tok), hidden, ffn)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                # at the default width 0.15; wider layers scaled down to keep the activations' size
                p.copy_(torch.randn_like(p) * (0.3 if "embed" in name else 0.15 * (64 / hidden) ** 0.5))
    model.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return out


def make_gguf(path: Path, hf_dir: Path, qtype: str = "F32") -> Path:
    """The llama (tied) checkpoint in hf_dir as a llama-arch GGUF; matrices stored as qtype."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_hparams(w, cfg)
    # tokenizer metadata, as llama.cpp writes it for a GPT-2 style BPE
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_chat_template(CHATML)

    qt = getattr(gguf.GGMLQuantizationType, qtype)

    def put(name: str, a: np.ndarray, matrix: bool):
        a = np.ascontiguousarray(a, dtype=np.float32)
        if matrix and qt != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, a)

    # embeddings stay Q8_0 when quantizing, as in the SmolLM2 GGUF
    emb_q = gguf.GGMLQuantizationType.Q8_0 if qtype != "F32" else gguf.GGMLQuantizationType.F32
    emb = sd["model.embed_tokens.weight"]
    if emb_q == gguf.GGMLQuantizationType.F32:
        w.add_tensor("token_embd.weight", emb)
    else:
        w.add_tensor("token_embd.weight", gguf.quants.quantize(emb, emb_q), raw_dtype=emb_q)
    put("output_norm.weight", sd["model.norm.weight"], False)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], False)
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], False)
        for hf_name, gg_name in names.items():
            a = sd[p + hf_name + ".weight"]
            if gg_name == "attn_q":
                a = permute_rows(a, n_head)
            elif gg_name == "attn_k":
                a = permute_rows(a, n_kv)
            put(f"blk.{i}.{gg_name}.weight", a, True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


MTP_LAYOUT_FAMILY = {"deepseek": "llama", "qwen3_next": "qwen3", "mimo": "qwen2"}


def mtp_tensor_names(layout: str, n_layers: int, i: int = 0) -> dict[str, str]:
    """role -> tensor name of MTP layer i, written out per layout (independently of the loader)."""
    if layout == "deepseek":
        p = f"model.layers.{n_layers + i}."
        return {"embed_norm": p + "enorm.weight", "hidden_norm": p + "hnorm.weight", "proj": p + "eh_proj.weight",
                "final_norm": p + "shared_head.norm.weight", "layer": p}
    if layout == "qwen3_next":
        return {"embed_norm": "mtp.pre_fc_norm_embedding.weight", "hidden_norm": "mtp.pre_fc_norm_hidden.weight",
                "proj": "mtp.fc.weight", "final_norm": "mtp.norm.weight", "layer": f"mtp.layers.{i}."}
    p = f"model.mtp_layers.{i}."
    return {"embed_norm": p + "token_layernorm.weight", "hidden_norm": p + "hidden_layernorm.weight",
            "proj": p + "input_proj.weight", "final_norm": p + "final_layernorm.weight", "layer": p}


def add_mtp_head(ckpt: Path, layout: str, seed: int = 0, extra: dict | None = None) -> dict[str, torch.Tensor]:
    """Write a random MTP layer in `layout` next to the checkpoint's weights (mtp.safetensors) and
    declare it in config.json, as the public checkpoints do. The decoder layer copies the main
    layers' names and shapes. Returns the tensors written (norms as stored: zero-centred for
    qwen3_next)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((ckpt / "config.json").read_text())
    main = load_file(str(ckpt / "model.safetensors"))
    n = cfg["num_hidden_layers"]
    d = cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    names = mtp_tensor_names(layout, n)
    out: dict[str, torch.Tensor] = {}

    def norm(shape):
        w = 0.2 * torch.randn(shape, generator=g)
        return w if layout == "qwen3_next" else 1.0 + w  # zero-centred: stored w, applied as 1 + w

    # the decoder layer inside copies the first attention layer's names and shapes
    first = min(int(k.split(".")[2]) for k in main if k.startswith("model.layers.") and ".self_attn.q_proj" in k)
    src = f"model.layers.{first}."
    for name, t in main.items():
        if name.startswith(src):
            key = names["layer"] + name[len(src):]
            out[key] = norm(t.shape) if "norm" in name else 0.15 * torch.randn(t.shape, generator=g)
    out[names["embed_norm"]], out[names["hidden_norm"]] = norm((d,)), norm((d,))
    out[names["final_norm"]] = norm((d,))
    out[names["proj"]] = 0.1 * torch.randn((d, 2 * d), generator=g)
    out.update(extra or {})
    save_file({k: v.contiguous() for k, v in out.items()}, str(ckpt / "mtp.safetensors"))
    cfg["mtp_num_hidden_layers" if layout == "qwen3_next" else "num_nextn_predict_layers"] = 1
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def perturbed_copy(src: Path, out: Path, scale: float = 0.03, seed: int = 0) -> Path:
    """The checkpoint in `src` with small noise on every weight: a draft model that agrees with it
    often but not always (random models agree with nothing else)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v + scale * torch.randn(v.shape, generator=g) for k, v in tensors.items()},
              str(out / "model.safetensors"))
    return out


def assert_reply_and_logits_match(e, ref, max_tokens: int, atol: float) -> None:
    """The engine's greedy reply streamed to a fixed prompt is transformers' greedy reply, and every
    logit of it (prefill, then one-token decode) is `ref`'s within atol."""
    from specchat.backends.base import Request, Sampling, run_to_summary

    request = Request(messages=[{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}])
    prompt = e.prompt_ids(request)
    reply = run_to_summary(e.stream(request, Sampling(max_tokens=max_tokens)))
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                eos_token_id=sorted(e.eos_ids), pad_token_id=0)[0, len(prompt):].tolist()
    assert reply.token_ids == expected[:len(reply.token_ids)] and len(reply.token_ids) >= 10
    ids = prompt + reply.token_ids
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    e.truncate(0)
    got = [e.forward(ids[:len(prompt)], 0)[0]]
    got += [e.forward([t], len(prompt) + i)[0] for i, t in enumerate(reply.token_ids)]
    assert (torch.cat(got) - want).abs().max() < atol


def quantize_with_llamacpp(src: Path, out: Path, ftype: str) -> Path:
    """src (a GGUF) quantized by llama.cpp's own quantizer into `ftype` (Q4_K_M, Q6_K, Q8_0, ...)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype}")
    return out
