"""A compact decoder-only transformer for the Llama family (SmolLM2, Llama 3.x, Qwen2/2.5, Qwen3).

RMSNorm, RoPE (checkpoint theta, optional llama3 / linear scaling), grouped-query attention,
SwiGLU, tied or untied head. The shape of a checkpoint comes from its own config (config.json
or GGUF metadata), never from a table of known models.

The KV cache is preallocated per layer as [1, n_kv, max_len, head_dim] and indexed by absolute
position, so rolling back after a rejected draft is just setting a shorter length.
The residual stream stays in float32; matmul inputs are cast to the compute dtype.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backends.base import Sampling
from backends.native import sampling as sampler

FINAL = -1  # hidden_layers key for the final hidden state (after the final norm)


@dataclass
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    arch: str = "llama"
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_hf(cls, c: dict) -> "ModelConfig":
        c = c.get("text_config", c)
        arch = c.get("model_type", "llama")
        n_heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
            n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
            ffn_dim=c["intermediate_size"], norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(c), rope_scaling=_rope_scaling(c),
            max_position=c.get("max_position_embeddings", 4096),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=bool(c.get("attention_bias", arch in ("qwen2", "mimo"))),
            qk_norm=arch.startswith("qwen3"), arch=arch)


def _rope_theta(c: dict) -> float:
    params = c.get("rope_parameters") or {}
    return float(c.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(c: dict) -> dict | None:
    s = c.get("rope_scaling") or c.get("rope_parameters")
    if not s:
        return None
    kind = s.get("rope_type") or s.get("type")
    return None if kind in (None, "default") else dict(s, rope_type=kind)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
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


def rope_tables(cfg: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and signed sin per position, [max_len, 1, head_dim], for `Block.forward`."""
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(cfg))
    cos, sin = freqs.cos(), freqs.sin()
    return (torch.cat([cos, cos], -1).to(device, dtype)[:, None, :],
            torch.cat([-sin, sin], -1).to(device, dtype)[:, None, :])


# From this many rows on, a dense matmul beats torch's int4 kernel, whose cost grows with every row
# (a 1000-token prefill: 1.2 s of int4 matmuls vs 0.11 s dense for SmolLM2-135M on 2 cores).
DENSE_MIN_ROWS = 8


def dense_compute_dtype() -> torch.dtype:
    """What a many-row pass multiplies an int4 Linear's bfloat16 copy in: bfloat16 where this CPU
    multiplies bfloat16 natively (AVX512-BF16 or AMX), else float32, the copy widened on the fly.
    On an AVX2-only EPYC, bfloat16 GEMM is emulated: SmolLM2-135M's matmuls for a 789-token
    prefill took 11.2 s in bfloat16, 3.7 s on the int4 kernel and 1.8 s in float32.

    Decided by the CPU's flags, not by timing: the choice sets a prefill's arithmetic and so the
    reply, which must not change from one run to the next on a machine (a timing probe on a shared
    machine once picked bfloat16, and a prompt's reply and its prefill time changed with it)."""
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None)
    return torch.bfloat16 if any(f is not None and f() for f in native) else torch.float32


class Linear(nn.Module):
    """y = x W^T (+ b) with W dense in the compute dtype, or group-wise int4 (bfloat16 activations).

    An int4 Linear may also hold `dense`, a bfloat16 copy of the same weights, for passes of many
    rows that need not match single-token arithmetic bit for bit (prefill, non-strict verify),
    multiplied in `dense_compute_dtype()`."""

    def __init__(self, weight: Tensor | None, bias: Tensor | None = None, int4: tuple | None = None,
                 row_stable: bool = False, dense: Tensor | None = None):
        super().__init__()
        self.weight = weight  # [out, in] dense, or None when int4
        self.bias = bias
        self.int4 = int4  # (packed, scales_and_zeros, group_size)
        self.row_stable = row_stable
        self.dense = dense
        self.dense_dtype = dense_compute_dtype() if dense is not None else None

    def forward(self, x: Tensor, exact: bool = False) -> Tensor:
        """exact: each row as a single-token pass computes it (never the dense copy)."""
        if self.row_stable:
            return self._pairs(x)
        if self.int4 is not None and (exact or self.dense is None or x.shape[0] < DENSE_MIN_ROWS):
            packed, sz, group = self.int4
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)
        elif self.int4 is None:
            y = F.linear(x, self.weight)
        else:  # `.to` is a no-op where the copy is multiplied as it is
            y = F.linear(x.to(self.dense_dtype), self.dense.to(self.dense_dtype)).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _pairs(self, x: Tensor) -> Tensor:
        """Float32 on CPU, bit-stable per row: MKL's one-row GEMV and its GEMM round differently,
        and GEMM's blocking depends on the number of rows, so every call is made as GEMMs of
        exactly two rows (padding an odd row). Each row then gets the same bits however many rows
        come, at about the cost of a GEMV for one row (tested: test_exact_rows_*)."""
        K = x.shape[0]
        if K % 2:
            x = torch.cat([x, x[-1:]])
        return torch.cat([F.linear(pair, self.weight) for pair in x.split(2)])[:K]


# single-token passes attend over the cache rounded up to a multiple of this: a verify block whose
# rows straddle a multiple is computed in two groups (in compiled graphs, two calls that each stream
# the weights), so large enough that few do; the masked keys cost little (measured: 16, 32, 64 and
# 128 within noise of each other per single-token pass)
ATTENTION_PAD = 64


def padded_span(end: int, max_len: int) -> int:
    """How many cache positions a single-token pass at position end - 1 attends over (the rest masked).

    CPU attention's reductions depend on the number of keys, so a verify row can only match a
    single-token pass bit for bit if both see the same key count; padding lets rows of a block
    that share a count go through one batched call instead of one call each."""
    return min(-(-end // ATTENTION_PAD) * ATTENTION_PAD, max_len)


def key_mask(ends: Tensor, n_keys: int, dtype: torch.dtype, heads: tuple[int, int] = (1, 1)) -> Tensor:
    """Additive mask for rows over n_keys keys, row i seeing keys [0, ends[i]), laid out
    for `_attend_rows` over heads = (Hkv, G): kv heads, query heads per kv head. One row:
    [1, 1, 1, n_keys]; n rows: [1, 1, n * G, n_keys] when G > 1, [1, Hkv * n, 1, n_keys] when G == 1."""
    visible = torch.arange(n_keys, device=ends.device)[None, :] < ends[:, None]
    mask = torch.zeros(visible.shape, dtype=dtype, device=ends.device).masked_fill_(~visible, float("-inf"))
    n = len(ends)
    if n == 1:
        return mask[:, None, None, :]
    Hkv, G = heads
    if G > 1:
        return mask[:, None, :].expand(n, G, n_keys).reshape(1, 1, n * G, n_keys)
    return mask[None, :, None, :].expand(Hkv, n, 1, n_keys).reshape(1, Hkv * n, 1, n_keys)


def exact_row_groups(start: int, K: int, max_len: int, device: torch.device, dtype: torch.dtype,
                     heads: tuple[int, int] = (1, 1)) -> list[tuple]:
    """Rows start..start+K-1 grouped by their single-token key count: (lo, hi, n_keys, mask), each
    mask laid out for `_attend_rows` over heads = (n_kv_heads, query heads per kv head)."""
    ends = list(range(start + 1, start + K + 1))
    groups, lo = [], 0
    while lo < K:
        n_keys = padded_span(ends[lo], max_len)
        hi = lo
        while hi < K and padded_span(ends[hi], max_len) == n_keys:
            hi += 1
        groups.append((lo, hi, n_keys, key_mask(torch.tensor(ends[lo:hi], device=device), n_keys, dtype, heads)))
        lo = hi
    return groups


# How `_attend_rows` computes the rows of one call where their bits must not depend on the rows
# around them, fastest first; `attention_rows_mode` finds which this machine's kernel allows
ATTENTION_ROWS = ("shared", "padded", "separate")
_MIN_QUERY_ROWS = 4  # "padded": no query block of CPU flash attention with fewer rows (see _attend_rows)


def _query_block(rows: int) -> int:
    """CPU flash attention's query block for a call of `rows` query rows (per kv head)."""
    return 256 if rows >= 768 else 64 if rows >= 192 else 32


def _rows_to_pad(rows: int) -> int:
    """Zero query rows to add so that no query block of the call has fewer than _MIN_QUERY_ROWS:
    with a multiple of 4 rows every block (32, 64 or 256 rows) and so the last has 0 or 4+.
    1 to 4, never 0: a compiled graph would guard on a size that may be 0."""
    return (-rows - 1) % _MIN_QUERY_ROWS + 1


def _attend_rows(q: Tensor, cache_k: Tensor, cache_v: Tensor, n_keys: int, mask: Tensor,
                 rows: str = "shared") -> Tensor:
    """q [H, n, hd] as n rows over cache[:n_keys] (mask from `key_mask`); returns [1, H, n, hd].

    Each row is computed exactly as a single-token pass computes it, reading the cache in place.
    With grouped-query attention (G = H / Hkv > 1 query heads per kv head) a single-token pass is
    already a G-row query per kv head; a block's rows join those as more query rows of the same
    kv head ([1, Hkv, n * G, hd]): one attention call over the keys for all of them (over 768
    keys, 3 rows: 55 instead of 118 us a layer as one-row queries). With G == 1 each row stays a
    one-row query: the rows go into the head dimension, every one sharing its kv head. (A batch
    of rows would need the cache expanded per row, which a compiled graph copies.)

    CPU flash attention in bfloat16 (the row-invariant precisions' cache) takes query rows in
    blocks (32 for short queries) and multiplies each block by the keys in one GEMM. Whether a
    row's bits then depend on the block around it is the CPU's GEMM's business, so the machine is
    probed (`attention_rows_mode`) and `rows` says how to call:
    - "shared": the rows in one call; a last query block of a single row (11 rows of SmolLM2's 3
      query heads: 33) goes another kernel path with other bits now and then, so it gets a call
      of its own (the machines this project was built on).
    - "padded": where a GEMM of 1-3 rows rounds differently from a larger one (MKL's bfloat16
      GEMM on an AMD EPYC with AVX2: ~15% of rows differ in their last bit; one with AVX512-BF16
      differed as often, its cause not checked),
      zero query rows are added (_rows_to_pad) so that no query block is that small, single-token
      passes included (3 rows of SmolLM2 become 4): every row then comes from a GEMM of 4 or more
      rows, at no measurable cost (1,024 keys, one run: 3 rows 152 us, 4 rows 121 us; a one-token pass
      of SmolLM2 padded or not within noise).
    - "separate": each row the call a single-token pass makes (the fallback; a row costs a call)."""
    H, n, hd = q.shape
    Hkv = cache_k.shape[1]
    G = H // Hkv
    if n > 1 and rows == "separate":
        row_masks = [mask[:, :, i * G:i * G + 1] if G > 1 else mask[:, i:i + 1] for i in range(n)]
        return torch.cat([_attend_rows(q[:, i:i + 1], cache_k, cache_v, n_keys, m) for i, m in enumerate(row_masks)],
                         dim=2)
    k, v = cache_k[:, :, :n_keys], cache_v[:, :, :n_keys]
    if G == 1:
        out = F.scaled_dot_product_attention(q.reshape(1, H * n, 1, hd), k, v, attn_mask=mask, enable_gqa=n > 1)
        return out.view(1, H, n, hd)
    R = n * G
    x = q.view(Hkv, G, n, hd).transpose(1, 2).reshape(1, Hkv, R, hd)
    if rows == "padded":
        pad = _rows_to_pad(R)
        x = torch.cat([x, x.new_zeros(1, Hkv, pad, hd)], dim=2)
        mask = torch.cat([mask.expand(1, 1, R, n_keys), mask.new_zeros(1, 1, pad, n_keys)], dim=2)
        # a copy, not a view: whether the first R rows of R + pad are contiguous depends on pad,
        # which a compiled graph would guard on
        out = F.scaled_dot_product_attention(x, k, v, attn_mask=mask)[:, :, :R]
        out = out.clone(memory_format=torch.contiguous_format)
    elif n > 1 and R % _query_block(R) == 1:
        cut = (n - 1) * G
        out = torch.cat([F.scaled_dot_product_attention(x[:, :, :cut], k, v, attn_mask=mask[:, :, :cut]),
                         F.scaled_dot_product_attention(x[:, :, cut:], k, v, attn_mask=mask[:, :, cut:])], dim=2)
    else:
        out = F.scaled_dot_product_attention(x, k, v, attn_mask=mask)
    return out.view(Hkv, n, G, hd).transpose(1, 2).reshape(1, H, n, hd)


@functools.cache
def attention_rows_mode(kv_heads: int, group: int, head_dim: int, dtype: torch.dtype) -> str:
    """The first of ATTENTION_ROWS under which this machine's CPU attention kernel gives each row
    of a multi-row `_attend_rows` call the bits of a one-row call, checked on random blocks of
    2..33 rows over 64..1088 keys (0.04-0.2 s a mode, once per shape). A probe can only find a
    difference, not prove there is none, hence so many rows."""
    for rows in ATTENTION_ROWS[:-1]:
        if _rows_keep_their_bits(kv_heads, group, head_dim, dtype, rows):
            return rows
    return "separate"


def _rows_keep_their_bits(kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, rows: str) -> bool:
    g = torch.Generator().manual_seed(0)
    for n_keys in (64, 128, 256, 384, 512, 832, 1088):
        cache = [torch.randn(1, kv_heads, n_keys, head_dim, generator=g).to(dtype) for _ in range(2)]
        for n in (2, 3, 4, 5, 8, 11, 16, 33):
            q = (3 * torch.randn(kv_heads * group, n, head_dim, generator=g)).to(dtype)
            ends = torch.full((n,), n_keys)
            block = _attend_rows(q, *cache, n_keys, key_mask(ends, n_keys, dtype, (kv_heads, group)), rows)
            for i in range(n):
                one = _attend_rows(q[:, i:i + 1], *cache, n_keys, key_mask(ends[i:i + 1], n_keys, dtype), rows)
                if not torch.equal(block[0, :, i], one[0, :, 0]):
                    return False
    return True


class KVCache:
    """Per-layer preallocated keys and values; `length` is how many positions are valid."""

    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (1, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.max_len = max_len
        self.length = 0

    def truncate(self, n: int) -> None:
        """Forget every position from n on (no copies: later writes overwrite them)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict):
        super().__init__()
        self.cfg = cfg
        self.attn_norm, self.mlp_norm = w["attn_norm"], w["mlp_norm"]
        self.qkv, self.o, self.gate_up, self.down = w["qkv"], w["o"], w["gate_up"], w["down"]
        self.q_norm, self.k_norm = w.get("q_norm"), w.get("k_norm")
        self.attention_rows = "shared"  # see `_attend_rows`; the Transformer probes the machine

    def forward(self, x: Tensor, cache_k: Tensor, cache_v: Tensor, write: slice | Tensor, span: int,
                cos: Tensor, sin: Tensor, mask: Tensor | None, dtype: torch.dtype,
                row_groups: list[tuple] | None = None) -> Tensor:
        """x: the float32 residual stream [K, dim], updated in place and returned. The new keys and
        values go to cache positions `write`; attention reads cache positions [0, span) under `mask`
        (None with K > 1: plain causal, the block is the whole sequence), or, with `row_groups`
        (see `exact_row_groups`), each row as a single-token pass would; `exact` matmuls then too."""
        exact = row_groups is not None
        q = self._queries_to_cache(x, cache_k, cache_v, write, cos, sin, dtype, exact)
        H, Hkv = self.cfg.n_heads, self.cfg.n_kv_heads
        if row_groups is not None:  # each row exactly as a single-token pass computes it
            parts = [_attend_rows(q[:, lo:hi], cache_k, cache_v, n_keys, m, self.attention_rows)
                     for lo, hi, n_keys, m in row_groups]
            a = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        else:
            a = F.scaled_dot_product_attention(q[None], cache_k[:, :, :span], cache_v[:, :, :span], attn_mask=mask,
                                               is_causal=mask is None and x.shape[0] > 1, enable_gqa=H != Hkv)
        return self._output_and_mlp(x, a, dtype, exact)

    def forward_rows(self, x: Tensor, cache_k: Tensor, cache_v: Tensor, pos: int, n_keys: int,
                     cos: Tensor, sin: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
        """`forward` for rows pos..pos+K-1 that share one single-token key count (one row group),
        each row's attention a one-row query (`_attend_rows`), so that a graph compiled for K >= 2
        rows and one for K = 1 do the same arithmetic per row (see Transformer.use_compiled_rows)."""
        q = self._queries_to_cache(x, cache_k, cache_v, slice(pos, pos + x.shape[0]), cos, sin, dtype, True)
        a = _attend_rows(q, cache_k, cache_v, n_keys, mask, self.attention_rows)
        return self._output_and_mlp(x, a, dtype, True)

    def _queries_to_cache(self, x: Tensor, cache_k: Tensor, cache_v: Tensor, write: slice | Tensor,
                          cos: Tensor, sin: Tensor, dtype: torch.dtype, exact: bool) -> Tensor:
        """Writes the rotated keys and the values of x's rows to the cache; returns the rotated
        queries [H, K, hd] in the cache dtype."""
        cfg = self.cfg
        K, H, Hkv, hd, eps = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
        h = F.rms_norm(x, (cfg.dim,), self.attn_norm, eps).to(dtype)
        qkv = self.qkv(h, exact).to(cos.dtype).view(K, H + 2 * Hkv, hd)  # RoPE in the tables' dtype
        qk, v = qkv[:, :H + Hkv], qkv[:, H + Hkv:]
        if self.q_norm is not None:
            qk = torch.cat([F.rms_norm(qk[:, :H], (hd,), self.q_norm, eps),
                            F.rms_norm(qk[:, H:], (hd,), self.k_norm, eps)], dim=1)
        # rotate_half(x) * sin == roll(x, hd/2) * sin_signed, with the sign folded into the table
        qk = torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin)
        cache_k[0, :, write] = qk[:, H:].transpose(0, 1)
        cache_v[0, :, write] = v.transpose(0, 1)
        return qk[:, :H].transpose(0, 1).to(cache_k.dtype)

    def _output_and_mlp(self, x: Tensor, a: Tensor, dtype: torch.dtype, exact: bool) -> Tensor:
        """a: attention output [1, H, K, hd]."""
        K = x.shape[0]
        x += self.o(a[0].transpose(0, 1).reshape(K, -1).to(dtype), exact)
        h = F.rms_norm(x, (self.cfg.dim,), self.mlp_norm, self.cfg.norm_eps).to(dtype)
        gate, up = self.gate_up(h, exact).chunk(2, dim=-1)
        x += self.down(F.silu(gate).mul_(up), exact)
        return x


_LATER_LAYER = re.compile(r"\._modules\['blocks'\]\._modules\['([1-9]\d*)'\]|\.cache\.[kv]\[([1-9]\d*)\]")


def _first_layer_guards(entries) -> list[bool]:
    """Which of a compiled graph's guards to check on each call: all but those on the second and
    later layers' modules, weights and caches (~2,100 of ~2,460 for SmolLM2-135M, ~0.8 ms a call).
    The layers are built alike and never change after load (a new cache replaces every layer's
    tensors together), so the first layer's guards stand for all of them."""
    return [_LATER_LAYER.search(e.name) is None for e in entries]


class Transformer(nn.Module):
    """Built from already-prepared weights (see weights.py); owns one KV cache."""

    def __init__(self, cfg: ModelConfig, embed: Tensor, blocks: list[dict], norm: Tensor, head: Linear,
                 dtype: torch.dtype, max_len: int):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.embed = embed  # [vocab, dim] float32 or compute dtype; rows are looked up
        self.blocks = nn.ModuleList(Block(cfg, b) for b in blocks)
        self.norm = norm
        self.device = embed.device
        self.set_head(head)  # also clears `argmax_head` (argmax_head.py), which weights.py may add
        self.static = False  # see use_static_shapes
        self._run_blocks = self._blocks
        self._compiled_rows = None  # see use_compiled_rows
        self.setup_cache(max_len)
        if self.device.type == "cpu" and self.cache_dtype == torch.bfloat16:
            self.attention_rows = attention_rows_mode(cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim,
                                                      torch.bfloat16)

    @property
    def attention_rows(self) -> str:
        """How an exact pass computes its rows' attention (ATTENTION_ROWS, see `_attend_rows`)."""
        return self.blocks[0].attention_rows

    @attention_rows.setter
    def attention_rows(self, rows: str) -> None:
        for block in self.blocks:
            block.attention_rows = rows

    @property
    def rows_share_attention(self) -> bool:
        """Whether an exact pass computes its rows' attention in shared calls (padded or not), as
        compiled graphs need: a call per row would specialize a graph on the number of rows."""
        return self.attention_rows != "separate"

    def use_static_shapes(self, compile: bool = False) -> None:
        """Make every pass attend over the whole cache with a position mask (gpt-fast style), so
        shapes depend only on K; with `compile`, the layers go through torch.compile
        ("reduce-overhead": CUDA graphs on CUDA). The eager dynamic path stays the reference."""
        self.static = True
        self._run_blocks = torch.compile(self._blocks, mode="reduce-overhead") if compile else self._blocks

    def use_compiled_rows(self) -> None:
        """CPU: run single-token passes and exact verify rows (everything that must give a row the
        same bits however many rows come) through one torch.compile'd graph of all the layers,
        dynamic in the number of rows, the position and the key count, one call per row group.
        Each row gets the same bits from the K-row graph as from the one-row graph (fused kernels
        reduce within a row), not the eager path's bits: with this on, every such pass goes
        through the compiled graphs. Prefill and non-exact verify blocks stay eager."""
        # cpp_wrapper: the graph's few hundred kernel calls are made from C++, not Python (a
        # one-row pass of SmolLM2-135M: 7.9 instead of 10.4 ms; its first compile takes minutes)
        self._compiled_rows = torch.compile(self._row_layers, dynamic=True, fullgraph=True,
                                            options={"cpp_wrapper": True, "guard_filter_fn": _first_layer_guards})
        self._mark_static()

    def _mark_static(self) -> None:
        """Weights, tables and caches never change shape: tell dynamo, so that only the number of
        rows, the position and the key count are symbols in the compiled graphs (and so guarded)."""
        tensors = [self.embed, self.norm, self.rope_cos, self.rope_sin, *self.cache.k, *self.cache.v]
        for block in self.blocks:
            tensors += [block.attn_norm, block.mlp_norm, block.q_norm, block.k_norm]
            for lin in (block.qkv, block.o, block.gate_up, block.down):
                tensors += [lin.weight, lin.bias, lin.dense, *(lin.int4 or ())[:2]]
        for t in tensors:
            while isinstance(t, Tensor):  # and what it is a view of: dynamo traces views from their base
                torch._dynamo.mark_static(t)
                t = t._base

    @property
    def compiled_rows(self) -> bool:
        return self._compiled_rows is not None

    def setup_cache(self, max_len: int) -> None:
        """(Re)allocate the KV cache for `max_len` positions and the RoPE tables to match."""
        self.cache = KVCache(self.cfg, max_len, self.cache_dtype, self.device)
        self.rope_cos, self.rope_sin = rope_tables(self.cfg, max_len, self.device, self.rope_dtype)
        if self._compiled_rows is not None:
            self._mark_static()

    @property
    def cache_dtype(self) -> torch.dtype:
        """Keys and values are stored in the compute dtype, except float16 on CPU (its attention
        is slow there): float32. A bfloat16 cache halves what attention reads over long contexts."""
        return torch.float32 if self.device.type == "cpu" and self.dtype == torch.float16 else self.dtype

    @property
    def rope_dtype(self) -> torch.dtype:
        """float32 on CPU (rotations are cheap there); the compute dtype on CUDA."""
        return torch.float32 if self.device.type == "cpu" else self.dtype

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def set_head(self, head: Linear) -> None:
        """Swap the LM head (a drafter's int4 copy: its logits only need to rank its guesses)."""
        self.head = head
        self.argmax_head = None
        self.head_dtype = torch.float32 if head.row_stable else (torch.bfloat16 if head.int4 else self.dtype)

    @property
    def runs_int4(self) -> bool:
        return any(lin.int4 is not None for b in self.blocks for lin in (b.qkv, b.o, b.gate_up, b.down))

    @torch.inference_mode()
    def forward(self, tokens: Tensor, start_pos: int, hidden_layers: tuple[int, ...] = (),
                all_logits: bool = True, exact_rows: bool = False, head: bool = True
                ) -> tuple[Tensor, dict[int, Tensor]]:
        """Run tokens[1, K] at positions start_pos..start_pos+K-1 against cache[:start_pos].

        Returns float32 logits [K, vocab] (or [1, vocab] for the last position when
        all_logits is False) and the float32 hidden states [K, dim] of the requested layers:
        key i is the output of decoder layer i, key FINAL (-1) the final hidden state after the norm.
        Afterwards the cache holds start_pos + K positions. With head=False the first result is
        the final hidden state (after the norm) instead of the logits: `logits` turns rows of it
        into logits, and `choose` into tokens, so a caller computes only what it needs.

        exact_rows: compute each row's attention as a single-token pass does (same key count, see
        `padded_span`), so that each row is bitwise what K single-token passes give, wherever the
        matmul kernels are row-invariant (int4 and bfloat16 on CPU are; float32 MKL is not, see
        ROW_INVARIANT_PRECISIONS in engine.py).
        """
        if exact_rows and self.static:
            raise ValueError("exact_rows needs the dynamic (eager) path")
        K = tokens.shape[-1]
        end = start_pos + K
        if start_pos > self.cache.length or end > self.cache.max_len:
            raise ValueError(f"positions {start_pos}..{end} do not fit a cache of length "
                             f"{self.cache.length} / {self.cache.max_len}")
        x = self.embed[tokens.reshape(-1)].float()
        row_groups = None
        if self.static:
            write = torch.arange(start_pos, end, device=self.device)
            span = self.cache.max_len
            mask = torch.arange(span, device=self.device)[None, :] <= write[:, None]
        else:
            write, span, mask = slice(start_pos, end), end, None
            if K == 1 or exact_rows:
                row_groups = exact_row_groups(start_pos, K, self.cache.max_len, self.device, self.cache_dtype,
                                              (self.cfg.n_kv_heads, self.cfg.n_heads // self.cfg.n_kv_heads))
            elif start_pos > 0:  # an additive mask, made once rather than converted by every layer
                rows = torch.arange(start_pos, end, device=self.device)[:, None]
                hidden_keys = torch.arange(end, device=self.device)[None, :] > rows
                mask = torch.zeros(hidden_keys.shape, dtype=self.cache_dtype, device=self.device)
                mask.masked_fill_(hidden_keys, float("-inf"))
            # else: a prefill from position 0, plain causal attention (mask None, see Block)
        # compiled graphs give rows their bits only with shared attention calls, padded or not (a
        # call per row would specialize the graph on the number of rows): without, exact blocks run eager
        compiled = self._compiled_rows is not None and (K == 1 or self.rows_share_attention)
        if row_groups is not None and compiled:
            x, hidden = self._compiled_groups(x, start_pos, row_groups, tuple(hidden_layers))
        else:
            x, hidden = self._run_blocks(x, write, span, self.rope_cos[write], self.rope_sin[write], mask,
                                         tuple(hidden_layers), row_groups)
        self.cache.length = end
        if FINAL in hidden_layers:
            x = hidden[FINAL] = F.rms_norm(x, (self.cfg.dim,), self.norm, self.cfg.norm_eps)
            x = x if all_logits else x[-1:]
        else:
            x = F.rms_norm(x if all_logits else x[-1:], (self.cfg.dim,), self.norm, self.cfg.norm_eps)
        return (self.logits(x) if head else x), hidden

    def logits(self, states: Tensor) -> Tensor:
        """float32 logits [K, vocab] for final hidden states [K, dim] (after the norm)."""
        return self.head(states.to(self.head_dtype)).float()

    def choose(self, states: Tensor, positions: Sequence[int], s: Sampling) -> Tensor:
        """The sampler's token for each row of final hidden states: `sample(logits(states))`, through
        the cheaper `ArgmaxHead` where the choice is an argmax over every token (greedy, or
        temperature sampling without top-k / top-p)."""
        if self.argmax_head is not None and sampler.argmax_over_vocabulary(s):
            return self.argmax_head.choose(states, positions, s)
        return sampler.sample(self.logits(states), positions, s)

    @property
    def head_rows(self) -> int | None:
        """Rows the head can be applied to at a time with each row's bits unchanged (None: any)."""
        return 2 if self.head.row_stable else None

    def choose_rows(self, s: Sampling) -> int | None:
        """How many rows of a verify block `choose` should take per call (None: all at once). The
        argmax head streams its int8 weights once however many rows it scores, so one call; the
        float32 head costs as much per pair of rows, so a pair at a time lets the loop stop at
        the first rejected draft."""
        if self.argmax_head is not None and sampler.argmax_over_vocabulary(s):
            return None
        return self.head_rows

    def _compiled_groups(self, x: Tensor, start_pos: int, row_groups: list[tuple], hidden_layers: tuple[int, ...]
                         ) -> tuple[Tensor, dict[int, Tensor]]:
        layers = [i for i in hidden_layers if i != FINAL]
        xs, hiddens = [], []
        for lo, hi, n_keys, mask in row_groups:
            pos = start_pos + lo
            # whole inputs, not views: a view's storage offset would become one more guarded symbol
            rows = x if len(row_groups) == 1 else x[lo:hi].clone()
            # the model width is no symbol: dynamo would tie it to an equal key count and specialize both
            torch._dynamo.mark_static(rows, 1)
            out, every = self._compiled_rows(rows, pos, n_keys, mask, bool(layers))
            xs.append(out)
            hiddens.append(every)
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        if len(hiddens) == 1:
            return x, {i: hiddens[0][i] for i in layers}
        return x, {i: torch.cat([h[i] for h in hiddens]) for i in layers}

    def _row_layers(self, x: Tensor, pos: int, n_keys: int, mask: Tensor, keep_hidden: bool
                    ) -> tuple[Tensor, list[Tensor]]:
        """All layers for rows sharing one key count (compiled by use_compiled_rows); with
        keep_hidden, also every layer's output (one graph serves any choice of layers)."""
        cos, sin = self.rope_cos[pos:pos + x.shape[0]], self.rope_sin[pos:pos + x.shape[0]]
        hidden = []
        for i, block in enumerate(self.blocks):
            x = block.forward_rows(x, self.cache.k[i], self.cache.v[i], pos, n_keys, cos, sin, mask, self.dtype)
            if keep_hidden:
                hidden.append(x.clone())
        return x, hidden

    def _blocks(self, x: Tensor, write: slice | Tensor, span: int, cos: Tensor, sin: Tensor, mask: Tensor | None,
                hidden_layers: tuple[int, ...], row_groups: list[tuple] | None = None
                ) -> tuple[Tensor, dict[int, Tensor]]:
        hidden: dict[int, Tensor] = {}
        for i, block in enumerate(self.blocks):
            x = block(x, self.cache.k[i], self.cache.v[i], write, span, cos, sin, mask, self.dtype, row_groups)
            if i in hidden_layers:
                hidden[i] = x.clone()  # x is updated in place by the next layer
        return x, hidden
