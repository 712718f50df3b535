"""MTP / nextn heads: one extra decoder layer that predicts the token after next.

Entry t of the head combines the target's hidden state at position t with the embedding of the
token at t+1 and predicts the token at t+2:

    u = proj(cat(embed_norm(embed(x[t+1])), hidden_norm(h[t])))   # order per layout
    g = final_norm(decoder_layer(u))                               # attends to entries 0..t
    logits = target_head(g)

For deeper drafts the head's own `g` stands in for the target's hidden state. Embedding and LM
head are always the target's. Three public layouts (see ../shared/reference, section 2):

- deepseek  (DeepSeek-V3, GLM-4.5): `model.layers.{N+i}.{enorm,hnorm,eh_proj,shared_head.norm}`
            after the N main layers; concat [embedding, hidden].
- qwen3_next (Qwen3-Next, Qwen3.5): `mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm}`,
            `mtp.layers.{i}.*`; concat [embedding, hidden]; zero-centred norms (weight 1 + w).
- mimo      (Xiaomi MiMo): `model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,input_proj,
            final_layernorm}`; concat [hidden, embedding].

The decoder layer inside is read with the main model's layer names, its MLP dense or routed experts
as the target's (moe_weights.py: GLM-4.5's and Qwen3-Next / Qwen3.5-MoE's heads); what the engine
cannot run (latent attention) is named in a clear error.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..base import BackendError
from ..weight_files import open_safetensors
from .config import ModelConfig, read_hf_json
from .draft_vocab import VocabHead
from .int4 import int4_if_fits, quantize_layer
from .layers import RMSNorm, decoder_layer, rope_tables
from .linear import Linear
from .model import KVCache, Transformer, entries_attention
from .moe_weights import TensorReader, read_moe_layer
from .weights import HF_LAYER_NAMES, LAYER_KEYS, build_layer, drafting_head, safetensors_files

DRAFT_VOCAB = "specchat.draft_vocab"  # optional int32 tensor: the token ids the head may propose


@dataclass(frozen=True)
class Layout:
    name: str
    models: str
    embed_first: bool
    zero_centred: bool

    def names(self, i: int, n_layers: int, prefix: str = "model.") -> dict[str, str]:
        """Tensor names of MTP layer i: its four own tensors and the prefix of its decoder layer."""
        if self.name == "deepseek":
            p = f"{prefix}layers.{n_layers + i}."
            return {"embed_norm": p + "enorm.weight", "hidden_norm": p + "hnorm.weight",
                    "proj": p + "eh_proj.weight", "final_norm": p + "shared_head.norm.weight", "layer": p}
        if self.name == "qwen3_next":
            return {"embed_norm": "mtp.pre_fc_norm_embedding.weight", "hidden_norm": "mtp.pre_fc_norm_hidden.weight",
                    "proj": "mtp.fc.weight", "final_norm": "mtp.norm.weight", "layer": f"mtp.layers.{i}."}
        p = f"{prefix}mtp_layers.{i}."
        return {"embed_norm": p + "token_layernorm.weight", "hidden_norm": p + "hidden_layernorm.weight",
                "proj": p + "input_proj.weight", "final_norm": p + "final_layernorm.weight", "layer": p}


LAYOUTS = {
    "deepseek": Layout("deepseek", "DeepSeek-V3 / GLM-4.5", embed_first=True, zero_centred=False),
    "qwen3_next": Layout("qwen3_next", "Qwen3-Next / Qwen3.5", embed_first=True, zero_centred=True),
    "mimo": Layout("mimo", "MiMo", embed_first=False, zero_centred=False),
}
# tensors some layouts store although they are the target's own (shared) embedding and head
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


@dataclass
class MtpWeights:
    layout: Layout
    layers: list[dict[str, Tensor]]  # float32: embed_norm, hidden_norm, proj, final_norm + decoder layer keys
    hidden_source: str | None = None  # "post_norm" / "pre_norm" if the checkpoint says which it was trained on
    draft_vocab: Tensor | None = None


def detect_layout(names: set[str], n_layers: int, prefix: str = "model.") -> Layout | None:
    if "mtp.fc.weight" in names:
        return LAYOUTS["qwen3_next"]
    if any(n.startswith(prefix + "mtp_layers.") for n in names):
        return LAYOUTS["mimo"]
    if any(re.fullmatch(re.escape(prefix) + r"layers\.\d+\.eh_proj\.weight", n) for n in names):
        return LAYOUTS["deepseek"]
    return None


def unsupported_main_model(config: dict) -> str | None:
    """Why the torch engine cannot run this checkpoint's main model, or None."""
    c = config.get("text_config", config)
    why = []
    if c.get("kv_lora_rank") or c.get("q_lora_rank"):
        why.append("multi-head latent attention")
    other = sorted({t for t in c.get("layer_types") or [] if t not in ("full_attention", "attention", "linear_attention")})
    if other:
        why.append(f"{other[0]} layers")
    if not why:
        return None
    return f"{c.get('model_type', 'this model')} uses {' and '.join(why)}, which the torch engine does not run"


def read_mtp(path: Path, cfg: ModelConfig) -> MtpWeights:
    """The MTP layers in `path` (the target's own checkpoint, or a separate head directory), read
    and checked against the target's shape `cfg`. Raises BackendError naming what is wrong."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        raise BackendError(f"{path}: a GGUF's MTP (nextn) layers are read by gguf_mtp.read_any_mtp, not here")
    if not (path / "config.json").exists():
        raise BackendError(f"{path}: no config.json; an MTP head is a safetensors directory with its config")
    config = read_hf_json(path)
    where = safetensors_files(path)
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in where) else "model."
    layout = detect_layout(set(where), cfg.n_layers, prefix)
    if layout is None:
        raise BackendError(f"{path}: no MTP head found (looked for the DeepSeek/GLM `eh_proj`, Qwen3-Next `mtp.fc` "
                           "and MiMo `mtp_layers` layouts); this checkpoint has no built-in MTP — train one with "
                           "`specchat train mtp`")
    c = config.get("text_config", config)
    count = c.get("num_nextn_predict_layers") or c.get("mtp_num_hidden_layers") or 0
    if not count:  # count what is there
        while layout.names(count, cfg.n_layers, prefix)["proj"] in where or (
                layout.name == "qwen3_next" and f"mtp.layers.{count}.input_layernorm.weight" in where):
            count += 1
    if layout.name == "deepseek":
        first = min(int(m.group(1)) for n in where
                    if (m := re.fullmatch(re.escape(prefix) + r"layers\.(\d+)\.eh_proj\.weight", n)))
        if first != cfg.n_layers:
            raise BackendError(f"{path}: the MTP layer is model.layers.{first} but the target has {cfg.n_layers} "
                               f"layers (it must be model.layers.{cfg.n_layers}); this head belongs to another model")

    files: dict[Path, object] = {}

    def get(name: str) -> Tensor:
        if name not in where:
            raise BackendError(f"{path}: MTP tensor {name} missing ({layout.models} layout)")
        f = where[name]
        if f not in files:
            files[f] = open_safetensors(f)
        return files[f].get_tensor(name).float()

    layers = []
    experts = TensorReader(where)
    for i in range(count):
        names = layout.names(i, cfg.n_layers, prefix)
        lp = names["layer"]
        unknown = sorted(n[len(lp):] for n in where if n.startswith(lp))
        sparse = any(n.startswith(("mlp.experts.", "mlp.gate.")) for n in unknown)
        if sparse and cfg.moe is None:
            raise BackendError(f"{path}: MTP layer {i} ({layout.models} layout) has a mixture-of-experts MLP but its "
                               f"target ({cfg.arch}) has no experts; this head belongs to another model")
        if any(n.startswith("self_attn.kv_a_proj") or n.startswith("self_attn.q_a_proj") for n in unknown):
            raise BackendError(f"{path}: MTP layer {i} ({layout.models} layout) uses multi-head "
                               "latent attention, which the torch engine does not run; serve this model with "
                               "vLLM or SGLang (backend: openai)")
        layer = {k: get(names[k]) for k in ("embed_norm", "hidden_norm", "proj", "final_norm")}
        for key, suffix in HF_LAYER_NAMES.items():
            if sparse and key in ("gate", "up", "down"):
                continue
            if lp + suffix in where:
                layer[key] = get(lp + suffix)
            elif key in LAYER_KEYS:
                raise BackendError(f"{path}: MTP tensor {lp + suffix} missing ({layout.models} layout)")
        if sparse:  # routed experts, read as the main layers' (moe_weights.py)
            layer |= read_moe_layer(get, where, experts, lp, cfg.moe, cfg.dim, str(path), f"MTP layer {i}")
        if layout.zero_centred:
            for key in ("embed_norm", "hidden_norm", "final_norm", "attn_norm", "mlp_norm", "q_norm", "k_norm"):
                if key in layer:
                    layer[key] = layer[key] + 1.0
        check_mtp_shapes(path, i, layer, cfg)
        layers.append(layer)
    extra = c.get("specchat_mtp", {})
    vocab = None
    if DRAFT_VOCAB in where:
        vocab = get(DRAFT_VOCAB).long()
        if vocab.numel() == 0 or int(vocab.max()) >= cfg.vocab_size or int(vocab.min()) < 0:
            raise BackendError(f"{path}: {DRAFT_VOCAB} holds ids outside the target's vocabulary "
                               f"({cfg.vocab_size}); this head belongs to another model")
    return MtpWeights(layout, layers, extra.get("hidden_source"), vocab)


def check_mtp_shapes(path: Path, i: int, layer: dict[str, Tensor], cfg: ModelConfig) -> None:
    """MTP layer i's tensors (short names, norms as applied) against the target's shape `cfg`."""
    d, hd = cfg.dim, cfg.head_dim
    gated = 2 if cfg.output_gate else 1  # Qwen3-Next / Qwen3.5: q_proj also yields the output gate
    if layer["q"].shape[0] == 2 * cfg.n_heads * hd and not cfg.output_gate:
        raise BackendError(f"{path}: MTP layer {i} uses gated attention (q_proj also yields an output gate) "
                           f"but its target ({cfg.arch}) does not; this head belongs to another model")
    want = {"embed_norm": (d,), "hidden_norm": (d,), "final_norm": (d,), "proj": (d, 2 * d),
            "q": (gated * cfg.n_heads * hd, d), "k": (cfg.n_kv_heads * hd, d), "v": (cfg.n_kv_heads * hd, d),
            "o": (d, cfg.n_heads * hd), "attn_norm": (d,), "mlp_norm": (d,)}
    for key, shape in want.items():
        if tuple(layer[key].shape) != shape:
            raise BackendError(f"{path}: MTP layer {i} tensor '{key}' has shape {tuple(layer[key].shape)}, "
                               f"the target needs {shape} (hidden {d}); this head belongs to another model")
    if "experts" not in layer and (layer["gate"].shape != layer["up"].shape
                                   or layer["down"].shape[::-1] != layer["gate"].shape):
        raise BackendError(f"{path}: MTP layer {i} MLP shapes do not fit together")


class MtpHead:
    """The MTP layers on the target's embedding and head, with their own KV caches.

    `forward(hidden, next_tokens, start)` runs entries start.. (one per row) through layer
    `layer`; the cache keeps entries 0..start+K-1, so rolling back is starting lower."""

    def __init__(self, w: MtpWeights, target: Transformer, max_len: int):
        self.weights_layout = w.layout
        self.embed_first = w.layout.embed_first
        self.target = target
        dev, dtype = target.device, target.dtype
        # one (gated, on Qwen3.5 / Qwen3-Next) full-attention layer, whatever the target's layers are
        self.cfg: ModelConfig = replace(target.cfg, n_layers=1, layer_types=(), linear=None)
        eps = self.cfg.norm_eps
        # on an int4 target the head's matrices run on the same int4 kernel (int4.int4_if_fits)
        int4 = target.runs_int4
        self.layers = []
        for layer in w.layers:
            body = {k: v for k, v in layer.items() if k not in ("embed_norm", "hidden_norm", "proj", "final_norm")}
            proj = layer["proj"]
            self.layers.append({
                "embed_norm": RMSNorm(layer["embed_norm"].to(dev), eps),
                "hidden_norm": RMSNorm(layer["hidden_norm"].to(dev), eps),
                "final_norm": RMSNorm(layer["final_norm"].to(dev), eps),
                "layer": decoder_layer(self.cfg, build_layer(quantize_layer(body) if int4 else body, dtype, int4, dev,
                                                             moe=self.cfg.moe)),
                "proj": int4_if_fits(proj, dtype, dev) if int4 else Linear(proj.to(dev, dtype).contiguous()),
                "cache": KVCache(self.cfg, max_len, target.cache_dtype, dev),
            })
        self.dtype = dtype
        self.rope_cos, self.rope_sin = rope_tables(target.inv_freq, max_len, dev, target.rope_dtype)
        vocab = None if w.draft_vocab is None else w.draft_vocab.to(dev)
        head_w = target.head.weight
        if vocab is not None and head_w is not None:
            sub = head_w[vocab]
            head = int4_if_fits(sub, dtype, dev) if int4 else Linear(sub.to(dtype).contiguous())
        else:
            vocab, head = None, drafting_head(target)
        self.out = VocabHead(head, vocab, target.cfg.vocab_size, dtype)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def max_len(self) -> int:
        return self.layers[0]["cache"].max_len

    def vocab_logits(self, g: Tensor) -> tuple[Tensor, Tensor | None]:
        """Logits over the draft vocabulary and its token ids (None: the full vocabulary)."""
        return self.out.vocab_logits(g)

    def greedy(self, g: Tensor) -> Tensor:
        """The most likely token per row, without spreading logits over the full vocabulary."""
        return self.out.greedy(g)

    def logits(self, g: Tensor) -> Tensor:
        """Logits over the full vocabulary (-inf outside the draft vocabulary, if the head has one)."""
        return self.out.logits(g)

    @torch.inference_mode()
    def forward(self, hidden: Tensor, next_tokens: Tensor, start: int, layer: int = 0) -> Tensor:
        """hidden [K, dim] (target's, or the head's own g), next_tokens [K]: entries start..start+K-1.
        Returns g [K, dim], the head's final-normed hidden states (feed `logits`)."""
        L = self.layers[layer]
        K = hidden.shape[0]
        e = L["embed_norm"](self.target.embed[next_tokens].float())
        h = L["hidden_norm"](hidden.float())
        x = L["proj"]((torch.cat([e, h], -1) if self.embed_first else torch.cat([h, e], -1)).to(self.dtype)).float()
        attend, write = entries_attention(L["cache"], start, K)
        x = L["layer"](x, attend, self.rope_cos[write], self.rope_sin[write], self.dtype)
        return L["final_norm"](x)

    def reset(self) -> None:
        for L in self.layers:
            L["cache"].length = 0
