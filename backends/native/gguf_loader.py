"""Reading a GGUF file into a `Checkpoint`.

Tensors are dequantized to float32 with the `gguf` package, except matrices of the types specchat's
kernels run (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, F16, BF16) when `keep_int4` is set:
those stay the file's blocks (`kquant.QuantRows`, views of the file) until their layer is built on
the kernels, so the engine runs the very weights llama.cpp runs, in about the file's memory. llama.cpp's converter permutes the rows of Q and K
for llama-arch models (interleaved RoPE); we undo that to get the Hugging Face layout. Architectures:
`SUPPORTED_ARCHS`, each read as llama.cpp reads it (what each adds to the Llama family's shape and
names: gguf_archs.py); the MTP (nextn) blocks some carry after their main layers: gguf_mtp.py.

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
from .config import ModelConfig
from .gguf_archs import LINEAR_NAMES, NEXTN_ARCHS, POST_ATTENTION_MLP_NORM, SHARED_NAMES, arch_fields, linear_layer
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
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "qwen35", "qwen35moe", "glm4moe")
PERMUTED_ARCHS = ("llama",)  # archs whose Q/K rows llama.cpp's converter permutes
# layer tensors only some architectures have; any other of _LAYER_NAMES' is required
_OPTIONAL = {"q_bias", "k_bias", "v_bias", "q_norm", "k_norm", "attn_post_norm", "mlp_post_norm"}
_LINEAR_SUFFIXES = tuple(LINEAR_NAMES.values())
_SHARED_MATRICES = ("shared_gate", "shared_up", "shared_down")
_REQUIRED_BY_ARCH = {"gemma3": {"q_norm", "k_norm", "attn_post_norm", "mlp_post_norm"}}


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
    """`source`: the file, named in the BackendError for a metadata field it lacks. The main model's
    layers only: a file's MTP (nextn) blocks, its last `nextn_predict_layers`, are gguf_mtp.py's."""
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
    n_layers, head_dim = count("block_count") - nextn_layers(index), count("attention.key_length", dim // n_heads)
    if n_layers < 1:
        raise BackendError(f"{source}: metadata `{arch}.nextn_predict_layers` leaves no main layers of its "
                           f"{count('block_count')}; convert or download it again")
    extra = arch_fields(arch, a, count, number, n_layers, dim, n_heads, head_dim, names, source)
    moe = extra.get("moe")
    fields = dict(
        vocab_size=int(vocab), dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=count("attention.head_count_kv", n_heads), head_dim=head_dim,
        # a model whose every MLP is routed experts (qwen35moe) has no dense width
        ffn_dim=0 if moe is not None and moe.all_sparse else count("feed_forward_length"),
        norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=number("rope.freq_base", 10000.0), rope_scaling=scaling,
        max_position=count("context_length", 4096), tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names, arch=arch)
    return ModelConfig(**(fields | extra))


def nextn_layers(index: GgufIndex) -> int:
    """How many MTP (nextn) blocks the file carries after its main layers (`nextn_predict_layers`)."""
    arch = index.field("general.architecture")
    value = index.field(f"{arch}.nextn_predict_layers", 0) if arch in NEXTN_ARCHS else 0
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


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


class LayerReader:
    """A GGUF's tensors under weights.py's short names, a block at a time (load_gguf's main layers,
    gguf_mtp.py's MTP blocks): matrices as the file's blocks where `keep_int4` and the kernels run
    their type (Q4 ones decoded as each layer is built), else float32."""

    def __init__(self, path: Path, index: GgufIndex, cfg: ModelConfig, keep_int4: bool = False):
        self.path, self.tensors, self.cfg, self.keep_int4 = path, index.tensors, cfg, keep_int4

    def missing(self, name: str):
        raise BackendError(f"{self.path}: tensor {name} missing; the file may be truncated")

    def load(self, name: str, matrix: bool = False, embedding: bool = False):
        if name not in self.tensors:
            self.missing(name)
        t = self.tensors[name]
        q4 = t.tensor_type.name in tuple(Q4_TYPES)
        if embedding and q4:
            return _dense(t)
        if matrix and self.keep_int4 and (t.tensor_type.name in KQUANT_TYPES or q4) and len(t.shape) == 2:
            return QuantRows.from_blocks(t.tensor_type.name, t.data, int(t.shape[1]), int(t.shape[0]))
        return _dense(t)

    def dense(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            self.missing(name)
        return _dense(self.tensors[name])

    def layer(self, i: int, linear: bool, sparse: bool) -> dict:
        """Block i: a Gated DeltaNet layer (`linear`: gguf_archs.linear_layer) or an attention layer;
        its MLP routed experts where `sparse`, else dense."""
        cfg, tensors = self.cfg, self.tensors
        layer = linear_layer(self.load, self.dense, i) if linear else {}  # its norms included
        names = _LAYER_NAMES | ({"mlp_norm": "post_attention_norm.weight"} if cfg.arch in POST_ATTENTION_MLP_NORM
                                else {})
        required = set(_LAYER_NAMES) - _OPTIONAL | _REQUIRED_BY_ARCH.get(cfg.arch, set())
        for key, suffix in names.items():
            name = f"blk.{i}.{suffix}"
            if (sparse and key in ("gate", "up", "down")) or (linear and key not in ("gate", "up", "down")) \
                    or (key == "attn_post_norm" and cfg.arch in POST_ATTENTION_MLP_NORM):
                continue
            if name in tensors:
                layer[key] = self.load(name, matrix=suffix.endswith(".weight") and "norm" not in suffix)
            elif key in required:
                self.missing(name)
        if sparse:
            layer |= self.experts(i)
        if cfg.arch in PERMUTED_ARCHS:
            layer["q"] = _permute(layer["q"], cfg.n_heads)
            layer["k"] = _permute(layer["k"], cfg.n_kv_heads)
        return layer

    def experts(self, i: int) -> dict:
        """A sparse block's router, routed experts (`GgufExperts`), and where the file has them the
        router's bias and the shared expert with its gate."""
        names = {key: f"blk.{i}.{suffix}" for key, suffix in _EXPERT_NAMES.items()}
        m, dim, tensors = self.cfg.moe, self.cfg.dim, self.tensors
        want = {"router": [dim, m.experts], "gate": [dim, m.expert_dim, m.experts],
                "up": [dim, m.expert_dim, m.experts], "down": [m.expert_dim, dim, m.experts]}
        for key, name in names.items():
            if name not in tensors:
                self.missing(name)
            if list(tensors[name].shape) != want[key]:
                raise BackendError(f"{self.path}: tensor {name} has shape {tensors[name].shape}, its metadata "
                                   f"gives {want[key]}; convert or download the file again")
        out = {"router": _dense(tensors[names["router"]]),
               "experts": GgufExperts(tuple(tensors[names[k]] for k in ("gate", "up", "down")), self.keep_int4)}
        for key, suffix in SHARED_NAMES.items():  # the shared expert's matrices in blocks, as the experts'
            name = f"blk.{i}.{suffix}"
            if name in tensors:
                out[key] = self.load(name, matrix=key in _SHARED_MATRICES)
        if m.shared_dim and "shared_gate" not in out:
            self.missing(f"blk.{i}.{SHARED_NAMES['shared_gate']}")
        if m.shared_gate and "shared_gate" in out and "shared_expert_gate" not in out:
            self.missing(f"blk.{i}.{SHARED_NAMES['shared_expert_gate']}")
        return out

    def names(self, i: int) -> set[str]:
        """The tensor names block i may have (any other is one the engine does not know)."""
        suffixes = (*_LAYER_NAMES.values(), *_EXPERT_NAMES.values(), *SHARED_NAMES.values())
        linear = self.cfg.linear is not None
        return {f"blk.{i}.{s}" for s in suffixes + ((*_LINEAR_SUFFIXES,) if linear else ())}


def _permute(m, n_head: int):
    idx = _unpermute_rows(m.q.shape[0] if isinstance(m, Int4Rows) else m.rows if isinstance(m, QuantRows)
                          else m.shape[0], n_head)
    if isinstance(m, Int4Rows):
        return Int4Rows(m.q[idx], m.scale[idx], m.zero[idx])
    if isinstance(m, QuantRows):
        return m.take(idx)
    return m[idx]


def load_gguf(path: Path, keep_int4: bool = False, cache_dir: Path | None = None) -> Checkpoint:
    """The file's main model; its MTP (nextn) blocks, if any, are left to gguf_mtp.read_gguf_mtp."""
    index = read_index(path, cache_dir)
    cfg = config_from_gguf(index, str(path))
    tensors = index.tensors
    reader = LayerReader(path, index, cfg, keep_int4)
    layers = []
    with progress(f"loading {path.name}", cfg.n_layers + 1) as advance:
        # Q8_0 / K-quant blocks kept, where the head may share them (weights.py); Q4 rows as floats
        embed = reader.load("token_embd.weight", matrix=True, embedding=True)
        advance()
        for i in range(cfg.n_layers):
            layers.append(reader.layer(i, cfg.is_linear(i), cfg.is_sparse(i)))
            advance()
    if "rope_freqs.weight" in tensors:  # llama3-style scaling stored as per-frequency divisors
        cfg.rope_scaling = {"rope_type": "freq_factors", "factors": _dense(tensors["rope_freqs.weight"]).tolist()}
    head = reader.load("output.weight", matrix=True) if "output.weight" in tensors else None
    known = {n for i in range(cfg.n_layers) for n in reader.names(i)}
    known |= {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
    mtp = {n for n in tensors if n.startswith(tuple(f"blk.{cfg.n_layers + j}." for j in range(nextn_layers(index))))}
    refuse_unknown(path, set(tensors) - known - mtp)
    if "output_norm.weight" not in tensors:
        reader.missing("output_norm.weight")
    return Checkpoint(cfg, embed, reader.load("output_norm.weight"), head, layers, source=str(path))
