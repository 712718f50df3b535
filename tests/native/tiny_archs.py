"""Tiny random checkpoints of the GGUF architectures the native engine runs beyond the Llama family
(`GGUF_ARCHS`), written by transformers' own classes, to be converted by llama.cpp's converter
(convert.py) and run against transformers on the same weights.

- qwen3moe: Qwen3-MoE as llama.cpp's `qwen3moe` takes it: routed experts in every layer (its
  converter has no dense layer), top-k weights renormalised (llama.cpp always does), q/k norms;
- gemma3: Gemma 3's text decoder: sliding-window layers (a window of 8, so that prompts outrun it)
  around a global one every 6th layer, their own RoPE base, the global layers' linear RoPE scaling,
  q/k norms, norms after attention and after the MLP, GELU-tanh MLP, the embedding scaled by
  sqrt(hidden), final logit soft-capping, zero-centred norms (the converter adds the 1).

Widths are 256 so that llama.cpp's quantizer stores K-quant blocks (tiny.make_hf_checkpoint's note).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.native.tiny import make_tokenizer

GGUF_ARCHS = ("qwen3moe", "gemma3")
WINDOW = 8


def arch_config(arch: str, vocab: int):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if arch == "qwen3moe":
        return transformers.Qwen3MoeConfig(**common, num_hidden_layers=3, intermediate_size=512, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=256, mlp_only_layers=[],
                                           norm_topk_prob=True, rope_theta=1e6, tie_word_embeddings=False)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **common, num_hidden_layers=7, intermediate_size=512, sliding_window=WINDOW, query_pre_attn_scalar=64,
            final_logit_softcapping=30.0, tie_word_embeddings=True, pad_token_id=0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    raise ValueError(arch)


def make_arch_checkpoint(out: Path, arch: str, seed: int = 0) -> Path:
    """A random `arch` model saved with save_pretrained, plus the tiny tokenizer: the embedding and
    head scaled up so that logits are far from uniform, the router so that rows choose different
    experts, the layers' matrices kept small enough that int8 activations seldom flip a row's
    experts (at 0.075 a flip in an early layer moved some logits by 3-15 and the top-1 to ~90%).
    Gemma's last state is mostly the input token's own row (multiplied by sqrt(hidden) as it
    enters), which its tied head would score highest (a reply repeating one token), so its final
    norm's 1 + w has random signs: the head then scores the row against a random reweighting."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(arch_config(arch, len(tok)), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if arch == "gemma3" and name == "model.norm.weight":
                p.copy_(torch.randn_like(p) - 1.0)
            elif "norm" in name:  # Gemma's are applied as 1 + w
                p.copy_(0.2 * torch.randn_like(p) + (0.0 if arch == "gemma3" else 1.0))
            elif "mlp.gate.weight" in name:  # router: decisive enough that rows pick different experts
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if "embed" in name or "lm_head" in name else 0.05))
    model.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return out


# llama.cpp's tensor names (per layer) -> transformers' (under model.layers.{i}.), for these archs
LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "attn_norm": "input_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate"}
ARCH_NAMES = {"qwen3moe": {"ffn_norm": "post_attention_layernorm"},
              "gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                         "post_ffw_norm": "post_feedforward_layernorm"}}


def transformers_on_gguf(hf_dir: Path, gguf_path: Path):
    """transformers' model of `hf_dir`'s config holding the GGUF's weights as gguf's own `dequantize`
    gives them (Gemma's norms less the 1 the converter added; experts stacked as transformers holds
    them): the reference for a quantized file, independent of specchat's loader."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    arch = gguf.GGUFReader(gguf_path).fields["general.architecture"].contents()
    names = LAYER_NAMES | ARCH_NAMES[arch]
    state, stacks = {}, {}
    for t in gguf.GGUFReader(gguf_path).tensors:
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1.0
        if t.name in ("token_embd.weight", "output.weight", "output_norm.weight"):
            state[{"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                   "output_norm.weight": "model.norm.weight"}[t.name]] = w
            continue
        _, i, kind, _ = t.name.split(".")
        if kind.endswith("_exps"):
            stacks.setdefault(i, {})[kind] = w
        else:
            state[f"model.layers.{i}.{names[kind]}.weight"] = w
    for i, s in stacks.items():
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([s["ffn_gate_exps"], s["ffn_up_exps"]], 1)
        state[f"model.layers.{i}.mlp.experts.down_proj"] = s["ffn_down_exps"]
    if model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    own = model.state_dict()
    assert set(state) == set(own) and all(state[k].shape == own[k].shape for k in own)
    model.load_state_dict(state)
    return model
