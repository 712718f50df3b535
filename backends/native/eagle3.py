"""EAGLE-3 draft heads: reading the public formats, and the head itself.

A head drafts from features of three target layers (low, middle, high), fused by `fc`:

    f[t]  = fc(cat(a[t], b[t], c[t]))          # the inputs of the tapped layers at position t
    x     = cat(input_layernorm(embed(x[t+1])), hidden_norm(f[t]))    # width 2H
    r     = f[t] (hidden_norm(f[t]) with norm_before_residual)
    o[t]  = mlp_block(r + attention(x))         # one decoder layer; attends to entries 0..t
    logits over the draft vocabulary = lm_head(norm(o[t])); target id = i + d2t[i]

Deeper drafts feed the layer's own output o (before `norm`; after it for vLLM's and speculators'
`norm_output`) back in place of f. Tap j is the input of target layer j (the output of layer j - 1,
or for j = 0 the token embedding), 0 <= j < L, as vLLM reads a config's top-level
`eagle_aux_hidden_state_layer_ids`; SpecForge's nested `eagle_config` ids name layer outputs (one
less). The default is (2, L // 2, L - 3). Optional norms over the taps before `fc`:
`norm_before_fc` (one over their concatenation, `input_norm`) and `fc_norm` (one per tap). Four
public formats hold the same tensors under other names and configs
(../shared/reference/hybrid-moe-eagle3.md, section 4):

- eagle        the original EAGLE release: `midlayer.*`, config.json with `draft_vocab_size`
- specforge    SpecForge's `LlamaForCausalLMEagle3`: `midlayer.*`
- vllm         vLLM / AngelSlim's `Eagle3LlamaForCausalLM`: `midlayer.*` (or vLLM's own `model.layers.0.*`)
- speculators  vLLM's speculators `Eagle3Speculator`: `layers.0.*`, the layer's config nested
               in `transformer_layer_config`, `speculators_config` naming the verifier
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from ..base import BackendError
from ..weight_files import load_safetensors
from .config import ModelConfig, read_hf_json
from .draft_vocab import VocabHead
from .int4 import int4_if_fits, quantize_layer
from .layers import RMSNorm, decoder_layer, rope_inv_freq, rope_tables
from .linear import Linear
from .model import KVCache, Transformer, entries_attention
from .weights import HF_LAYER_NAMES, LAYER_KEYS, build_layer, safetensors_files

FORMATS = {"eagle": "the original EAGLE release", "specforge": "SpecForge (LlamaForCausalLMEagle3)",
           "vllm": "vLLM / AngelSlim (Eagle3LlamaForCausalLM)", "speculators": "speculators (Eagle3Speculator)"}
LAYER_PREFIXES = ("midlayer.", "layers.0.")


@dataclass
class Eagle3Weights:
    format: str  # a FORMATS key
    cfg: ModelConfig  # the draft layer's shape (one layer)
    layer: dict[str, Tensor]  # float32, short names (weights.HF_LAYER_NAMES) plus hidden_norm; q/k/v take 2H
    fc: Tensor  # [H, taps * target H]
    norm: Tensor  # [H]
    lm_head: Tensor  # [draft vocab, H]
    draft_ids: Tensor | None  # [draft vocab] target ids (i + d2t[i]); None: the full vocabulary
    taps: tuple[int, ...]  # target layers whose input is fused (vLLM's ids)
    norm_before_residual: bool
    embed: Tensor | None  # the head's own embedding, if the checkpoint has one (else the target's)
    tap_norms: list[Tensor] | None = None  # norm_before_fc: one [taps * H]; fc_norm: one [H] per tap
    feed_normed: bool = False  # vLLM's / speculators' norm_output: the next step gets norm(o)


def default_taps(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's published low / middle / high taps for a target of n_layers layers."""
    return (2, n_layers // 2, n_layers - 3)


def detect_format(config: dict) -> str | None:
    arch = config.get("architectures") or []
    if config.get("speculators_model_type") == "eagle3" or "Eagle3Speculator" in arch:
        return "speculators"
    if "LlamaForCausalLMEagle3" in arch:
        return "specforge"
    if "Eagle3LlamaForCausalLM" in arch:
        return "vllm"
    if config.get("draft_vocab_size"):
        return "eagle"
    return None


def _tensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of the head (small: one layer), by name without a leading `model.`."""
    if list(path.glob("*.safetensors")):
        found: dict[str, Tensor] = {}
        for f in sorted(set(safetensors_files(path).values())):
            found |= load_safetensors(f)
    elif (path / "pytorch_model.bin").exists():
        try:
            found = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a pickle that is not a plain state dict
            raise BackendError(f"{path}/pytorch_model.bin could not be read as a state dict ({e}); "
                               "download the head again") from None
    else:
        raise BackendError(f"{path}: no *.safetensors or pytorch_model.bin; an EAGLE-3 head is a directory "
                           "with config.json and its weights")
    return {(k[len("model."):] if k.startswith("model.") else k): v for k, v in found.items()}


def read_eagle3(path: Path, target: ModelConfig) -> Eagle3Weights:
    """The EAGLE-3 head in directory `path`, read and checked against its target's shape `target`.
    Raises BackendError naming what does not fit."""
    path = Path(path)
    if not path.is_dir():
        raise BackendError(f"{path}: an EAGLE-3 head is a directory with config.json and its weights")
    config = read_hf_json(path)
    fmt = detect_format(config)
    if fmt is None:
        raise BackendError(f"{path}: not an EAGLE-3 head (its config.json has no `draft_vocab_size`, and its "
                           "architectures are none of LlamaForCausalLMEagle3, Eagle3LlamaForCausalLM, "
                           "Eagle3Speculator)")
    layer_config = config.get("transformer_layer_config", config) if fmt == "speculators" else config
    cfg = replace(ModelConfig.from_hf(layer_config, f"{path}/config.json"), n_layers=1, layer_types=(), linear=None)
    t = _tensors(path)
    prefix = next((p for p in LAYER_PREFIXES if p + "self_attn.q_proj.weight" in t), None)
    if prefix is None:
        raise BackendError(f"{path}: no decoder layer found (looked for midlayer.* and layers.0.*) in an "
                           f"EAGLE-3 head ({FORMATS[fmt]})")

    def need(name: str) -> Tensor:
        if name not in t:
            raise BackendError(f"{path}: EAGLE-3 tensor {name} missing ({FORMATS[fmt]})")
        return t[name].float()

    layer = {key: need(prefix + suffix) for key, suffix in HF_LAYER_NAMES.items()
             if key in LAYER_KEYS or prefix + suffix in t}
    layer["hidden_norm"] = need(prefix + "hidden_norm.weight")
    eagle_config = config.get("eagle_config") or {}
    if config.get("eagle_aux_hidden_state_layer_ids"):
        taps = tuple(config["eagle_aux_hidden_state_layer_ids"])
    elif eagle_config.get("eagle_aux_hidden_state_layer_ids"):  # SpecForge: the outputs of these layers
        taps = tuple(j + 1 for j in eagle_config["eagle_aux_hidden_state_layer_ids"])
    else:
        taps = default_taps(target.n_layers)
    tap_norms = None
    if config.get("norm_before_fc") or eagle_config.get("norm_before_fc"):
        tap_norms = [need("input_norm.weight")]
    elif config.get("fc_norm"):
        tap_norms = [need(f"fc_norm.{i}.weight") for i in range(len(taps))]
    draft_ids = None
    if "d2t" in t:
        offsets = t["d2t"].long()
        draft_ids = torch.arange(len(offsets)) + offsets
    # speculators (and vLLM reading its configs) take a missing norm_before_residual as true
    w = Eagle3Weights(fmt, cfg, layer, need("fc.weight"), need("norm.weight"), need("lm_head.weight"), draft_ids,
                      taps, bool(config.get("norm_before_residual", fmt == "speculators")),
                      t["embed_tokens.weight"].float() if "embed_tokens.weight" in t else None, tap_norms,
                      # SpecForge's norm_output only says lm_head reads norm(o), which every format does
                      bool(config.get("norm_output")) and fmt in ("vllm", "speculators"))
    check_fits(path, w, target)
    return w


def check_fits(path: Path, w: Eagle3Weights, target: ModelConfig) -> None:
    """One clear line for the first thing that shows the head belongs to another model."""
    H, c = target.dim, w.cfg
    other = "this head belongs to another model"
    if c.dim != H:
        raise BackendError(f"{path}: the head's hidden size is {c.dim}, its target's {H}; {other}")
    if c.vocab_size != target.vocab_size:
        raise BackendError(f"{path}: the head's vocabulary is {c.vocab_size} tokens, its target's "
                           f"{target.vocab_size}; {other}")
    if not any(w.taps) or any(not 0 <= j < target.n_layers for j in w.taps):
        raise BackendError(f"{path}: tap layer ids {list(w.taps)} do not fit a target of {target.n_layers} layers "
                           f"(each 0..{target.n_layers - 1}, the input of that layer, and one past the embedding); {other}")
    want = {"fc": (H, len(w.taps) * H), "norm": (H,), "hidden_norm": (H,), "attn_norm": (H,), "mlp_norm": (H,),
            "q": (c.n_heads * c.head_dim, 2 * H), "k": (c.n_kv_heads * c.head_dim, 2 * H),
            "v": (c.n_kv_heads * c.head_dim, 2 * H), "o": (H, c.n_heads * c.head_dim), "lm_head_in": (H,)}
    have = {"fc": w.fc, "norm": w.norm, "lm_head_in": w.lm_head[0]} | w.layer
    for key, shape in want.items():
        if tuple(have[key].shape) != shape:
            raise BackendError(f"{path}: EAGLE-3 tensor '{key}' has shape {tuple(have[key].shape)}, a head for "
                               f"this target needs {shape} (hidden {H}, {len(w.taps)} taps); {other}")
    if w.draft_ids is not None:
        ids = w.draft_ids
        if len(ids) != len(w.lm_head) or int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size:
            raise BackendError(f"{path}: d2t maps the draft vocabulary ({len(w.lm_head)} tokens) to ids outside "
                               f"the target's {target.vocab_size}; {other}")
    elif len(w.lm_head) != target.vocab_size:
        raise BackendError(f"{path}: lm_head has {len(w.lm_head)} rows but the head has no d2t to map them to "
                           f"the target's {target.vocab_size} tokens; download the head again")
    norms = [tuple(n.shape) for n in w.tap_norms or []]
    if norms and norms != [(len(w.taps) * H,)] and norms != [(H,)] * len(w.taps):
        raise BackendError(f"{path}: the norms over the taps have shapes {norms}, a head for this target needs "
                           f"{[(len(w.taps) * H,)]} or {[(H,)] * len(w.taps)}; {other}")
    if w.embed is not None and tuple(w.embed.shape) != (target.vocab_size, H):
        raise BackendError(f"{path}: embed_tokens has shape {tuple(w.embed.shape)}, the target's embedding is "
                           f"{(target.vocab_size, H)}; {other}")


class Eagle3Head:
    """The head on its target: fuse the taps (`fuse`), run entries (`forward`), read logits of
    the layer's outputs (`greedy`, `vocab_logits`, `logits`). Its KV cache keeps entries
    0..start+K-1, so rolling back is starting lower."""

    def __init__(self, w: Eagle3Weights, target: Transformer, max_len: int):
        self.target, self.cfg = target, w.cfg
        self.taps = w.taps
        # the input of layer j is the output of layer j - 1; of layer 0, the token's embedding
        self.hidden_layers = tuple(sorted({j - 1 for j in w.taps if j > 0}))
        dev, dtype = target.device, target.dtype
        int4 = target.runs_int4  # beside an int4 target its matrices run on the same kernel
        body = {k: v for k, v in w.layer.items() if k != "hidden_norm"}

        def linear(m: Tensor) -> Linear:
            return int4_if_fits(m, dtype, dev) if int4 else Linear(m.to(dev, dtype).contiguous())

        eps = self.cfg.norm_eps
        self.fc = linear(w.fc)
        self.tap_norms = [RMSNorm(n.to(dev), eps) for n in w.tap_norms or []]
        self.feed_normed = w.feed_normed
        self.hidden_norm = RMSNorm(w.layer["hidden_norm"].to(dev), eps)
        # the layer's input norm is EAGLE-3's `input_layernorm`, which normalises the token embedding
        self.layer = decoder_layer(self.cfg, build_layer(quantize_layer(body) if int4 else body, dtype, int4, dev))
        self.norm = RMSNorm(w.norm.to(dev), eps)
        self.norm_before_residual = w.norm_before_residual
        self.embed = target.embed if w.embed is None else w.embed.to(dev)
        self.cache = KVCache(self.cfg, max_len, target.cache_dtype, dev)
        self.rope_cos, self.rope_sin = rope_tables(rope_inv_freq(self.cfg), max_len, dev, target.rope_dtype)
        ids = None if w.draft_ids is None else w.draft_ids.to(dev)
        self.out = VocabHead(linear(w.lm_head), ids, target.cfg.vocab_size, dtype)
        self.dtype = dtype

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def fuse(self, hidden: dict[int, Tensor], tokens: Tensor) -> Tensor:
        """f [n, H] for n positions: the target's hidden states there (`hidden_layers`) and their
        tokens [n] (tap 0 is their embedding)."""
        taps = [hidden[j - 1].float() if j else self.target.embed[tokens].float() for j in self.taps]
        if len(self.tap_norms) == len(taps) > 1:
            taps = [norm(x) for norm, x in zip(self.tap_norms, taps)]
        x = torch.cat(taps, -1)
        if len(self.tap_norms) == 1:
            x = self.tap_norms[0](x)
        return self.fc(x.to(self.dtype)).float()

    @torch.inference_mode()
    def forward(self, features: Tensor, next_tokens: Tensor, start: int) -> Tensor:
        """features [K, H] (fused taps, or the layer's own earlier output), next_tokens [K]: entries
        start..start+K-1. Returns what the next step is fed: the layer's outputs o [K, H] (or norm(o)
        with `feed_normed`); `greedy` and the logits take it as it is."""
        K = features.shape[0]
        h = self.hidden_norm(features.float())
        residual = h if self.norm_before_residual else features.float()
        x = torch.cat([self.layer.attn_norm(self.embed[next_tokens].float()), h], -1).to(self.dtype)
        attend, write = entries_attention(self.cache, start, K)
        a = self.layer.attention(x, attend, self.rope_cos[write], self.rope_sin[write], self.dtype)
        o = self.layer.feed_forward(residual + a, self.dtype)
        return self.norm(o) if self.feed_normed else o

    def _normed(self, o: Tensor) -> Tensor:
        return o if self.feed_normed else self.norm(o)

    def vocab_logits(self, o: Tensor) -> tuple[Tensor, Tensor | None]:
        return self.out.vocab_logits(self._normed(o))

    def greedy(self, o: Tensor) -> Tensor:
        return self.out.greedy(self._normed(o))

    def logits(self, o: Tensor) -> Tensor:
        return self.out.logits(self._normed(o))

    def reset(self) -> None:
        self.cache.length = 0
