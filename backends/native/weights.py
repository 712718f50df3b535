"""Turning checkpoint tensors into a ready `Transformer`.

Loaders (Hugging Face safetensors here, GGUF in gguf_loader.py) produce a `Checkpoint`: the
config plus per-layer tensors under short names (q, k, v, o, gate, up, down, norms, biases).
A matrix is a float32 tensor, `QuantRows` (a GGUF's blocks as the file holds them: kquant.py) or
`Int4Rows` (a checkpoint directory's matrices quantized as they are read for `dtype: int4`:
memory_plan.py; a GGUF's Q4 blocks become them as their layer is built).
`build_model` fuses q/k/v and gate/up into single matmuls and casts to the compute dtype.
`HF_LAYER_NAMES` is the one map from those short names to Hugging Face tensor names; MTP heads,
DFlash drafters and the trainers' exports use it too.
"""
from __future__ import annotations

import re
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..base import BackendError
from ..weight_files import BrokenWeightFile, safetensors_header, safetensors_index
from . import argmax_head
from .config import COMPLETE, ModelConfig, MoeShape, read_hf_config
from .gated_delta import recurrent_layer
from .int4 import Int4Rows, Matrix, int4_linear, quantize_layer
from .kquant import QuantRows, float_embedding, head_on_tiles, is_q4
from .layers import DecoderLayer, decoder_layer
from .linear import Linear
from .matrix import as_linear
from .memory_plan import DENSE_COPY_MAX_BYTES, page_out, return_freed_memory
from .model import Transformer
from .moe_weights import MOE_MARKERS, TensorReader, build_moe, is_expert_tensor, moe_layer_names, read_moe_layer

LAYER_KEYS = ("q", "k", "v", "o", "gate", "up", "down", "attn_norm", "mlp_norm")
OPTIONAL_KEYS = ("q_bias", "k_bias", "v_bias", "q_norm", "k_norm", "attn_post_norm", "mlp_post_norm")
NORM_KEYS = ("q_norm", "k_norm", "attn_post_norm", "mlp_post_norm")  # optional norms (Qwen3's q/k, Gemma's post)


@dataclass
class Checkpoint:
    cfg: ModelConfig
    embed: Tensor
    norm: Tensor
    head: Matrix | None  # None: tied to the embedding
    layers: list[dict[str, Matrix]] = field(default_factory=list)
    source: str = ""


@contextmanager
def progress(label: str, total: int):
    """A transient rich progress bar on stderr; yields advance(n)."""
    if not sys.stderr.isatty():
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as p:
        task = p.add_task(label, total=total)
        yield lambda n=1: p.advance(task, n)


# ---- Hugging Face directories (safetensors, sharded or not) ----

HF_LAYER_NAMES = {
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight", "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
}


def hf_layer(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """A decoder layer's tensors under short names, from the Hugging Face names under `prefix`."""
    return {k: tensors[prefix + name] for k, name in HF_LAYER_NAMES.items() if prefix + name in tensors}


def hf_names(layer: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The inverse: short names to Hugging Face names under `prefix`."""
    return {prefix + HF_LAYER_NAMES[k]: v for k, v in layer.items()}


def layer_tensors(layer: DecoderLayer) -> dict[str, Tensor]:
    """A dense decoder layer's weights under short names, its fused matmuls split again (for exports)."""
    att = layer.attention
    q_rows = att.n_heads * att.head_dim * (2 if att.output_gate else 1)
    kv_rows = att.n_kv_heads * att.head_dim
    q, k, v = att.qkv.weight.split([q_rows, kv_rows, kv_rows])
    gate, up = layer.mlp.gate_up.weight.chunk(2)
    out = {"q": q, "k": k, "v": v, "o": att.o.weight, "gate": gate, "up": up, "down": layer.mlp.down.weight,
           "attn_norm": layer.attn_norm.weight, "mlp_norm": layer.mlp_norm.weight}
    if att.qkv.bias is not None:
        out["q_bias"], out["k_bias"], out["v_bias"] = att.qkv.bias.split([q_rows, kv_rows, kv_rows])
    if att.q_norm is not None:
        out["q_norm"], out["k_norm"] = att.q_norm.weight, att.k_norm.weight
    return out


def safetensors_files(path: Path) -> dict[str, Path]:
    """tensor name -> file holding it, every file's header checked against its size (weight_files.py)."""
    if (path / "model.safetensors.index.json").exists():
        out = safetensors_index(path)
        for name, f in out.items():
            if name not in safetensors_header(f).tensors:
                raise BrokenWeightFile(f, f"model.safetensors.index.json puts {name} in it, it does not hold it")
        return out
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise BackendError(f"{path}: no *.safetensors files; the torch engine reads safetensors checkpoints")
    return {name: f for f in files for name in safetensors_header(f).tensors}


# A Gated DeltaNet layer's tensors (Qwen3.5's split projections) under short names
HF_LINEAR_NAMES = {
    "qkv": "linear_attn.in_proj_qkv.weight", "z": "linear_attn.in_proj_z.weight",
    "b": "linear_attn.in_proj_b.weight", "a": "linear_attn.in_proj_a.weight",
    "conv": "linear_attn.conv1d.weight", "A_log": "linear_attn.A_log", "dt_bias": "linear_attn.dt_bias",
    "gate_norm": "linear_attn.norm.weight", "out": "linear_attn.out_proj.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
}
# Qwen3-Next stores q|k|v|z and b|a fused, grouped by key head (see `ungroup_qkvz`)
HF_FUSED_LINEAR = {"qkvz": "linear_attn.in_proj_qkvz.weight", "ba": "linear_attn.in_proj_ba.weight"}
ZERO_CENTRED_NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm")  # not the gated norm: it is applied as w
DENSE_MLP_KEYS = ("gate", "up", "down")
IN_PROJ_KEYS = ("qkv", "z", "b", "a")


def ungroup_qkvz(qkvz: Tensor, ba: Tensor, shape) -> dict[str, Tensor]:
    """Qwen3-Next's fused projections to Qwen3.5's split ones. Per key head the rows are
    [q dk | k dk | v r·dv | z r·dv] and [b r | a r] (r = value heads per key head)."""
    s, H = shape, qkvz.shape[-1]
    r = s.v_heads // s.k_heads
    g = qkvz.view(s.k_heads, 2 * s.k_dim + 2 * r * s.v_dim, H)
    q, k, v, z = g.split([s.k_dim, s.k_dim, r * s.v_dim, r * s.v_dim], dim=1)
    b, a = ba.view(s.k_heads, 2 * r, H).split([r, r], dim=1)
    flat = [t.reshape(-1, H) for t in (q, k, v, z, b, a)]
    return {"qkv": torch.cat(flat[:3]), "z": flat[3], "b": flat[4], "a": flat[5]}


def load_hf_dir(path: Path, int4: bool = False) -> Checkpoint:
    """A checkpoint directory's tensors, read a layer at a time (float32). `int4`: each layer's
    matrices that the 4-bit kernels take are quantized as the layer is read, and an untied
    embedding is kept in bfloat16 (memory_plan.py), so that a big model's float32 matrices never
    sit in memory together; routed experts are read later still, one at a time (build_model)."""
    cfg = read_hf_config(path)
    where = safetensors_files(path)
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in where) else "model."
    # an MTP head inside the checkpoint is read by backends/native/mtp.py when a profile asks for it
    where = {n: f for n, f in where.items() if not is_mtp_tensor(n, prefix, cfg.n_layers)}
    if cfg.moe is None:
        refuse_moe(path, where, prefix)
    vision = [n for n in where if n.startswith(("model.visual.", "visual."))]
    if vision:  # a multimodal checkpoint (Qwen3.5's published ones): specchat chats in text
        print(f"note: {path.name}: the vision tower ({len(vision)} tensors) is not loaded; specchat runs the "
              "text decoder", file=sys.stderr)
        where = {n: f for n, f in where.items() if not n.startswith(("model.visual.", "visual."))}
    reader = TensorReader(where)  # files opened once, tensors read when taken (experts: when built)
    used: set[str] = set()

    def take(name: str, required: bool = True) -> Tensor | None:
        if (name not in where or is_expert_tensor(name)) and required:
            raise BackendError(f"{path}: tensor {name} missing; is this a Llama/Qwen-style checkpoint?")
        used.add(name)
        return reader.get(name) if name in where else None

    layers = []
    with progress(f"loading {path.name}", cfg.n_layers) as advance:
        for i in range(cfg.n_layers):
            layers.append(_hf_layer(cfg, i, f"{prefix}layers.{i}.", take, where, reader, path, int4))
            advance()
    head = None if cfg.tie_embeddings else take("lm_head.weight", required=False)
    embed, norm = take(prefix + "embed_tokens.weight"), take(prefix + "norm.weight")
    if int4 and head is not None:  # its rows are widened when looked up; a tied one is the float32 head
        embed = embed.to(torch.bfloat16)
    if cfg.zero_centred:
        norm = norm + 1.0
    refuse_unknown(path, {n for n in where if not is_expert_tensor(n)} - used - {"lm_head.weight"}
                   | {n for n in where if is_expert_tensor(n) and not n.startswith(f"{prefix}layers.")})
    return Checkpoint(cfg, embed, norm, head, layers, source=str(path))


def _hf_layer(cfg: ModelConfig, i: int, p: str, take, where: dict, reader: TensorReader, path: Path,
              int4: bool) -> dict[str, Matrix]:
    """Decoder layer i's tensors under short names (`p`: its prefix), quantized where `int4`."""
    sparse = cfg.is_sparse(i)
    if cfg.is_linear(i):
        fused = p + HF_FUSED_LINEAR["qkvz"] in where
        names = {k: n for k, n in HF_LINEAR_NAMES.items() if not (fused and k in ("qkv", "z", "b", "a"))
                 and not (sparse and k in DENSE_MLP_KEYS)}
        layer = {k: take(p + n) for k, n in names.items()}
        if fused:
            layer |= ungroup_qkvz(take(p + HF_FUSED_LINEAR["qkvz"]), take(p + HF_FUSED_LINEAR["ba"]), cfg.linear)
        _check_linear(path, i, layer, cfg)
    else:
        layer = {k: take(p + n, k in LAYER_KEYS) for k, n in HF_LAYER_NAMES.items()
                 if not (sparse and k in DENSE_MLP_KEYS)}
    if sparse:
        layer |= read_moe_layer(take, where, reader, p, cfg.moe, cfg.dim, str(path), f"layer {i}")
    elif moe_layer_names(where, p):
        raise BackendError(f"{path}: layer {i} has a mixture-of-experts MLP ({moe_layer_names(where, p)[0]}) "
                           "where config.json places a dense one; the config does not match the weights")
    layer = {k: v for k, v in layer.items() if v is not None}
    if cfg.zero_centred:  # stored w, applied as 1 + w: folded in once here
        layer |= {k: layer[k] + 1.0 for k in ZERO_CENTRED_NORMS if k in layer}
    if not int4:
        return layer
    out = quantize_layer(layer)
    if cfg.is_linear(i) and not all(isinstance(out[k], Int4Rows) for k in IN_PROJ_KEYS):
        out |= {k: layer[k] for k in IN_PROJ_KEYS}  # one matmul (build_recurrent_layer): 4-bit only if all fit
    return out


def _check_linear(path: Path, i: int, layer: dict[str, Tensor], cfg: ModelConfig) -> None:
    """A linear-attention layer's tensors against the config's `linear_*` shape."""
    s, d = cfg.linear, cfg.dim
    want = {"qkv": (s.conv_dim, d), "z": (s.value_dim, d), "b": (s.v_heads, d), "a": (s.v_heads, d),
            "conv": (s.conv_dim, 1, s.conv_kernel), "A_log": (s.v_heads,), "dt_bias": (s.v_heads,),
            "gate_norm": (s.v_dim,), "out": (d, s.value_dim)}
    for key, shape in want.items():
        if tuple(layer[key].shape) != shape:
            raise BackendError(f"{path}: layer {i} ({HF_LINEAR_NAMES[key]}) has shape {tuple(layer[key].shape)}, "
                               f"config.json's linear_* keys give {shape}; {COMPLETE}")


def refuse_moe(path: Path, where: dict, prefix: str) -> None:
    """Mixture-of-experts tensors in a checkpoint whose config names no experts are named as such."""
    first = next((n for n in sorted(where) if n.startswith(prefix + "layers.") and any(m in n for m in MOE_MARKERS)),
                 None)
    if first is not None:
        layer = first[len(prefix):].split(".")[1]
        raise BackendError(f"{path}: layer {layer} has a mixture-of-experts MLP ({first}) but config.json names no "
                           "experts (n_routed_experts / num_experts / num_local_experts); the config does not match "
                           "the weights")


def is_mtp_tensor(name: str, prefix: str, n_layers: int) -> bool:
    """A tensor of a multi-token-prediction head: `mtp.*` (Qwen3-Next), `model.mtp_layers.*` (MiMo),
    or a layer appended after the main ones (DeepSeek-V3 / GLM-4.5)."""
    if name.startswith(("mtp.", prefix + "mtp_layers.")):
        return True
    m = re.match(re.escape(prefix) + r"layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= n_layers


def refuse_unknown(path: Path, names: set[str]) -> None:
    """Weights we would silently ignore (an o_proj bias, an MoE, an MTP head...) mean a different model."""
    names = {n for n in names if not n.endswith("rotary_emb.inv_freq")}
    if names:
        raise BackendError(f"{path}: {len(names)} tensors the torch engine does not know "
                           f"(e.g. {sorted(names)[0]}); this architecture is not supported, use backend: llamacpp")


# ---- building the model ----

def drafting_head(model: Transformer) -> Linear:
    """The target's LM head for drafters: on an int4 target, an int4 copy of it (a full-vocabulary
    head is a drafter's largest cost, and guesses need no float32 logits); else the head itself."""
    cached = getattr(model, "_drafting_head", None)
    if cached is None:
        w = model.head.weight
        cached = int4_linear(w) if model.runs_int4 and w is not None and Int4Rows.fits(w) else model.head
        model._drafting_head = cached
    return cached


def build_mlp(layer: dict, dtype: torch.dtype, int4: bool, device: torch.device, dense_copy: bool = False,
              moe: MoeShape | None = None) -> dict:
    """A layer's MLP as the layer builders take it: `mlp`, routed experts (moe_weights.build_moe),
    where the layer has them; else the dense SwiGLU's `gate_up` and `down`."""
    if "experts" in layer:
        return {"mlp": build_moe(layer, moe, dtype, int4, device)}
    return {"gate_up": as_linear([layer["gate"], layer["up"]], [None, None], dtype, int4, device, dense_copy),
            "down": as_linear([layer["down"]], [None], dtype, int4, device, dense_copy)}


def build_layer(layer: dict[str, Matrix], dtype: torch.dtype, int4: bool, device: torch.device,
                dense_copy: bool = False, moe: MoeShape | None = None) -> dict:
    """One decoder layer's tensors (LAYER_KEYS + OPTIONAL_KEYS, or a sparse MLP's: moe_weights.py)
    as the weights `layers.decoder_layer` takes."""
    b = {
        "attn_norm": layer["attn_norm"].float().to(device), "mlp_norm": layer["mlp_norm"].float().to(device),
        "qkv": as_linear([layer["q"], layer["k"], layer["v"]],
                         [layer.get("q_bias"), layer.get("k_bias"), layer.get("v_bias")], dtype, int4, device,
                         dense_copy),
        "o": as_linear([layer["o"]], [None], dtype, int4, device, dense_copy),
        **build_mlp(layer, dtype, int4, device, dense_copy, moe),
    }
    b |= {k: layer[k].float().to(device) for k in NORM_KEYS if k in layer}
    return b


def build_recurrent_layer(layer: dict[str, Matrix], dtype: torch.dtype, int4: bool, device: torch.device,
                          moe: MoeShape | None = None) -> dict:
    """A linear-attention layer's tensors (HF_LINEAR_NAMES' keys) as `gated_delta.recurrent_layer`
    takes them: the four input projections as one matmul (rows q|k|v|z|b|a)."""
    def dev(key: str) -> Tensor:
        return layer[key].float().to(device)

    return {
        "in_proj": as_linear([layer[k] for k in IN_PROJ_KEYS], [None] * 4, dtype, int4, device),
        "out": as_linear([layer["out"]], [None], dtype, int4, device),
        **build_mlp(layer, dtype, int4, device, moe=moe),
        "conv": dev("conv").reshape(layer["conv"].shape[0], -1), "A_log": dev("A_log"), "dt_bias": dev("dt_bias"),
        "gate_norm": dev("gate_norm"), "attn_norm": dev("attn_norm"), "mlp_norm": dev("mlp_norm"),
    }


COPIED_KEYS = ("q", "k", "v", "o", "gate", "up", "down")  # what build_layer may give a dense copy


def dense_copy_bytes(ck: Checkpoint) -> int:
    """Bytes of the bfloat16 copies of an int4 model's attention layers' matrices (memory_plan.py)."""
    def q4_weights(m) -> int:  # Int4Rows, or a GGUF's Q4 blocks not decoded yet
        return m.q.numel() if isinstance(m, Int4Rows) else m.rows * m.cols if is_q4(m) else 0

    return sum(2 * q4_weights(m) for i, layer in enumerate(ck.layers) if not ck.cfg.is_linear(i)
               for k, m in layer.items() if k in COPIED_KEYS)


def _float_head(weight: Matrix, dtype: torch.dtype, int4: bool, device: torch.device) -> Linear:
    if device.type == "cpu" and dtype != torch.float32:
        # Logits stay float32 on CPU: bfloat16 logits (resolution 0.125 at 25) turn near-ties
        # into exact ties. A tied head shares the float32 embedding, so this costs no memory.
        dense = weight.dequantize() if isinstance(weight, (Int4Rows, QuantRows)) else weight.float()
        return Linear(dense.to(device).contiguous(), pairwise=True)
    return as_linear([weight], [None], dtype, int4, device)


def build_model(ck: Checkpoint, dtype: torch.dtype, max_len: int, int4: bool = False,
                device: torch.device | str = "cpu", rollback: str = "snapshot") -> Transformer:
    """int4 runs Int4Rows matrices with torch's group-wise int4 kernel (CPU, bfloat16 activations),
    keeping a bfloat16 copy of them for prefill when it takes at most DENSE_COPY_MAX_BYTES.
    `rollback`: a hybrid's recurrent-state rollback (recurrent_state.ROLLBACK_MODES).
    Consumes `ck.layers`: each layer's checkpoint tensors are let go once it is built, so that a big
    model's float32 copies never all sit beside the built model."""
    device = torch.device(device)
    if int4 and (dtype not in (torch.bfloat16, torch.float32) or device.type != "cpu"):
        raise ValueError("the int4 kernel path runs on CPU with bfloat16 (or, all on specchat's kernels, float32) "
                         "activations")
    dense_copy = int4 and dense_copy_bytes(ck) <= DENSE_COPY_MAX_BYTES
    moe = ck.cfg.moe
    layers = []
    # a MoE model's experts are read from disk here (moe_weights.py): minutes for a big one
    bar = progress("reading the experts", len(ck.layers)) if moe is not None else nullcontext(lambda n=1: None)
    with bar as advance:
        for i in range(len(ck.layers)):
            layer, ck.layers[i] = ck.layers[i], {}
            layers.append(recurrent_layer(ck.cfg, build_recurrent_layer(layer, dtype, int4, device, moe))
                          if ck.cfg.is_linear(i) else decoder_layer(ck.cfg, build_layer(layer, dtype, int4, device,
                                                                                        dense_copy, moe)))
            mapped = [m.raw for m in layer.values() if isinstance(m, QuantRows)]
            page_out(mapped + (layer["experts"].file_blocks() if "experts" in layer else []))  # packed: the pages go
            del layer
            return_freed_memory()  # the layer's float32 temporaries: else they stay resident as free heap
            advance()
    embed, head = head_on_tiles(ck) if int4 and device.type == "cpu" else (None, None)
    if head is None:
        # bfloat16 where load_hf_dir(int4=True) kept it so (its rows are widened when looked up), else float32
        embed = float_embedding(ck.embed).to(device)
        head = _float_head(ck.head if ck.head is not None else embed.float(), dtype, int4, device)
    model = Transformer(ck.cfg, embed, layers, ck.norm.float().to(device), head, dtype, max_len, rollback)
    if head.pairwise and not ck.cfg.logit_softcap:  # the argmax head bounds the head's own logits, not capped ones
        model.argmax_head = argmax_head.for_head(head.weight, model.norm.weight)
    return_freed_memory()
    return model
