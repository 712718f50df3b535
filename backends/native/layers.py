"""The transformer, written once: the pieces the target model (model.py), MTP heads (mtp.py), the
DFlash drafter (speculative/dflash.py) and the trainers (specchat/train) are built from.

Only where attention finds its keys and values differs between them (a KV cache, a drafter's
context, a training batch), so `Attention` takes that as a function: `attend(q, k, v)` gets the
rotated queries, keys and values of the rows being computed and returns their attention output.

Shapes: rows [T, dim] or batches [B, T, dim]; per-head tensors [..., T, heads, head_dim]. The
residual stream is float32; matmul inputs are cast to the compute dtype, RoPE runs in the
tables' dtype. Weights are parameters (frozen unless a trainer unfreezes them).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .linear import Linear

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q, k, v) -> [..., T, heads * head_dim]


def frozen(t: Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


class RMSNorm(nn.Module):
    """rms_norm(x) * weight over the last dim. zero_centred: the checkpoint stores w and the scale
    is 1 + w (Qwen3-Next, Qwen3.5); the engine folds the 1 in at load, trainers keep w as stored."""

    def __init__(self, weight: Tensor, eps: float, zero_centred: bool = False):
        super().__init__()
        self.weight = frozen(weight)
        self.eps, self.zero_centred = eps, zero_centred

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight + 1.0 if self.zero_centred else self.weight
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)


# ---- rotary position embedding ----

def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> Tensor:
    """Inverse frequencies of the rotated dims, with the checkpoint's scaling (llama3, linear, GGUF
    factors); `local`: the sliding-window layers', from their own base and never scaled (Gemma 3)."""
    dim = cfg.rotated
    theta = (cfg.rope_local_theta or cfg.rope_theta) if local else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None or local:
        return inv
    kind = s["rope_type"]
    if kind == "linear":
        return inv / s["factor"]
    if kind == "freq_factors":  # GGUF rope_freqs.weight: llama.cpp divides each frequency by its factor
        return inv / torch.tensor(s["factors"], dtype=torch.float32)
    if kind == "llama3":  # same arithmetic as transformers' _compute_llama3_parameters
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out)
    raise ValueError(f"rope scaling '{kind}' is not supported by the torch engine")


def rope_tables(inv_freq: Tensor, positions: Tensor | int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos and *signed* sin for `positions` (or 0..n-1), [T, 1, rotated dims], for `apply_rope`."""
    if isinstance(positions, int):
        positions = torch.arange(positions)
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return (torch.cat([cos, cos], -1).to(device, dtype)[:, None, :],
            torch.cat([-sin, sin], -1).to(device, dtype)[:, None, :])


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX-style RoPE on the leading cos.shape[-1] dims of each head of x [..., T, heads, hd].
    rotate_half(x) * sin == roll(x, half) * signed sin: one fused multiply-add."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(r // 2, -1), sin)
    rot = x[..., :r]
    return torch.cat([torch.addcmul(rot * cos, rot.roll(r // 2, -1), sin), x[..., r:]], dim=-1)


# ---- the layers ----

class Attention(nn.Module):
    """Grouped-query attention's projections: q, k, v in one matmul (optional biases), optional
    q/k RMS norms, RoPE, an optional sigmoid output gate (q_proj yields [query, gate] per head),
    and the output projection. Where the keys come from is the caller's `attend`."""

    def __init__(self, cfg: ModelConfig, qkv: Linear, o: Linear, q_norm: Tensor | None = None,
                 k_norm: Tensor | None = None, zero_centred: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.output_gate = cfg.output_gate
        # every attention path scales scores by 1 / sqrt(head_dim); a model scaling them otherwise
        # (Gemma's query_pre_attn_scalar) has its queries carry the ratio
        self.q_mult = cfg.query_scale * math.sqrt(cfg.head_dim) if cfg.query_scale else 1.0
        self.qkv, self.o = qkv, o
        self.q_norm = RMSNorm(q_norm, cfg.norm_eps, zero_centred) if q_norm is not None else None
        self.k_norm = RMSNorm(k_norm, cfg.norm_eps, zero_centred) if k_norm is not None else None

    def project(self, h: Tensor, cos: Tensor, sin: Tensor, exact: bool = False
                ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """h [..., T, dim] (normed, compute dtype) -> rotated q [..., T, H, hd], rotated k and v
        [..., T, Hkv, hd] in the tables' dtype, and the output gate [..., T, H * hd] (or None)."""
        H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        y = self.qkv(h, exact).to(cos.dtype)
        lead = y.shape[:-1]
        gate = None
        if self.output_gate:
            q, gate = y[..., :2 * H * hd].view(*lead, H, 2 * hd).chunk(2, dim=-1)
            gate = gate.reshape(*lead, H * hd)
            kv = y[..., 2 * H * hd:].view(*lead, 2 * Hkv, hd)
            qk, v = torch.cat([q, kv[..., :Hkv, :]], dim=-2), kv[..., Hkv:, :]
        else:
            heads = y.view(*lead, H + 2 * Hkv, hd)
            qk, v = heads[..., :H + Hkv, :], heads[..., H + Hkv:, :]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[..., :H, :]), self.k_norm(qk[..., H:, :])], dim=-2)
        qk = apply_rope(qk, cos, sin)
        q = qk[..., :H, :] if self.q_mult == 1.0 else qk[..., :H, :] * self.q_mult
        return q, qk[..., H:, :], v, gate

    def output(self, a: Tensor, gate: Tensor | None, dtype: torch.dtype, exact: bool = False) -> Tensor:
        """Attention output a [..., T, H * hd] -> [..., T, dim] (gated first, if the layer is)."""
        if gate is not None:
            a = a * torch.sigmoid(gate)
        return self.o(a.to(dtype), exact)

    def forward(self, h: Tensor, attend: Attend, cos: Tensor, sin: Tensor, dtype: torch.dtype,
                exact: bool = False) -> Tensor:
        q, k, v, gate = self.project(h, cos, sin, exact)
        return self.output(attend(q, k, v), gate, dtype, exact)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(h)) * up(h)), gate and up in one matmul; with `gelu`, GELU's tanh form
    in place of silu (Gemma's GeGLU)."""

    def __init__(self, gate_up: Linear, down: Linear, gelu: bool = False):
        super().__init__()
        self.gate_up, self.down, self.gelu = gate_up, down, gelu

    def forward(self, h: Tensor, exact: bool = False) -> Tensor:
        gate, up = self.gate_up(h, exact).chunk(2, dim=-1)
        return self.down((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up, exact)


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: x + attention(norm(x)), then x + mlp(norm(x)); where the model has
    them (Gemma), each branch's output is normed again before it is added (`attn_post_norm`,
    `mlp_post_norm`)."""

    def __init__(self, attn_norm: RMSNorm, attention: Attention, mlp_norm: RMSNorm, mlp: GatedMLP,
                 attn_post_norm: RMSNorm | None = None, mlp_post_norm: RMSNorm | None = None):
        super().__init__()
        self.attn_norm, self.attention, self.mlp_norm, self.mlp = attn_norm, attention, mlp_norm, mlp
        self.attn_post_norm, self.mlp_post_norm = attn_post_norm, mlp_post_norm

    def forward(self, x: Tensor, attend: Attend, cos: Tensor, sin: Tensor, dtype: torch.dtype,
                exact: bool = False) -> Tensor:
        """x: the float32 residual stream [..., T, dim]; `exact`: every matmul row as a
        single-token pass computes it (see exact_rows.py)."""
        a = self.attention(self.attn_norm(x).to(dtype), attend, cos, sin, dtype, exact)
        x = x + (a if self.attn_post_norm is None else self.attn_post_norm(a.float()))
        return self.feed_forward(x, dtype, exact)

    def feed_forward(self, x: Tensor, dtype: torch.dtype, exact: bool = False) -> Tensor:
        m = self.mlp(self.mlp_norm(x).to(dtype), exact)
        return x + (m if self.mlp_post_norm is None else self.mlp_post_norm(m.float()))


def decoder_layer(cfg: ModelConfig, w: dict, zero_centred: bool = False) -> DecoderLayer:
    """A layer from prepared weights: Linear `qkv`, `o`, `gate_up`, `down` (or a ready `mlp`: routed
    experts, moe.py); norm tensors `attn_norm`, `mlp_norm` and optionally `q_norm`, `k_norm`,
    `attn_post_norm`, `mlp_post_norm` (see weights.build_layer)."""
    eps = cfg.norm_eps

    def norm(key: str) -> RMSNorm | None:
        return RMSNorm(w[key], eps, zero_centred) if w.get(key) is not None else None

    attention = Attention(cfg, w["qkv"], w["o"], w.get("q_norm"), w.get("k_norm"), zero_centred)
    mlp = w.get("mlp") or GatedMLP(w["gate_up"], w["down"], cfg.gelu)
    return DecoderLayer(norm("attn_norm"), attention, norm("mlp_norm"), mlp, norm("attn_post_norm"),
                        norm("mlp_post_norm"))
