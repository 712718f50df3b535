"""Tiny random mixture-of-experts checkpoints, written by transformers' own classes.

Families (`MOE_FAMILIES`), each with a few experts, top-2, and the feature its real models have:
- qwen3_moe: Qwen3-MoE, no shared expert, top-k weights not renormalised, a dense first layer
  (`mlp_only_layers`);
- glm4_moe: GLM-4.5, sigmoid router with a (random) correction bias, 2 groups of which 1 is kept,
  routed scaling 2.5, one shared expert, a dense first layer (`first_k_dense_replace`), q/k/v
  biases, q/k norms and half-rotary heads;
- qwen3_5_moe: the Qwen3.5-MoE hybrid (Gated DeltaNet and gated attention), experts in every
  layer, a gated shared expert;
- qwen3_next: the Qwen3-Next hybrid with experts after a dense first layer, renormalised.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.native.tiny import make_tokenizer

MOE_FAMILIES = ("qwen3_moe", "glm4_moe", "qwen3_5_moe", "qwen3_next")
HYBRID_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def moe_config(family: str, vocab: int):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  moe_intermediate_size=32, num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    hybrid = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4, num_hidden_layers=4, layer_types=HYBRID_TYPES,
                  shared_expert_intermediate_size=32, num_experts=4)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_hidden_layers=3, intermediate_size=64, num_experts=4,
                                           mlp_only_layers=[0], norm_topk_prob=False, rope_theta=1e6)
    if family == "glm4_moe":
        return transformers.Glm4MoeConfig(**common, num_hidden_layers=3, intermediate_size=64, n_routed_experts=8,
                                          n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                                          routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
                                          use_qk_norm=True, num_nextn_predict_layers=0)
    if family == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(**common, **hybrid)
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(**common, **hybrid, intermediate_size=64, mlp_only_layers=[0],
                                            norm_topk_prob=True)
    raise ValueError(family)


def make_moe_checkpoint(out: Path, family: str, seed: int = 0) -> Path:
    """A random `family` model (transformers' class) saved with save_pretrained, plus the tokenizer.
    Weights are scaled up so that logits are far from uniform and rows choose different experts."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(family, len(tok)), dtype=torch.float32)
    zero_centred = family in ("qwen3_5_moe", "qwen3_next")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:  # the gated norm is applied as w
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p) + (0.0 if zero_centred else 1.0))
            elif "mlp.gate.weight" in name:  # router: decisive enough that rows pick different experts
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if "embed" in name else 0.15))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.rand_like(b))
    model.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return out


def fuse_experts(src: Path, out: Path) -> Path:
    """The checkpoint in `src` with each layer's per-expert tensors fused as transformers holds them:
    `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(src / "model.safetensors"))
    fused, experts = {}, {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight", name)
        if m is None:
            fused[name] = t
        else:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        fused[prefix + "gate_up_proj"] = torch.stack([torch.cat([by_expert[e]["gate"], by_expert[e]["up"]])
                                                      for e in order])
        fused[prefix + "down_proj"] = torch.stack([by_expert[e]["down"] for e in order])
    save_file({k: v.contiguous() for k, v in fused.items()}, str(out / "model.safetensors"))
    return out


def add_moe_mtp_head(ckpt: Path, layout: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random MTP layer in `layout` ("deepseek": GLM-4.5's `model.layers.{N}`, "qwen3_next": `mtp.*`)
    whose decoder layer is a copy, in names and shapes, of the checkpoint's last layer that is
    full attention with routed experts; written to mtp.safetensors and declared in config.json."""
    from safetensors.torch import load_file, save_file

    from tests.native.tiny import mtp_tensor_names

    cfg = json.loads((ckpt / "config.json").read_text())
    main = load_file(str(ckpt / "model.safetensors"))
    n, d = cfg["num_hidden_layers"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    names = mtp_tensor_names(layout, n)
    zero_centred = layout == "qwen3_next"

    def norm(shape):
        w = 0.2 * torch.randn(shape, generator=g)
        return w if zero_centred else 1.0 + w

    src = next(f"model.layers.{i}." for i in reversed(range(n))
               if f"model.layers.{i}.self_attn.q_proj.weight" in main and f"model.layers.{i}.mlp.gate.weight" in main)
    out: dict[str, torch.Tensor] = {}
    for name, t in main.items():
        if name.startswith(src):
            key = names["layer"] + name[len(src):]
            if "norm" in name:
                out[key] = norm(t.shape)
            elif name.endswith("e_score_correction_bias"):
                out[key] = 0.3 * torch.rand(t.shape, generator=g)
            else:
                out[key] = (0.5 if "mlp.gate.weight" in name else 0.15) * torch.randn(t.shape, generator=g)
    out[names["embed_norm"]], out[names["hidden_norm"]] = norm((d,)), norm((d,))
    out[names["final_norm"]] = norm((d,))
    out[names["proj"]] = 0.1 * torch.randn((d, 2 * d), generator=g)
    if layout == "deepseek":  # GLM-4.5 stores the shared embedding and head in the MTP layer too
        p = names["layer"]
        out[p + "embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
        out[p + "shared_head.head.weight"] = main["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in out.items()}, str(ckpt / "mtp.safetensors"))
    cfg["mtp_num_hidden_layers" if layout == "qwen3_next" else "num_nextn_predict_layers"] = 1
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=1))
    return out
