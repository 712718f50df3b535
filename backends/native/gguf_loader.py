"""Reading a GGUF file into a `Checkpoint`.

Tensors are dequantized to float32 with the `gguf` package, except matrices of the types specchat's
kernels run (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, F16, BF16) when `keep_int4` is set:
those stay the file's blocks (`kquant.QuantRows`, views of the file) until their layer is built on
the kernels, so the engine runs the very weights llama.cpp runs, in about the file's memory. llama.cpp's converter permutes the rows of Q and K
for llama-arch models (interleaved RoPE); we undo that to get the Hugging Face layout. Architectures:
`SUPPORTED_ARCHS`, each read as llama.cpp reads it (qwen3moe's experts, gemma3's windows: `config_from_gguf`).

`gguf.GGUFReader` parses every metadata field, tokenizer vocabulary and merges included, which
takes seconds for a 49k-token vocabulary; what the engine needs from it (the model's own fields
and where each tensor lies in the file) is saved once as a small index under `cache_dir`, when
the caller gives one (see derived_files.py), and read from there later.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..base import BackendError
from .config import ATTENTION, SLIDING_ATTENTION, ModelConfig, MoeShape
from .int4 import Int4Rows
from .kquant import Q4_TYPES, TYPES, QuantRows
from .weights import Checkpoint, progress, refuse_unknown
from ..derived_files import derived_path
from ..weight_files import BrokenWeightFile, gguf_reader

KQUANT_TYPES = tuple(TYPES)  # kept as the file's blocks for specchat's kernels (kquant.py)

_LAYER_NAMES = {
    "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
    "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
    "attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "attn_post_norm": "post_attention_norm.weight", "mlp_post_norm": "post_ffw_norm.weight",
}
# a sparse layer's router and its experts' matrices, each stacked [experts, rows, inputs]
_EXPERT_NAMES = {"router": "ffn_gate_inp.weight", "gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight",
                 "down": "ffn_down_exps.weight"}
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3")
PERMUTED_ARCHS = ("llama",)  # archs whose Q/K rows llama.cpp's converter permutes
# layer tensors only some architectures have; any other of _LAYER_NAMES' is required
_OPTIONAL = {"q_bias", "k_bias", "v_bias", "q_norm", "k_norm", "attn_post_norm", "mlp_post_norm"}
_REQUIRED_BY_ARCH = {"gemma3": {"q_norm", "k_norm", "attn_post_norm", "mlp_post_norm"}}
# llama.cpp's gemma3: without `sliding_window_pattern`, every 6th layer is global (llama_hparams::set_swa_pattern)
GEMMA3_PATTERN = 6


_VOCAB_COUNT = "tokenizer.ggml.tokens/count"  # index entry: the vocabulary's size, not its tokens


@dataclass
class GgufTensor:
    """What the loader reads of a tensor: `data` as `gguf.GGUFReader` gives it (raw blocks as
    uint8 rows for quantized types), a read-only view of the file."""

    name: str
    tensor_type: "gguf.GGMLQuantizationType"  # noqa: F821
    shape: list[int]  # GGUF order (innermost first), as ReaderTensor.shape
    data: np.ndarray
    offset: int  # where `data` starts in the file


@dataclass
class GgufIndex:
    fields: dict  # metadata values, except the tokenizer's (see _VOCAB_COUNT)
    tensors: dict[str, GgufTensor]

    @classmethod
    def from_reader(cls, reader) -> "GgufIndex":
        fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            fields[_VOCAB_COUNT] = len(tokens.data)
        return cls(fields, {t.name: GgufTensor(t.name, t.tensor_type, [int(d) for d in t.shape], t.data,
                                               int(t.data_offset)) for t in reader.tensors})

    def to_json(self) -> str:
        entries = [{"name": t.name, "type": int(t.tensor_type), "shape": t.shape, "offset": t.offset,
                    "dtype": t.data.dtype.str, "array_shape": list(t.data.shape)} for t in self.tensors.values()]
        return json.dumps({"fields": self.fields, "tensors": entries})

    @classmethod
    def from_json(cls, text: str, path: Path) -> "GgufIndex":
        import gguf

        raw = json.loads(text)
        file = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = {}
        for e in raw["tensors"]:
            dtype = np.dtype(e["dtype"])
            n_bytes = int(np.prod(e["array_shape"], dtype=np.int64)) * dtype.itemsize
            data = file[e["offset"]:e["offset"] + n_bytes].view(dtype).reshape(e["array_shape"])
            tensors[e["name"]] = GgufTensor(e["name"], gguf.GGMLQuantizationType(e["type"]), e["shape"], data,
                                            e["offset"])
        return cls(raw["fields"], tensors)

    def field(self, key: str, default=None):
        return self.fields.get(key, default)


def index_path(path: Path, cache_dir: Path) -> Path:
    from importlib.metadata import version

    return derived_path(cache_dir, "gguf-index", path, version("gguf"), suffix=".json")


def read_index(path: Path, cache_dir: Path | None = None) -> GgufIndex:
    """The file's metadata and tensor layout: from the cached index, else parsed (and cached)."""
    cached = index_path(path, cache_dir) if cache_dir is not None else None
    if cached is not None:
        try:
            return GgufIndex.from_json(cached.read_text(), path)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not cached yet, or unreadable: parse the file again
    reader = gguf_reader(path)
    try:
        index = GgufIndex.from_reader(reader)
    except Exception as e:  # noqa: BLE001 - a field whose type and value disagree
        raise BrokenWeightFile(path, f"its metadata does not parse ({type(e).__name__}: {e})") from None
    if cached is None:
        return index
    try:
        text = index.to_json()
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, cached)  # atomic: another process may be writing the same index
    except (OSError, TypeError, ValueError):
        pass  # a metadata value JSON cannot hold, or a read-only cache: parse again next time
    return index


def config_from_gguf(index: GgufIndex, source: str = "the GGUF") -> ModelConfig:
    """`source`: the file, named in the BackendError for a metadata field it lacks."""
    arch = index.field("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise BackendError(f"GGUF architecture '{arch}' is not supported by the torch engine "
                           f"(supported: {', '.join(SUPPORTED_ARCHS)}); use backend: llamacpp")

    def a(key, default=None):
        return index.field(f"{arch}.{key}", default)

    def count(key: str, default: int | None = None) -> int:
        """A whole-number field of 1 or more; a missing or wrongly typed one is a BackendError."""
        value = a(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BackendError(f"{source}: metadata `{arch}.{key}` is {'missing' if value is None else repr(value)}, "
                               "the torch engine needs a whole number of 1 or more there; is the file complete? "
                               "convert or download it again")
        return value

    def number(key: str, default: float) -> float:
        """A finite number above 0 (float fields: epsilon, rope base and factor), as in config.json."""
        value = a(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise BackendError(f"{source}: metadata `{arch}.{key}` is {value!r}, the torch engine needs a number "
                               "above 0 there; is the file complete? convert or download it again")
        return float(value)

    names = set(index.tensors)
    n_heads = count("attention.head_count")
    dim = count("embedding_length")
    vocab = a("vocab_size") or index.field(_VOCAB_COUNT, 0)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise BackendError(f"{source}: it names no vocabulary size (`{arch}.vocab_size` or the tokenizer's token "
                           "list); is the file complete? convert or download it again")
    scaling = None
    if a("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": number("rope.scaling.factor", None)}
    n_layers, head_dim = count("block_count"), count("attention.key_length", dim // n_heads)
    extra = {}
    if arch == "qwen3moe":  # every layer routed experts, top-k renormalised, as llama.cpp's qwen3moe runs them
        experts, top_k = count("expert_count"), count("expert_used_count")
        if top_k > experts:
            raise BackendError(f"{source}: metadata `{arch}.expert_used_count` ({top_k}) is more than its {experts} "
                               "experts; is the file complete? convert or download it again")
        extra["moe"] = MoeShape(experts=experts, top_k=top_k, expert_dim=count("expert_feed_forward_length"),
                                sparse_layers=tuple(range(n_layers)), renormalise=True, n_layers=n_layers)
    elif arch == "gemma3":
        extra = _gemma3(a, count, number, n_layers, dim, n_heads, head_dim, source)
    return ModelConfig(
        vocab_size=int(vocab), dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=count("attention.head_count_kv", n_heads), head_dim=head_dim,
        ffn_dim=count("feed_forward_length"), norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=number("rope.freq_base", 10000.0), rope_scaling=scaling,
        max_position=count("context_length", 4096), tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names, arch=arch, **extra)


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


def _dense(t) -> torch.Tensor:
    return _floats(t.data, t.tensor_type, tuple(int(s) for s in reversed(t.shape)))


def _floats(data, tensor_type, shape: tuple[int, ...]) -> torch.Tensor:
    if tensor_type.name == "Q8_0":  # most embeddings: in torch, ~5x faster than gguf's numpy
        return _q8_0(data).reshape(shape)
    from gguf.quants import dequantize

    return torch.from_numpy(np.array(dequantize(data, tensor_type), dtype=np.float32)).reshape(shape)


def _q8_0(data) -> torch.Tensor:
    """Q8_0 blocks -> float32: a block holds 32 weights, fp16 d then 32 int8 q; weight = d * q."""
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8)).view(-1, 34)
    return blocks[:, 2:].contiguous().view(torch.int8).float() * blocks[:, :2].contiguous().view(torch.float16).float()


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Index that undoes llama.cpp's `reshape(n_head, 2, r/2, ...).swapaxes(1, 2)` on rows."""
    permuted = torch.arange(n_rows).reshape(n_head, 2, n_rows // n_head // 2).transpose(1, 2).reshape(-1)
    return torch.argsort(permuted)


@dataclass
class GgufExperts:
    """A sparse layer's experts as the file stacks them (gate, up, down: [experts, rows, inputs]),
    one expert taken at a time while the model is built (moe_weights.build_moe): the file's blocks
    where `keep` and the kernels run their type, else float32."""
    stacks: tuple[GgufTensor, GgufTensor, GgufTensor]
    keep: bool

    @property
    def count(self) -> int:
        return self.stacks[0].shape[2]

    def matrices(self, e: int) -> tuple:
        out = []
        for t in self.stacks:
            cols, rows = t.shape[0], t.shape[1]
            if self.keep and t.tensor_type.name in KQUANT_TYPES + tuple(Q4_TYPES):
                out.append(QuantRows.from_blocks(t.tensor_type.name, t.data[e], rows, cols))
            else:
                out.append(_floats(t.data[e], t.tensor_type, (rows, cols)))
        return tuple(out)

    def file_blocks(self) -> list:
        """The stacks' bytes, views of the file (memory_plan.page_out, once the experts are packed)."""
        with warnings.catch_warnings():  # read-only views: nothing writes to them
            warnings.simplefilter("ignore", UserWarning)
            return [torch.from_numpy(np.asarray(t.data).reshape(-1).view(np.uint8)) for t in self.stacks]


def load_gguf(path: Path, keep_int4: bool = False, cache_dir: Path | None = None) -> Checkpoint:
    index = read_index(path, cache_dir)
    cfg = config_from_gguf(index, str(path))
    tensors = index.tensors
    int4_types = tuple(Q4_TYPES)  # as the file's blocks too, decoded to Int4Rows as each layer is built

    def load(name: str, matrix: bool = False, embedding: bool = False):
        t = tensors[name]
        if embedding and t.tensor_type.name in int4_types:
            return _dense(t)
        if matrix and keep_int4 and t.tensor_type.name in KQUANT_TYPES + int4_types and len(t.shape) == 2:
            return QuantRows.from_blocks(t.tensor_type.name, t.data, int(t.shape[1]), int(t.shape[0]))
        return _dense(t)

    def permute(m, n_head: int):
        idx = _unpermute_rows(m.q.shape[0] if isinstance(m, Int4Rows) else m.rows if isinstance(m, QuantRows)
                              else m.shape[0], n_head)
        if isinstance(m, Int4Rows):
            return Int4Rows(m.q[idx], m.scale[idx], m.zero[idx])
        if isinstance(m, QuantRows):
            return m.take(idx)
        return m[idx]

    layers = []
    with progress(f"loading {path.name}", cfg.n_layers + 1) as advance:
        # Q8_0 / K-quant blocks kept, where the head may share them (weights.py); Q4 rows as floats
        embed = load("token_embd.weight", matrix=True, embedding=True)
        advance()
        required = set(_LAYER_NAMES) - _OPTIONAL | _REQUIRED_BY_ARCH.get(cfg.arch, set())

        def missing(name: str):
            raise BackendError(f"{path}: tensor {name} missing; the file may be truncated")

        for i in range(cfg.n_layers):
            layer = {}
            sparse = cfg.is_sparse(i)
            for key, suffix in _LAYER_NAMES.items():
                name = f"blk.{i}.{suffix}"
                if sparse and key in ("gate", "up", "down"):
                    continue
                if name in tensors:
                    layer[key] = load(name, matrix=suffix.endswith(".weight") and "norm" not in suffix)
                elif key in required:
                    missing(name)
            if sparse:
                names = {key: f"blk.{i}.{suffix}" for key, suffix in _EXPERT_NAMES.items()}
                m = cfg.moe
                want = {"router": [cfg.dim, m.experts], "gate": [cfg.dim, m.expert_dim, m.experts],
                        "up": [cfg.dim, m.expert_dim, m.experts], "down": [m.expert_dim, cfg.dim, m.experts]}
                for key, name in names.items():
                    if name not in tensors:
                        missing(name)
                    if list(tensors[name].shape) != want[key]:
                        raise BackendError(f"{path}: tensor {name} has shape {tensors[name].shape}, its metadata "
                                           f"gives {want[key]}; convert or download the file again")
                layer["router"] = _dense(tensors[names["router"]])
                layer["experts"] = GgufExperts(tuple(tensors[names[k]] for k in ("gate", "up", "down")), keep_int4)
            if cfg.arch in PERMUTED_ARCHS:
                layer["q"] = permute(layer["q"], cfg.n_heads)
                layer["k"] = permute(layer["k"], cfg.n_kv_heads)
            layers.append(layer)
            advance()
    if "rope_freqs.weight" in tensors:  # llama3-style scaling stored as per-frequency divisors
        cfg.rope_scaling = {"rope_type": "freq_factors", "factors": _dense(tensors["rope_freqs.weight"]).tolist()}
    head = load("output.weight", matrix=True) if "output.weight" in tensors else None
    known = {f"blk.{i}.{suffix}" for i in range(cfg.n_layers)
             for suffix in (*_LAYER_NAMES.values(), *(_EXPERT_NAMES.values() if cfg.is_sparse(i) else ()))}
    known |= {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
    refuse_unknown(path, set(tensors) - known)
    return Checkpoint(cfg, embed, load("output_norm.weight"), head, layers, source=str(path))
