"""The MTP (nextn) layers of a GGUF file, read into the same `MtpWeights` as a checkpoint
directory's head (mtp.py), so that the native engine drafts from a GGUF's own head.

llama.cpp's converter appends a model's MTP layers as blocks after the main ones and counts them in
`{arch}.nextn_predict_layers` (qwen35, qwen35moe, glm4moe; conversion/qwen.py `_QwenMtpMixin`,
conversion/glm.py). Block N+j holds MTP layer j: its decoder layer under the main layers' names
(a gated full-attention layer on Qwen3.5, routed experts where the main model has them), and

    nextn.enorm, nextn.hnorm, nextn.eh_proj, nextn.shared_head_norm

for Qwen3.5's `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc`, `mtp.norm` (layout
qwen3_next) and GLM-4.5's `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` (layout deepseek); both
concatenate [embedding, hidden]. GLM's files also hold `nextn.embed_tokens` and
`nextn.shared_head_head`, copies of the model's own embedding and head, which the head shares
(as mtp.py's directory reader does). The norms are stored with their 1 added (gguf_archs.py), as
mtp.py holds them once read.
"""
from __future__ import annotations

from pathlib import Path

from ..base import BackendError
from .config import ModelConfig
from .gguf_archs import HYBRID_ARCHS, NEXTN_ARCHS
from .gguf_loader import LayerReader, config_from_gguf, nextn_layers, read_index
from .mtp import LAYOUTS, MtpWeights, check_mtp_shapes, read_mtp

NEXTN_NAMES = {"embed_norm": "nextn.enorm.weight", "hidden_norm": "nextn.hnorm.weight",
               "proj": "nextn.eh_proj.weight", "final_norm": "nextn.shared_head_norm.weight"}
SHARED = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight")  # the model's own, shared


def no_mtp_reason(path: Path | str, cache_dir: Path | None = None) -> str | None:
    """None when the GGUF at `path` carries MTP layers the native engine reads, else why not, as a
    sentence that says what to use instead."""
    index = read_index(Path(path), cache_dir)
    arch = index.field("general.architecture")
    if nextn_layers(index):
        return None
    instead = ("use another speculative method on it (draft, eagle3, dflash, suffix, ngram), or set "
               "`speculative.drafter` to an MTP head directory (e.g. made by `specchat train mtp`)")
    if arch in NEXTN_ARCHS:
        return (f"{path} carries no MTP layers (no `{arch}.nextn_predict_layers`: converted without them, e.g. "
                f"with --no-mtp); use a GGUF of this model converted with its MTP layers, or {instead}")
    return f"{path} carries no MTP layers ({arch} files have none); {instead}"


def read_gguf_mtp(path: Path, cfg: ModelConfig, cache_dir: Path | None = None) -> MtpWeights:
    """The MTP layers of the GGUF at `path`, checked against the target's shape `cfg` (the file's
    own main model, or another with its shape). Raises BackendError naming what is wrong."""
    path = Path(path)
    why = no_mtp_reason(path, cache_dir)
    if why:
        raise BackendError(why)
    index = read_index(path, cache_dir)
    own = config_from_gguf(index, str(path))
    if (own.dim, own.vocab_size) != (cfg.dim, cfg.vocab_size):
        raise BackendError(f"{path}: its MTP layers are {own.dim} wide over {own.vocab_size} tokens, the target "
                           f"{cfg.dim} over {cfg.vocab_size}; this head belongs to another model")
    reader = LayerReader(path, index, own)  # float32: one layer, quantized with the target's if int4 (mtp.py)
    layers = []
    for j in range(nextn_layers(index)):
        i = own.n_layers + j
        sparse = own.moe is not None and f"blk.{i}.ffn_gate_inp.weight" in index.tensors
        layer = reader.layer(i, linear=False, sparse=sparse)
        layer |= {key: reader.dense(f"blk.{i}.{name}") for key, name in NEXTN_NAMES.items()}
        check_mtp_shapes(path, j, layer, cfg)
        unknown = {n for n in index.tensors if n.startswith(f"blk.{i}.")} - reader.names(i) - {
            f"blk.{i}.{name}" for name in (*NEXTN_NAMES.values(), *SHARED)}
        if unknown:
            raise BackendError(f"{path}: MTP block {i} has {len(unknown)} tensors the torch engine does not know "
                               f"(e.g. {sorted(unknown)[0]}); use backend: llamaserver with method: mtp")
        layers.append(layer)
    arch = index.field("general.architecture")
    return MtpWeights(LAYOUTS["qwen3_next" if arch in HYBRID_ARCHS else "deepseek"], layers)


def read_any_mtp(path: Path, cfg: ModelConfig, cache_dir: Path | None = None) -> MtpWeights:
    """An MTP head from a GGUF's nextn layers or a checkpoint directory (mtp.read_mtp)."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return read_gguf_mtp(path, cfg, cache_dir)
    return read_mtp(path, cfg)
