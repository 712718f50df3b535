"""Tiny random EAGLE-3 heads for a tiny target, written tensor by tensor in each public layout,
and a plain reference of the head's math over a whole sequence, independent of the code under test.

Layouts (../shared/reference/hybrid-moe-eagle3.md, section 4):
- eagle:       the original release: pytorch_model.bin, `midlayer.*`, a Llama config plus draft_vocab_size
- specforge:   LlamaForCausalLMEagle3, model.safetensors, `midlayer.*`, eagle_config.eagle_aux_hidden_state_layer_ids
               naming layer outputs (tap - 1; top-level ids, vLLM's convention, where a tap is 0)
- vllm:        Eagle3LlamaForCausalLM (AngelSlim's checkpoints): `midlayer.*`, ids as SpecForge's
- speculators: Eagle3Speculator, `layers.0.*`, the layer's config in transformer_layer_config
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

FORMATS = ("eagle", "specforge", "vllm", "speculators")


def make_eagle3_checkpoint(out: Path, target_dir: Path, fmt: str = "specforge", *, taps=(0, 1, 2),
                           draft_vocab: int | None = 96, heads: int = 4, kv_heads: int = 2, ffn: int = 96,
                           seed: int = 0, norm_before_residual: bool = False, with_embed: bool = False,
                           tap_norms: str | None = None, norm_output: bool = False,
                           config_edits: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """tap_norms: "norm_before_fc" (one norm over the taps' concatenation) or "fc_norm" (one per tap)."""
    out.mkdir(parents=True, exist_ok=True)
    t = json.loads((target_dir / "config.json").read_text())
    d, vocab = t["hidden_size"], t["vocab_size"]
    hd = d // heads
    g = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    n_draft = draft_vocab or vocab
    layer = {"self_attn.q_proj.weight": mat(heads * hd, 2 * d), "self_attn.k_proj.weight": mat(kv_heads * hd, 2 * d),
             "self_attn.v_proj.weight": mat(kv_heads * hd, 2 * d), "self_attn.o_proj.weight": mat(d, heads * hd),
             "input_layernorm.weight": norm(d), "hidden_norm.weight": norm(d),
             "post_attention_layernorm.weight": norm(d), "mlp.gate_proj.weight": mat(ffn, d),
             "mlp.up_proj.weight": mat(ffn, d), "mlp.down_proj.weight": mat(d, ffn)}
    top = {"fc.weight": mat(d, len(taps) * d), "norm.weight": norm(d), "lm_head.weight": mat(n_draft, d)}
    if draft_vocab:  # every other id from 3 on, then the rest: d2t[i] = target id - i
        used = torch.cat([torch.arange(3, vocab, 2), torch.arange(4, vocab, 2)])[:draft_vocab].sort().values
        top["d2t"] = used - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[used] = True
        top["t2d"] = t2d
    if with_embed:
        top["embed_tokens.weight"] = torch.randn(vocab, d, generator=g)
    if tap_norms == "norm_before_fc":
        top["input_norm.weight"] = norm(len(taps) * d)
    elif tap_norms == "fc_norm":
        top |= {f"fc_norm.{i}.weight": norm(d) for i in range(len(taps))}
    # SpecForge's nested ids name layer outputs (one less); a tap 0 (the embedding) has no such id
    ids = ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [j - 1 for j in taps]}} if min(taps) > 0
           else {"eagle_aux_hidden_state_layer_ids": list(taps)})
    llama = {"hidden_size": d, "intermediate_size": ffn, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": t.get("rope_theta", 10000.0),
             "max_position_embeddings": 256, "vocab_size": vocab, "hidden_act": "silu", "model_type": "llama",
             "tie_word_embeddings": False, "torch_dtype": "float32"}
    if fmt == "eagle":
        names = {"midlayer." + k: v for k, v in layer.items()} | top
        config = llama | {"architectures": ["LlamaForCausalLM"], "draft_vocab_size": n_draft,
                          "eagle_aux_hidden_state_layer_ids": list(taps)}
    elif fmt in ("specforge", "vllm"):
        names = {"midlayer." + k: v for k, v in layer.items()} | top
        arch = "LlamaForCausalLMEagle3" if fmt == "specforge" else "Eagle3LlamaForCausalLM"
        config = llama | {"architectures": [arch], "draft_vocab_size": n_draft} | ids
    elif fmt == "speculators":
        names = {"layers.0." + k: v for k, v in layer.items()} | top
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": llama, "draft_vocab_size": n_draft,
                  "norm_before_residual": norm_before_residual, "eagle_aux_hidden_state_layer_ids": list(taps),
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "verifier": {"architectures": t.get("architectures", []),
                                                      "name_or_path": str(target_dir)}}}
    else:
        raise ValueError(fmt)
    if norm_before_residual and fmt != "speculators":
        config["norm_before_residual"] = True
    if tap_norms:
        config[tap_norms] = True
    if norm_output:
        config["norm_output"] = True
    config.update(config_edits or {})
    names = {k: v.contiguous() for k, v in names.items() if not any(k.endswith(x) for x in drop)}
    if fmt == "eagle":
        torch.save(names, out / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(names, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def raw_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A written head's tensors as the reference reads them: layer keys without their prefix."""
    if (path / "pytorch_model.bin").exists():
        t = torch.load(path / "pytorch_model.bin", weights_only=True)
    else:
        from safetensors.torch import load_file

        t = load_file(str(path / "model.safetensors"))
    out = {}
    for k, v in t.items():
        for p in ("model.layers.0.", "layers.0.", "midlayer.", "model."):
            if k.startswith(p):
                k = k[len(p):]
                break
        out[k] = v.float()
    return out


def reference_fuse(w: dict, taps: list[torch.Tensor]) -> torch.Tensor:
    """fc over the taps [T, H] each, with the head's norms over them if it has any."""
    if "input_norm.weight" in w:
        return rms(torch.cat(taps, -1), w["input_norm.weight"]) @ w["fc.weight"].T
    if "fc_norm.0.weight" in w:
        taps = [rms(x, w[f"fc_norm.{i}.weight"]) for i, x in enumerate(taps)]
    return torch.cat(taps, -1) @ w["fc.weight"].T


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):  # x [T, H, hd], rotate_half convention
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
    f = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([f.cos(), f.cos()], -1)[:, None], torch.cat([f.sin(), f.sin()], -1)[:, None]
    half = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos + half * sin


def reference_entries(w: dict, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                      visible: torch.Tensor, heads: int, kv_heads: int, theta: float,
                      norm_before_residual: bool = False) -> torch.Tensor:
    """The head's layer over entries at once: feats [T, H] (fused taps or fed-back outputs),
    embeds [T, H] of the entries' tokens, visible [T, T] which entries each one attends to.
    Returns the layer outputs before the final norm."""
    T, d = feats.shape
    hd = d // heads
    h = rms(feats, w["hidden_norm.weight"])
    x = torch.cat([rms(embeds, w["input_layernorm.weight"]), h], -1)
    q = _rope((x @ w["self_attn.q_proj.weight"].T).view(T, heads, hd), positions, theta)
    k = _rope((x @ w["self_attn.k_proj.weight"].T).view(T, kv_heads, hd), positions, theta)
    v = (x @ w["self_attn.v_proj.weight"].T).view(T, kv_heads, hd)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    a = torch.einsum("hts,shd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v).reshape(T, d)
    r = (h if norm_before_residual else feats) + a @ w["self_attn.o_proj.weight"].T
    m = rms(r, w["post_attention_layernorm.weight"])
    return r + (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T


def reference_logits(w: dict, o: torch.Tensor, vocab: int) -> torch.Tensor:
    """Full-vocabulary logits of layer outputs o (-inf outside the draft vocabulary)."""
    small = rms(o, w["norm.weight"]) @ w["lm_head.weight"].T
    if "d2t" not in w:
        return small
    ids = torch.arange(len(w["d2t"])) + w["d2t"].long()
    full = torch.full((len(o), vocab), float("-inf"))
    full[:, ids] = small
    return full
