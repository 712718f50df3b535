"""specchat's EAGLE-3 heads, DFlash and DSpark drafters as the GGUF files llama.cpp's
`draft-eagle3`, `draft-dflash` and `draft-dspark` load (`--spec-draft-model`).

The layout is the one llama.cpp's own converter writes (convert_hf_to_gguf.py of the vendored
llama.cpp: conversion/llama.py for `LlamaForCausalLMEagle3`, conversion/qwen.py for
`DFlashDraftModel`; names from its gguf-py constants, which the `gguf` package on PyPI does not
have yet), so a file written here and the converter's agree in every tensor name, shape and
metadata key (tests/llamaserver/test_drafter_export.py). It is written here rather than by the
converter because the converter wants the target as a Hugging Face directory for its tokenizer,
and specchat's llama-server targets are GGUF files: the tokenizer is copied from the target's GGUF
instead, key for key, as to_gguf.py does for draft models.

What llama.cpp reads:
- EAGLE-3 (src/models/eagle3.cpp): `eagle3.target_layers`, the target layers whose *input* is
  tapped (llama_set_embeddings_layer_inp), which are specchat's (vLLM's) tap ids as they are;
  `fc`, one Llama decoder layer whose Q/K rows are permuted for llama.cpp's rotary pairs (attention
  input 2H), `hidden_norm` as `attn_norm_2`, the draft vocabulary's `output` and `d2t` as absolute
  target ids. The embedding is the target's unless the head has its own.
- DFlash (src/models/dflash.cpp): `dflash.target_layers`, again layer inputs, so the released
  `target_layer_ids` (layer outputs) plus one; `fc`, `hidden_norm` as `enc.output_norm`, Qwen3
  layers (NeoX rotary: no permutation, q/k norms), `dflash.block_size`, the mask token as
  `tokenizer.ggml.mask_token_id`; the target's embedding and LM head.
- DSpark (the same file, build_dspark_markov_head in dflash.cpp): DFlash's plus `markov_w1.weight`
  and `markov_w2.weight` (DeepSpec's [vocab, rank] matrices as they are: ggml {rank, vocab}),
  `conf_proj.{weight,bias}` where the drafter has a confidence head (else
  `dflash.has_confidence_head` false, so `--spec-draft-p-min` is refused in one line by llama.cpp),
  and `dflash.sample_from_anchor` from the drafter's config (false for specchat's: drafts from slot 1).

Matrices are F16 for a drafter saved in 16 bits (as the converter's default `--outtype f16`), F32
for one saved in 32; norms F32.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..base import BackendError
from ..weight_files import gguf_reader, open_safetensors
from .to_gguf import copy_tokenizer, permute_rows

DRAFTERS = ("eagle3", "dflash", "dspark")
# short layer names (backends/native/weights.py) -> llama.cpp's block tensor names
LAYER_NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate",
               "up": "ffn_up", "down": "ffn_down", "attn_norm": "attn_norm", "mlp_norm": "ffn_norm",
               "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "hidden_norm": "attn_norm_2"}


@dataclass(frozen=True)
class TargetShape:
    """What a drafter must fit in its target, read from the target's GGUF (any architecture)."""

    dim: int
    n_layers: int
    vocab_size: int


def target_shape(reader, where: str) -> TargetShape:
    def field(key: str):
        f = reader.fields.get(key)
        if f is None:
            raise BackendError(f"{where}: no {key} in its metadata; is it a model GGUF?")
        return f.contents()

    arch = field("general.architecture")
    return TargetShape(int(field(f"{arch}.embedding_length")), int(field(f"{arch}.block_count")),
                       len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields
                       else int(field(f"{arch}.vocab_size")))


def saved_dtype(path: Path) -> str:
    """F16 for a drafter saved in 16 bits (the converter's default type; llama.cpp's CPU BF16
    matrices ran DFlash's blocks at 2 tok/s here against F16's 60), F32 for one saved in 32."""
    for f in sorted(path.glob("*.safetensors")):
        with open_safetensors(f) as st:
            for name in st.keys():
                dtype = st.get_slice(name).get_dtype()
                if dtype in ("BF16", "F16", "F32"):
                    return "F32" if dtype == "F32" else "F16"
    return "F32"


class Writer:
    """A GGUF being written to `dest` (through a `.part` file, so a broken export leaves nothing)."""

    def __init__(self, dest: Path, arch: str, matrix_type: str):
        import gguf

        self.gguf, self.dest = gguf, Path(dest)
        self.part = self.dest.with_name(self.dest.name + ".part")
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self.w = gguf.GGUFWriter(str(self.part), arch)
        self.arch = arch
        self.qtype = getattr(gguf.GGMLQuantizationType, matrix_type)

    def key(self, name: str, value) -> None:
        """`{arch}.name` = value, typed as llama.cpp reads it."""
        T, key = self.gguf.GGUFValueType, f"{self.arch}.{name}"
        if isinstance(value, bool):
            self.w.add_bool(key, value)
        elif isinstance(value, int):
            self.w.add_uint32(key, value)
        elif isinstance(value, float):
            self.w.add_float32(key, value)
        elif value and isinstance(value[0], bool):
            self.w.add_key_value(key, list(value), T.ARRAY, sub_type=T.BOOL)
        else:
            self.w.add_array(key, list(value))

    def attention(self, m, rope_theta: float) -> None:
        """The decoder layers' shape, under the keys the converter's TextModel writes."""
        w = self.w
        w.add_context_length(m.max_position)
        w.add_embedding_length(m.dim)
        w.add_feed_forward_length(m.ffn_dim)
        w.add_head_count(m.n_heads)
        w.add_head_count_kv(m.n_kv_heads)
        w.add_rope_freq_base(float(rope_theta))
        w.add_layer_norm_rms_eps(float(m.norm_eps))
        w.add_key_length(m.head_dim)
        w.add_value_length(m.head_dim)

    def matrix(self, name: str, a: torch.Tensor) -> None:
        a = np.ascontiguousarray(a.float().numpy())
        if self.qtype == self.gguf.GGMLQuantizationType.F32:
            self.w.add_tensor(name, a)
        else:
            self.w.add_tensor(name, self.gguf.quants.quantize(a, self.qtype), raw_dtype=self.qtype)

    def vector(self, name: str, a: torch.Tensor) -> None:
        self.w.add_tensor(name, np.ascontiguousarray(a.float().numpy()))  # norms stay F32, as the converter's

    def ids(self, name: str, a: torch.Tensor) -> None:
        self.w.add_tensor(name, np.ascontiguousarray(a.to(torch.int64).numpy()),
                          raw_dtype=self.gguf.GGMLQuantizationType.I64)

    def finish(self) -> Path:
        try:
            self.w.write_header_to_file()
            self.w.write_kv_data_to_file()
            self.w.write_tensors_to_file()
        finally:
            self.w.close()
        os.replace(self.part, self.dest)
        return self.dest


def eagle3_to_gguf(head_dir: Path, target_gguf: Path, dest: Path) -> Path:
    """An EAGLE-3 head directory (any of the public layouts specchat reads) as llama.cpp's eagle3 GGUF."""
    from ..native.eagle3 import read_eagle3

    head_dir, target = Path(head_dir), gguf_reader(target_gguf)
    shape = target_shape(target, str(target_gguf))
    # read_eagle3 checks the head against the target (hidden size, vocabulary, taps) in one line each
    h = read_eagle3(head_dir, shape)
    if h.tap_norms is not None and len(h.tap_norms) != 1:
        raise BackendError(f"{head_dir}: the head normalises each tap on its own (fc_norm), which llama.cpp's "
                           "eagle3 has no tensor for; it cannot run on llama-server")
    if h.feed_normed:
        raise BackendError(f"{head_dir}: the head feeds norm(o) to its next step (norm_output), which llama.cpp's "
                           "eagle3 does not; it cannot run on llama-server")
    m = h.cfg
    out = Writer(dest, "eagle3", saved_dtype(head_dir))
    out.w.add_name(f"specchat EAGLE-3 head ({head_dir.name})")
    out.key("target_layers", [int(j) for j in h.taps])
    out.key("target_hidden_size", shape.dim)
    out.key("norm_before_residual", bool(h.norm_before_residual))
    out.key("norm_before_fc", h.tap_norms is not None)
    out.key("block_count", 1)
    out.attention(m, m.rope_theta)
    out.key("vocab_size", shape.vocab_size)
    out.key("rope.dimension_count", m.head_dim)
    copy_tokenizer(out.w, target)
    out.matrix("fc.weight", h.fc)
    if h.tap_norms is not None:
        out.vector("enc.output_norm.weight", h.tap_norms[0])
    out.matrix("output.weight", h.lm_head)
    out.vector("output_norm.weight", h.norm)
    if h.embed is not None:
        out.matrix("token_embd.weight", h.embed)
    for key, t in h.layer.items():
        if key in ("q", "k"):
            t = torch.from_numpy(permute_rows(t.numpy(), m.n_heads if key == "q" else m.n_kv_heads))
        (out.vector if t.dim() == 1 else out.matrix)(f"blk.0.{LAYER_NAMES[key]}.weight", t)
    if h.draft_ids is not None:
        out.ids("d2t", h.draft_ids)  # absolute target ids, as the converter writes them
    return out.finish()


def dflash_to_gguf(drafter_dir: Path, target_gguf: Path, dest: Path, dspark: bool = False) -> Path:
    """A DFlash drafter directory (z-lab's released layout, as `specchat train dflash` writes it) as
    llama.cpp's dflash GGUF; with `dspark`, a DSpark drafter (DFlash's plus the Markov head)."""
    from ..speculative.dflash import SLIDING, DFlashConfig, fresh_tensors
    from ..speculative import dspark as ds
    from ..native.weights import HF_LAYER_NAMES

    drafter_dir, target = Path(drafter_dir), gguf_reader(target_gguf)
    shape = target_shape(target, str(target_gguf))
    config = drafter_dir / "config.json"
    try:
        c = DFlashConfig.from_hf(json.loads(config.read_text()), str(config))
    except (OSError, ValueError) as e:
        raise BackendError(f"{drafter_dir}: no readable config.json ({e}); expected a DFlash drafter directory") from None
    m = c.layer
    if m.dim != shape.dim or m.vocab_size != shape.vocab_size:
        raise BackendError(f"{drafter_dir}: a DFlash drafter of hidden size {m.dim} and vocabulary {m.vocab_size}; "
                           f"the target's are {shape.dim} and {shape.vocab_size}: not a drafter for this target")
    if any(not 0 <= i < shape.n_layers for i in c.target_layer_ids):
        raise BackendError(f"{drafter_dir}: target_layer_ids {c.target_layer_ids} do not fit a target of "
                           f"{shape.n_layers} layers: not a drafter for this target")
    if m.rope_scaling:
        raise BackendError(f"{drafter_dir}: rope scaling {m.rope_scaling.get('rope_type', '')!r} is not exported "
                           "to llama.cpp's dflash here")
    want = fresh_tensors(c)
    markov_names = {ds.W1, ds.W2, ds.CONF_W, ds.CONF_B} if dspark else set()
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(drafter_dir.glob("*.safetensors")):
        with open_safetensors(f) as st:
            tensors.update({n: st.get_tensor(n) for n in st.keys() if n in want or n in markov_names})
    markov = ds.markov_from({n: tensors[n] for n in markov_names if n in tensors}, c, str(drafter_dir)) if dspark else None
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise BackendError(f"{drafter_dir}: tensor {missing[0]} missing ({len(missing)} in all); is this a DFlash drafter?")
    out = Writer(dest, "dflash", saved_dtype(drafter_dir))
    out.w.add_name(f"specchat {'DSpark' if dspark else 'DFlash'} drafter ({drafter_dir.name})")
    out.key("block_count", m.n_layers)
    out.attention(m, m.rope_theta)
    out.key("block_size", c.block_size)
    out.key("target_layers", [i + 1 for i in c.target_layer_ids])  # layer outputs -> the next layer's input
    if SLIDING in c.layer_types:
        out.key("attention.sliding_window", int(c.sliding_window))
        out.key("attention.sliding_window_pattern", [t == SLIDING for t in c.layer_types])
    copy_tokenizer(out.w, target)
    out.w.add_mask_token_id(c.mask_token_id)
    out.matrix("fc.weight", tensors["fc.weight"])
    out.vector("enc.output_norm.weight", tensors["hidden_norm.weight"])
    out.vector("output_norm.weight", tensors["norm.weight"])
    for i in range(m.n_layers):
        for key, hf in HF_LAYER_NAMES.items():
            name = f"layers.{i}.{hf}"
            if name in tensors:
                t = tensors[name]
                (out.vector if t.dim() == 1 else out.matrix)(f"blk.{i}.{LAYER_NAMES[key]}.weight", t)
    if markov is not None:
        anchor = (json.loads(config.read_text()).get("dflash_config") or {}).get("sample_from_anchor", True)
        out.key("sample_from_anchor", bool(anchor))
        out.key("has_confidence_head", markov.conf_w is not None)
        out.matrix("markov_w1.weight", tensors[ds.W1])
        out.matrix("markov_w2.weight", tensors[ds.W2])
        if markov.conf_w is not None:
            out.matrix("conf_proj.weight", tensors[ds.CONF_W])
            out.vector("conf_proj.bias", tensors[ds.CONF_B].reshape(1))
    return out.finish()


def export(kind: str, drafter_dir: Path, target_gguf: Path, dest: Path) -> Path:
    """`kind` (eagle3 or dflash) drafter directory -> its llama.cpp GGUF at dest."""
    if kind not in DRAFTERS:
        raise BackendError(f"llama.cpp's GGUF layouts here are for {', '.join(DRAFTERS)} drafters, not {kind!r}")
    if not Path(drafter_dir).is_dir():
        raise BackendError(f"{drafter_dir}: not a directory; an {kind} drafter is a directory with config.json "
                           "and its weights")
    if kind == "eagle3":
        return eagle3_to_gguf(drafter_dir, target_gguf, dest)
    return dflash_to_gguf(drafter_dir, target_gguf, dest, dspark=kind == "dspark")
