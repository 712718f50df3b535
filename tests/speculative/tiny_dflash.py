"""A tiny random DFlash drafter for a tiny target, written tensor by tensor in the released layout
(config.json with block_size / num_target_layers / dflash_config, unprefixed weight names, no
embedding or LM head), independently of the code under test."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_dflash_checkpoint(out: Path, target_dir: Path, *, layers: int = 2, block_size: int = 4,
                           target_layer_ids=(0, 2), mask_token_id: int | None = None, heads: int = 4,
                           kv_heads: int = 2, head_dim: int = 16, ffn: int = 96, seed: int = 0,
                           layer_types: list[str] | None = None, sliding_window: int | None = None,
                           shards: int = 1, config_edits: dict | None = None) -> Path:
    t = json.loads((target_dir / "config.json").read_text())
    d = t["hidden_size"]
    cfg = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "block_size": block_size, "num_target_layers": t["num_hidden_layers"],
        "dflash_config": {"mask_token_id": t["vocab_size"] - 1 if mask_token_id is None else mask_token_id,
                          "target_layer_ids": list(target_layer_ids)},
        "hidden_size": d, "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 256, "vocab_size": t["vocab_size"], "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
        "layer_types": layer_types or ["full_attention"] * layers, "sliding_window": sliding_window,
    }
    cfg.update(config_edits or {})
    g = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * 0.3

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    w = {"fc.weight": mat(d, len(target_layer_ids) * d), "hidden_norm.weight": norm(d), "norm.weight": norm(d)}
    for i in range(layers):
        p = f"layers.{i}."
        w |= {p + "self_attn.q_proj.weight": mat(heads * head_dim, d),
              p + "self_attn.k_proj.weight": mat(kv_heads * head_dim, d),
              p + "self_attn.v_proj.weight": mat(kv_heads * head_dim, d),
              p + "self_attn.o_proj.weight": mat(d, heads * head_dim),
              p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
              p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
              p + "mlp.gate_proj.weight": mat(ffn, d), p + "mlp.up_proj.weight": mat(ffn, d),
              p + "mlp.down_proj.weight": mat(d, ffn)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    names = sorted(w)
    if shards == 1:
        save_file(w, str(out / "model.safetensors"))
        return out
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: w[n] for n in part}, str(out / fname))
        weight_map |= {n: fname for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out
