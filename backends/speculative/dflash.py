"""DFlash (z-lab, arXiv 2602.06036): a small drafter that fills a whole block of masked positions
in one bidirectional pass, conditioned on the target's hidden states.

- Block: [last committed token, mask x (B-1)] at absolute positions N-1 .. N+B-2, embedded with
  the *target's* embedding (the drafter has none of its own).
- Context: for every committed position before the block, the target's hidden states at the
  decoder layers `target_layer_ids` (outputs of those layers), concatenated, projected by `fc` and
  normalised by `hidden_norm`.
- Each draft layer (Qwen3-style: q/k norms, RoPE, grouped-query attention, SwiGLU) attends from
  the block to keys/values of [context; block], both made by the same k_proj / v_proj, with no
  causal mask inside the block (sliding-window layers see only the last `sliding_window` keys).
- Output: the drafter's `norm`, then the *target's* LM head, at block positions 1 .. depth.

The layers are the engine's own (native/layers.py); the released checkpoints' tensor names
(`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...) are mapped to them on load and back on export.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base import BackendError, Sampling
from ..weight_files import open_safetensors
from ..native.config import ModelConfig
from ..native.int4 import int4_if_fits, quantize_layer
from ..native.layers import RMSNorm, decoder_layer, rope_inv_freq, rope_tables
from ..native.linear import Linear
from ..native.model import FINAL
from ..native.sampling import probs
from ..native.weights import (HF_LAYER_NAMES, build_layer, drafting_head, hf_layer, hf_names, layer_tensors,
                              safetensors_files)
from .loop import Draft, Drafter, common_prefix

FULL, SLIDING = "full_attention", "sliding_attention"


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published default: the middle layer for one draft layer, else layers spread evenly
    from 1 to L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    layer: ModelConfig  # the draft layers' shape, from the Qwen3 keys of config.json
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    layer_types: list[str]
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, c: dict, where: str = "config.json") -> "DFlashConfig":
        d = c.get("dflash_config") or {}
        try:
            # the layers' shape; their types (full / sliding attention) are read below
            layer = ModelConfig.from_hf({k: v for k, v in c.items() if k != "layer_types"})
        except KeyError as e:
            raise BackendError(f"{where}: key {e} missing; is this a DFlash drafter's config.json?") from None
        block = c.get("block_size", d.get("block_size"))
        mask = d.get("mask_token_id", c.get("mask_token_id"))
        n_target = c.get("num_target_layers", d.get("num_target_layers"))
        for key, value in (("block_size", block), ("dflash_config.mask_token_id", mask),
                           ("num_target_layers", n_target)):
            if value is None:
                raise BackendError(f"{where}: key {key} missing; is this a DFlash drafter's config.json?")
        if block < 2:
            raise BackendError(f"{where}: block_size {block} leaves nothing to draft (need at least 2)")
        if c.get("attention_bias"):
            raise BackendError(f"{where}: attention_bias is true; DFlash drafters here have bias-free projections")
        ids = d.get("target_layer_ids") or build_target_layer_ids(n_target, layer.n_layers)
        types = c.get("layer_types") or [FULL] * layer.n_layers
        if len(types) != layer.n_layers or not set(types) <= {FULL, SLIDING}:
            raise BackendError(f"{where}: layer_types must list {FULL} or {SLIDING} for each of the "
                               f"{layer.n_layers} layers (got {types})")
        window = c.get("sliding_window")
        if SLIDING in types and not window:
            raise BackendError(f"{where}: layer_types has {SLIDING} layers but sliding_window is not set")
        return cls(layer, int(block), int(mask), [int(i) for i in ids], int(n_target), list(types),
                   int(window) if SLIDING in types else None)

    def to_hf(self) -> dict:
        """config.json in the released layout."""
        m = self.layer
        out = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids},
            "hidden_size": m.dim, "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim, "intermediate_size": m.ffn_dim,
            "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "max_position_embeddings": m.max_position,
            "vocab_size": m.vocab_size, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
            "layer_types": self.layer_types, "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
        }
        if m.rope_scaling:
            out["rope_scaling"] = m.rope_scaling
        return out


# ---- the model ----

def fresh_tensors(cfg: DFlashConfig, generator: torch.Generator | None = None) -> dict[str, Tensor]:
    """Weights to train from: matrices N(0, 0.02), norms at 1 (released names)."""
    m, g = cfg.layer, generator
    shapes = {"fc.weight": (m.dim, len(cfg.target_layer_ids) * m.dim), "hidden_norm.weight": (m.dim,),
              "norm.weight": (m.dim,)}
    layer = {"q": (m.n_heads * m.head_dim, m.dim), "k": (m.n_kv_heads * m.head_dim, m.dim),
             "v": (m.n_kv_heads * m.head_dim, m.dim), "o": (m.dim, m.n_heads * m.head_dim),
             "gate": (m.ffn_dim, m.dim), "up": (m.ffn_dim, m.dim), "down": (m.dim, m.ffn_dim),
             "attn_norm": (m.dim,), "mlp_norm": (m.dim,), "q_norm": (m.head_dim,), "k_norm": (m.head_dim,)}
    for i in range(m.n_layers):
        shapes |= {f"layers.{i}.{HF_LAYER_NAMES[k]}": s for k, s in layer.items()}
    return {name: torch.randn(s, generator=g) * 0.02 if len(s) == 2 else torch.ones(s) for name, s in shapes.items()}


class DFlashModel(nn.Module):
    """The drafter's layers (layers.py) from weights under the released names, in `dtype`, or on the
    int4 kernel (`int4`: beside an int4 target, for faster guesses; bfloat16 matmul inputs)."""

    def __init__(self, cfg: DFlashConfig, tensors: dict[str, Tensor], dtype: torch.dtype = torch.float32,
                 int4: bool = False, device: torch.device | str = "cpu"):
        super().__init__()
        m = self.m = cfg.layer
        self.cfg, self.int4 = cfg, int4
        self.dtype = torch.bfloat16 if int4 else dtype  # of the matmul inputs; the residual stream is float32
        fc = tensors["fc.weight"]
        self.fc = int4_if_fits(fc, self.dtype, device) if int4 else Linear(fc.to(device, self.dtype))
        self.hidden_norm = RMSNorm(tensors["hidden_norm.weight"].to(device), m.norm_eps)
        self.layers = nn.ModuleList()
        for i in range(m.n_layers):
            layer = hf_layer(tensors, f"layers.{i}.")
            layer = quantize_layer(layer) if int4 else layer
            self.layers.append(decoder_layer(m, build_layer(layer, self.dtype, int4, torch.device(device))))
        self.norm = RMSNorm(tensors["norm.weight"].to(device), m.norm_eps)
        self.inv_freq = rope_inv_freq(m).to(device)

    def released_tensors(self) -> dict[str, Tensor]:
        """The weights (float32) under the released checkpoint's names: to export, or to rebuild
        in another dtype or on the int4 kernel."""
        if self.int4:
            raise ValueError("an int4 drafter keeps no float weights")
        out = {"fc.weight": self.fc.weight, "hidden_norm.weight": self.hidden_norm.weight,
               "norm.weight": self.norm.weight}
        for i, layer in enumerate(self.layers):
            out |= hf_names(layer_tensors(layer), f"layers.{i}.")
        return {k: v.detach().float() for k, v in out.items()}

    def fuse(self, features: Tensor) -> Tensor:
        """Concatenated target hidden states [C, len(target_layer_ids) * D] -> context features [C, D]."""
        return self.hidden_norm(self.fc(features.to(self.dtype)).float())

    def forward(self, x: Tensor, ctx: Tensor, positions: Tensor, masks: dict[str, Tensor | None],
                cache: "ContextCache | None" = None) -> Tensor:
        """x [Q, D] embedded block tokens; ctx [C, D] fused context features; positions [C + Q]
        absolute positions (context rows first); masks: boolean [Q, keys] per layer type (True =
        may attend), None for no mask. Returns the normed draft hidden states [Q, D].

        Each layer's keys and values come from [context; block] through the same projections,
        its queries from the block; with a cache, the new context rows' keys and values are kept
        and attention also reads the cached ones."""
        cos, sin = rope_tables(self.inv_freq, positions, x.device, torch.float32)
        C, Q, m = ctx.shape[0], x.shape[0], self.m
        for i, layer in enumerate(self.layers):
            rows = torch.cat([ctx, layer.attn_norm(x)]).to(self.dtype)
            q, k, v, gate = layer.attention.project(rows, cos, sin)
            k, v = k.transpose(0, 1), v.transpose(0, 1)
            if cache is not None:
                k, v = cache.extend(i, k, v)
            a = F.scaled_dot_product_attention(q[C:].transpose(0, 1)[None], k[None], v[None],
                                               attn_mask=masks.get(self.cfg.layer_types[i]),
                                               enable_gqa=m.n_heads != m.n_kv_heads)
            a = a[0].transpose(0, 1).reshape(Q, m.n_heads * m.head_dim)
            x = x + layer.attention.output(a, None if gate is None else gate[C:], self.dtype)
            x = layer.feed_forward(x, self.dtype)
        if cache is not None:
            cache.length += C
        return self.norm(x)


class ContextCache:
    """Per-layer keys and values of the committed context, preallocated [kv_heads, max_len, head_dim].
    A pass writes the new context rows and its block rows after `length`, but only the context
    rows count afterwards: the block's keys and values are overwritten by the next pass."""

    def __init__(self, cfg: DFlashConfig, max_len: int, dtype: torch.dtype, device: torch.device):
        m = cfg.layer
        shape = (m.n_kv_heads, max_len + cfg.block_size, m.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(m.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(m.n_layers)]
        self.length = 0

    def extend(self, index: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = self.length + k.shape[1]
        self.k[index][:, self.length:end] = k
        self.v[index][:, self.length:end] = v
        return self.k[index][:, :end], self.v[index][:, :end]


def sliding_mask(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """Key j is visible from query i when it is among the last `window` positions up to i (or after i)."""
    return k_pos[None, :] > q_pos[:, None] - window


# ---- loading a released (or trained) drafter ----

def check_fits(cfg: DFlashConfig, target_cfg: ModelConfig, where: str) -> None:
    """One clear line when the drafter was made for another target."""
    m, t = cfg.layer, target_cfg
    if m.dim != t.dim:
        raise BackendError(f"{where}: hidden size {m.dim} differs from the target's {t.dim}; a DFlash drafter "
                           "uses the target's embedding and head, so it must be made for this target")
    if cfg.num_target_layers != t.n_layers:
        raise BackendError(f"{where}: made for a target with {cfg.num_target_layers} layers, this target has "
                           f"{t.n_layers}; use the drafter released for this target")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < t.n_layers]
    if bad or not cfg.target_layer_ids:
        raise BackendError(f"{where}: target_layer_ids {cfg.target_layer_ids} must lie in 0..{t.n_layers - 1} "
                           "(the target's decoder layers)")
    if not 0 <= cfg.mask_token_id < t.vocab_size:
        raise BackendError(f"{where}: mask_token_id {cfg.mask_token_id} is outside the target's vocabulary "
                           f"(0..{t.vocab_size - 1}); the drafter was made for another tokenizer")
    if m.vocab_size and m.vocab_size != t.vocab_size:
        raise BackendError(f"{where}: vocab_size {m.vocab_size} differs from the target's {t.vocab_size}; "
                           "the drafter was made for another tokenizer")


def load_dflash(path: Path, target_cfg: ModelConfig) -> DFlashModel:
    """A DFlash drafter directory (config.json + safetensors, sharded or not), checked against the target."""
    cfg, tensors, _ = read_dflash(path, target_cfg)
    return DFlashModel(cfg, tensors)


def read_dflash(path: Path, target_cfg: ModelConfig, extra: frozenset[str] = frozenset(),
                what: str = "DFlash") -> tuple[DFlashConfig, dict[str, Tensor], dict[str, Tensor]]:
    """(config, the DFlash tensors checked against the config, the tensors named in `extra`: a
    drafter built on DFlash's, such as DSpark's Markov head, checks those itself)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise BackendError(f"{path}: no config.json; expected a {what} drafter directory")
    cfg = DFlashConfig.from_hf(json.loads((path / "config.json").read_text()), str(path / "config.json"))
    check_fits(cfg, target_cfg, str(path))
    want = {name: t.shape for name, t in fresh_tensors(cfg).items()}
    where = safetensors_files(path)
    unknown = sorted(set(where) - set(want) - extra)
    if unknown:
        raise BackendError(f"{path}: {len(unknown)} tensors a {what} drafter does not have (e.g. {unknown[0]}); "
                           f"is this a {what} checkpoint?")
    missing = sorted(set(want) - set(where))
    if missing:
        raise BackendError(f"{path}: tensor {missing[0]} missing ({len(missing)} in all); is this a {what} checkpoint?")
    tensors = {}
    for f in sorted(set(where.values())):
        with open_safetensors(f) as st:
            tensors.update({n: st.get_tensor(n).float() for n in st.keys() if n in want or n in extra})
    others = {n: tensors.pop(n) for n in list(tensors) if n not in want}
    fc_in = len(cfg.target_layer_ids) * cfg.layer.dim
    if tensors["fc.weight"].shape[1] != fc_in:
        raise BackendError(f"{path}: fc.weight takes {tensors['fc.weight'].shape[1]} inputs but "
                           f"{len(cfg.target_layer_ids)} target layers x hidden {cfg.layer.dim} = {fc_in}")
    for name, t in tensors.items():
        if t.shape != want[name]:
            raise BackendError(f"{path}: {name} has shape {tuple(t.shape)}, the config implies {tuple(want[name])}")
    return cfg, tensors, others


# ---- the drafter ----

class DFlashDrafter(Drafter):
    """Proposes up to block_size - 1 tokens per pass from one drafter forward.

    Draft tokens are chosen by the target's own position-keyed sampler on the draft logits: argmax
    when greedy; at temperature > 0 the same Gumbel noise the target will use at that position, so
    whenever the drafter's distribution is close to the target's, both pick the same token (a
    coupling: acceptance tends to 1 as the distributions meet, where an argmax draft is accepted
    only with the target's probability of its mode). Exact acceptance keeps the output the
    target's either way."""

    name = "dflash"
    # the block slot whose output is the first draft: 1 in DFlash's layout (slot 0 holds the last
    # committed token); 0 for anchor-first drafters (DSpark's released ones: B inputs, B drafts)
    first_slot = 1

    def __init__(self, model: DFlashModel, target, want_q: bool = False):
        self.target = target  # a TorchBackend: its embedding, head and sampler are the drafter's
        self.want_q = want_q
        self.cfg = cfg = model.cfg
        tm = target.model
        self.device = tm.embed.device
        # on an int4 target the drafter's matrices and head run on the same int4 kernel: faster guesses
        dtype = torch.float32 if self.device.type == "cpu" else tm.dtype
        if tm.runs_int4 or self.device.type != "cpu":
            model = DFlashModel(cfg, model.released_tensors(), dtype, tm.runs_int4, self.device)
        self.model = model.eval()
        self.head = drafting_head(tm)
        # the output of the last decoder layer is, as in Hugging Face hidden_states, taken after the final norm
        last = tm.cfg.n_layers - 1
        self.hidden_layers = tuple(FINAL if i == last else i for i in cfg.target_layer_ids)
        self.max_len = target.context_length
        self.cache = ContextCache(cfg, self.max_len, torch.float32, self.device)  # keys in the RoPE tables' dtype
        self.pending: list[Tensor] = []  # committed target features not yet in the cache
        self.tokens: Sequence[int] = []  # the committed sequence the cached context belongs to
        self.sampling = Sampling()

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def max_depth(self) -> int:
        return self.cfg.block_size - self.first_slot

    def _features(self, hidden: dict[int, Tensor]) -> Tensor:
        return torch.cat([hidden[k] for k in self.hidden_layers], dim=-1)

    def reusable(self, prompt_ids) -> int:
        return common_prefix(self.tokens[:self.cache.length], prompt_ids)

    def start(self, prompt_ids, hidden, sampling: Sampling, reused: int = 0) -> None:
        """Keeps the cached context of positions before `reused` (each position's keys and values
        come from its own target features alone)."""
        if reused > self.cache.length:
            raise RuntimeError(f"DFlash drafter asked to reuse {reused} positions, holding {self.cache.length}")
        self.sampling = sampling
        self.cache.length = reused
        self.tokens = prompt_ids
        self.pending = [self._features(hidden)]

    def commit(self, tokens, hidden) -> None:
        self.tokens = tokens
        self.pending.append(self._features(hidden))

    @torch.inference_mode()
    def draft_logits(self, tokens: Sequence[int], depth: int) -> Tensor:
        """Logits [depth, vocab] for the tokens at positions len(tokens) .. len(tokens) + depth - 1."""
        n, cache = len(tokens), self.cache
        new = torch.cat(self.pending) if self.pending else torch.zeros(0, len(self.hidden_layers) * self.cfg.layer.dim)
        if cache.length + new.shape[0] != n - 1:
            raise RuntimeError(f"DFlash context out of step: {cache.length} cached + {new.shape[0]} new "
                               f"features for {n - 1} committed positions")
        self.pending = []
        B = self.cfg.block_size
        block = torch.tensor([tokens[-1]] + [self.cfg.mask_token_id] * (B - 1), device=self.device)
        x = self.target.model.embed[block].float()
        ctx = self.model.fuse(new.to(self.device))
        positions = torch.arange(cache.length, n - 1 + B, device=self.device)
        masks = {}
        if self.cfg.sliding_window:
            masks[SLIDING] = sliding_mask(positions[-B:], torch.arange(n - 1 + B, device=self.device),
                                          self.cfg.sliding_window)
        h = self.model(x, ctx, positions, masks, cache)
        return self.logits(h[self.first_slot:self.first_slot + depth])

    def logits(self, h: Tensor) -> Tensor:
        """The target's LM head on draft hidden states: one full-vocabulary row per drafted token,
        the drafter's largest cost. One GEMM (int4 on an int4 target), not the verify path's
        row-stable pairs: drafts need no bit-exactness."""
        head = self.head
        if head.weight is None:
            return head(h.to(torch.bfloat16)).float()  # int4 head
        return F.linear(h.to(head.weight.dtype), head.weight).float()

    def propose(self, tokens: Sequence[int], depth: int) -> Draft:
        depth = min(depth, self.max_depth, self.max_len - len(tokens))
        if depth <= 0:
            return Draft([])
        logits = self.draft_logits(tokens, depth)
        n = len(tokens)
        out = self.target.sample(logits, list(range(n, n + depth)), self.sampling).tolist()
        return Draft(out, probs(logits, self.sampling) if self.want_q else None)

    def close(self) -> None:
        self.model = None
        self.cache = None
        self.pending = []
