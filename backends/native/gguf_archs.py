"""What each GGUF architecture beyond the Llama family adds to its shape and its tensor names, read
as llama.cpp's converter writes them and llama.cpp reads them (src/llama-model.cpp, src/models/*).

- qwen3moe: routed experts in every layer, top-k renormalised;
- gemma3: sliding windows, GELU, scaled embedding and queries, logit soft-capping (`gemma3`);
- qwen35 / qwen35moe (Qwen3.5, Qwen3.6): Gated DeltaNet layers (`ssm_*`, `attn_qkv`, `attn_gate`)
  between gated full-attention layers (q rows twice as many: the output gate), partial RoPE, the
  MLP's norm named `post_attention_norm`; qwen35moe's experts with a gated shared expert;
- glm4moe (GLM-4.5 / 4.6 / 4.7): a sigmoid router with a correction bias (`exp_probs_b`) over
  groups of experts, a shared expert, dense leading layers, q/k/v biases, partial RoPE.

The last `nextn_predict_layers` blocks of qwen35, qwen35moe and glm4moe are MTP layers, not part of
the main model (gguf_mtp.py reads them). The converter stores zero-centred norms with the 1 added
(`norm + 1`, but not the Gated DeltaNet's own gated norm), `A_log` as `-exp(A_log)` (`linear_layer`
takes the log again), and the value heads of a Gated DeltaNet layer tiled across key heads
(`_reorder_v_heads`: [K0, K1, K0, K1, ...] where Hugging Face groups them [K0, K0, K1, K1]), which
the engine runs as they are (config.LinearAttentionShape.tiled), so that a quantized file's
matrices stay its blocks on the kernels.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import torch
from torch import Tensor

from ..base import BackendError
from .config import ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION, LinearAttentionShape, MoeShape

HYBRID_ARCHS = ("qwen35", "qwen35moe")
NEXTN_ARCHS = ("qwen35", "qwen35moe", "glm4moe")  # the archs whose files may carry MTP (nextn) layers
# llama.cpp's gemma3: without `sliding_window_pattern`, every 6th layer is global (llama_hparams::set_swa_pattern)
GEMMA3_PATTERN = 6
# llama_expert_gating_func_type: 1 softmax, 2 sigmoid
SIGMOID_GATING = 2

# a Gated DeltaNet layer: short names (weights.HF_LINEAR_NAMES' keys) -> the file's names
LINEAR_NAMES = {"qkv": "attn_qkv.weight", "z": "attn_gate.weight", "b": "ssm_beta.weight", "a": "ssm_alpha.weight",
                "conv": "ssm_conv1d.weight", "A_log": "ssm_a", "dt_bias": "ssm_dt.bias", "gate_norm": "ssm_norm.weight",
                "out": "ssm_out.weight", "attn_norm": "attn_norm.weight", "mlp_norm": "post_attention_norm.weight"}
# a sparse layer's tensors beside the routed experts: router bias, shared expert and its gate
SHARED_NAMES = {"router_bias": "exp_probs_b.bias", "shared_gate": "ffn_gate_shexp.weight",
                "shared_up": "ffn_up_shexp.weight", "shared_down": "ffn_down_shexp.weight",
                "shared_expert_gate": "ffn_gate_inp_shexp.weight"}
# archs whose MLP norm is llama.cpp's ATTN_POST_NORM (`post_attention_norm`), not `ffn_norm`
POST_ATTENTION_MLP_NORM = ("qwen35", "qwen35moe", "glm4moe")


def arch_fields(arch: str, a: Callable, count: Callable, number: Callable, n_layers: int, dim: int, n_heads: int,
                head_dim: int, names: set[str], source: str) -> dict:
    """ModelConfig fields beyond the Llama family's for `arch` (`a`, `count`, `number`: the metadata
    readers of gguf_loader.config_from_gguf; `names`: the file's tensor names)."""
    if arch == "qwen3moe":  # every layer routed experts, top-k renormalised, as llama.cpp's qwen3moe runs them
        return {"moe": _moe(a, count, range(n_layers), n_layers, source, renormalise=True)}
    if arch == "gemma3":
        return _gemma3(a, count, number, n_layers, dim, n_heads, head_dim, source)
    if arch not in NEXTN_ARCHS:
        return {}
    out = {"qk_norm": any(n.endswith(".attn_q_norm.weight") for n in names)}
    rotated = a("rope.dimension_count")
    if isinstance(rotated, int) and 0 < rotated < head_dim:
        out["rotary_dim"] = rotated
    if arch == "glm4moe":
        dense = a("leading_dense_block_count", 0)
        scoring = "sigmoid" if a("expert_gating_func") == SIGMOID_GATING else "softmax"
        moe = _moe(a, count, range(dense, n_layers), n_layers, source, renormalise=bool(a("expert_weights_norm")),
                   scoring=scoring)
        shared = a("expert_shared_count", 0)
        return out | {"moe": replace(moe, shared_dim=shared * moe.expert_dim)}
    out |= {"output_gate": True, **_hybrid_layers(a, count, n_layers, source)}
    if arch == "qwen35moe":  # always renormalised (transformers' Qwen3.5-MoE has no flag), a gated shared expert
        moe = _moe(a, count, range(n_layers), n_layers, source, renormalise=True)
        out["moe"] = replace(moe, shared_dim=a("expert_shared_feed_forward_length", 0), shared_gate=True)
    return out


def _moe(a, count, sparse, n_layers: int, source: str, renormalise: bool, scoring: str = "softmax") -> MoeShape:
    experts, top_k = count("expert_count"), count("expert_used_count")
    if top_k > experts:
        raise BackendError(f"{source}: metadata `expert_used_count` ({top_k}) is more than its {experts} "
                           "experts; is the file complete? convert or download it again")
    groups, kept = count("expert_group_count", 1), count("expert_group_used_count", 1)
    if experts % groups or kept > groups:
        raise BackendError(f"{source}: its {experts} experts do not split into {groups} groups of which {kept} are "
                           "kept (`expert_group_count`, `expert_group_used_count`); convert or download it again")
    scale = a("expert_weights_scale")
    return MoeShape(experts=experts, top_k=top_k, expert_dim=count("expert_feed_forward_length"),
                    sparse_layers=tuple(sparse), scoring=scoring, renormalise=renormalise, n_group=groups,
                    topk_group=kept, scaling=float(scale) if scale else 1.0, n_layers=n_layers)


def _hybrid_layers(a, count, n_layers: int, source: str) -> dict:
    """Which main layers are Gated DeltaNet (`attention.recurrent_layers`, else every layer but each
    `full_attention_interval`-th, as llama.cpp's qwen35 reads it) and their shape (`ssm.*`)."""
    flags = a("attention.recurrent_layers")
    if isinstance(flags, list) and len(flags) >= n_layers:
        recurrent = [bool(f) for f in flags[:n_layers]]
    else:
        interval = count("full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    v_heads = count("ssm.time_step_rank")
    shape = LinearAttentionShape(k_heads=count("ssm.group_count"), v_heads=v_heads, k_dim=count("ssm.state_size"),
                                 v_dim=count("ssm.inner_size") // v_heads, conv_kernel=count("ssm.conv_kernel"),
                                 tiled=True)
    if shape.v_heads % shape.k_heads or shape.v_dim * v_heads != count("ssm.inner_size"):
        raise BackendError(f"{source}: metadata `ssm.*` gives {v_heads} value heads over {shape.k_heads} key heads "
                           "and an inner size that do not fit together; convert or download it again")
    return {"layer_types": tuple(LINEAR_ATTENTION if r else ATTENTION for r in recurrent), "linear": shape}


def _gemma3(a, count, number, n_layers: int, dim: int, n_heads: int, head_dim: int, source: str) -> dict:
    """Gemma 3 as llama.cpp reads its GGUF (src/models/gemma3.cpp): the embedding times sqrt(dim),
    GELU, scores scaled by 1 / sqrt(head_dim) (1 / sqrt(dim / heads) for the 62-layer 27B, as
    google's gemma_pytorch sets query_pre_attn_scalar), sliding-window layers where the file gives a
    window, global every `sliding_window_pattern`-th layer (or as its per-layer list says), their RoPE
    base `rope.freq_base_swa` (10000 where absent), never scaled; the norms' 1 + w is in the file."""
    scalar = dim / n_heads if n_layers == 62 else head_dim
    cap = number("final_logit_softcapping", 1.0) if a("final_logit_softcapping") is not None else 0.0
    out = dict(embed_scale=math.sqrt(dim), gelu=True, query_scale=scalar ** -0.5, logit_softcap=cap)
    if not a("attention.sliding_window"):
        return out
    pattern = a("attention.sliding_window_pattern", GEMMA3_PATTERN)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]
    else:
        sliding = []
    if len(sliding) != n_layers:
        raise BackendError(f"{source}: metadata `gemma3.attention.sliding_window_pattern` is {pattern!r}, not a "
                           f"layer count or one flag for each of its {n_layers} layers; convert or download it again")
    return out | dict(sliding_window=count("attention.sliding_window"),
                      rope_local_theta=number("rope.freq_base_swa", 10000.0),
                      layer_types=tuple(SLIDING_ATTENTION if s else ATTENTION for s in sliding))


def linear_layer(load: Callable[..., object], dense: Callable[[str], Tensor], i: int) -> dict:
    """Gated DeltaNet layer i's tensors under weights.HF_LINEAR_NAMES' keys, in the file's order of
    value heads (the shape's `tiled`): its matrices by `load(name, matrix=True)` (the file's blocks
    where the kernels run them), the rest by `dense(name)` (float32; a missing tensor raises)."""
    matrices = ("qkv", "z", "b", "a", "out")
    layer = {key: load(f"blk.{i}.{name}", matrix=True) if key in matrices else dense(f"blk.{i}.{name}")
             for key, name in LINEAR_NAMES.items()}
    layer["conv"] = layer["conv"].unsqueeze(1)  # [conv_dim, 1, K], as Hugging Face's conv1d weight
    # the file holds -exp(A_log); the engine takes A_log (gated_delta.py exponentiates it in float64)
    layer["A_log"] = torch.log(-layer["A_log"].double()).float()
    return layer
