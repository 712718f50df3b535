"""How much memory a profile's weights take once loaded, from the checkpoint's tensor sizes alone
(read from the file headers, or a PyTorch pickle's file size; nothing loaded or unpickled), and a refusal before loading when that is more than
the device has free: one line with the numbers instead of the OOM killer halfway through a load.

The figure is the weights as the engine holds them plus the KV cache at the profile's context: a
quantized GGUF is counted tensor by tensor and type by type as the loader keeps it (backends/
native/memory_plan.py gguf_bytes: each block type's tiles, about the file's bytes; Q4 layers'
bfloat16 copy while small; the head in the file's type past a size), float32 at 4, bfloat16 and
float16 at 2; a checkpoint directory at int4 is counted tensor by tensor from its headers, by the
rule the loader quantizes with (memory_plan.py: 0.625 bytes a layer weight, a bfloat16 copy only
where all of them stay small); llama.cpp maps the file as it is. Activations and the runtime come
on top (the A/B view and `specchat verify --json` report the measured peak).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specchat.backends.base import BackendError
from specchat.backends.native.memory_plan import (TILE_BYTES, float_activations, gguf_bytes, int4_dir_bytes,
                                                  kv_cache_bytes)
from specchat.backends.weight_files import check_gguf, safetensors_header
from specchat.models import resolve_model
from specchat.profiles import Profile

GiB = 2**30
BYTES_PER_PARAMETER = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int4": 2.5}


@dataclass(frozen=True)
class Checkpoint:
    parameters: int
    file_bytes: int
    quantized: bool  # GGUF blocks specchat's kernels run: the int4 path where the engine allows it
    int4_bytes: Optional[int] = None  # what a load on the kernels holds (memory_plan.py)
    kv_position_elements: int = 0  # keys and values of every attention layer, a position
    rope_position_bytes: int = 0  # the float32 RoPE tables (cos, sin), a position
    float_activations: bool = False  # int4 with float32 activations and cache (an F16 / BF16 file)


def read_checkpoint(path: Path, kind: str) -> Checkpoint:
    """Parameter count and stored size from a GGUF's tensor index or safetensors headers."""
    if kind == "gguf":  # the engine's own tensor index, kept in the cache after the first read
        from specchat import paths
        from specchat.backends.native.gguf_loader import read_index

        index = read_index(path, paths.cache_dir())
        tensors = {t.name: (t.tensor_type.name, tuple(t.shape)) for t in index.tensors.values()}
        params = sum(math.prod(shape) for _, shape in tensors.values())
        quantized = any(qtype in TILE_BYTES for qtype, _ in tensors.values())
        return Checkpoint(params, path.stat().st_size, quantized, gguf_bytes(tensors), *_gguf_positions(index),
                          float_activations=float_activations(tensors))
    params = stored = 0
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in sorted(Path(path).glob("*.safetensors")):  # each header checked against the file's size
        header = safetensors_header(shard)
        params += header.parameters
        stored += shard.stat().st_size
        shapes |= {name: tuple(t.shape) for name, t in header.tensors.items()}
    if not stored:  # PyTorch pickles (EAGLE-3 heads ship as pytorch_model.bin): never unpickled here
        stored = sum(f.stat().st_size for f in Path(path).glob("pytorch_model*.bin"))
        params = stored // stored_element_bytes(Path(path))
    config = read_config(Path(path))
    return Checkpoint(params, stored, False, int4_dir_bytes(shapes, config) if shapes else None, *_hf_positions(config))


def _gguf_positions(index) -> tuple[int, int]:
    """A GGUF's (KV cache elements, RoPE table bytes) a position, from its metadata (0 where it does
    not say)."""
    arch = index.field("general.architecture")

    def field(key: str, default=0):
        value = index.field(f"{arch}.{key}", default)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    heads = field("attention.head_count")
    head_dim = field("attention.key_length") or (field("embedding_length") // heads if heads else 0)
    return kv_cache_bytes(field("block_count"), field("attention.head_count_kv", heads), head_dim, 0, 1), 8 * head_dim


def _hf_positions(config: dict) -> tuple[int, int]:
    """The same from config.json: attention layers only (a hybrid's linear ones keep a state instead)."""
    text = config.get("text_config", config)
    text = text if isinstance(text, dict) else {}
    try:
        heads, layers = int(text["num_attention_heads"]), int(text["num_hidden_layers"])
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        kv = int(text.get("num_key_value_heads") or heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0, 0
    types = text.get("layer_types")
    if isinstance(types, list) and types:
        layers = sum(t == "full_attention" for t in types)
    return kv_cache_bytes(layers, kv, head_dim, 0, 1), 8 * head_dim


def read_config(folder: Path) -> dict:
    """config.json as a dict; empty where it is missing or unreadable (the engine says so at load)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def stored_element_bytes(folder: Path) -> int:
    """Bytes per stored weight of a checkpoint without headers to count from: config.json's
    `torch_dtype` (or `dtype`); 4 (float32) when it does not say, so the estimate stays a floor."""
    config = read_config(folder)
    dtype = config.get("torch_dtype") or config.get("dtype")
    return {"float16": 2, "bfloat16": 2, "float64": 8}.get(str(dtype).removeprefix("torch."), 4)


def precision_of(profile: Profile, ck: Checkpoint, device: str) -> str:
    """The arithmetic the engine will pick (engine.choose_precision's rule, without loading)."""
    if profile.dtype != "auto":
        return profile.dtype
    if device != "cpu":
        return "bfloat16"
    return "int4" if ck.quantized else "float32"


def local_checkpoints(profile: Profile):
    """(path, kind) of the profile's target and drafter; None for one that is not on this machine."""
    models = [profile.model] + ([profile.speculative.drafter] if profile.speculative.drafter else [])
    for spec in models:
        try:
            ref = resolve_model(spec, profile.base_dir, fetch=False)
        except BackendError:
            yield None
            continue
        yield None if ref.kind == "hub" or not ref.path.exists() else (ref.path, ref.kind)


def check_weight_files(profile: Profile) -> None:
    """Raise BrokenWeightFile for a weight file of the profile whose header does not fit the file
    (headers only, cheap enough for every listing: nothing is loaded, torch is not imported)."""
    for found in local_checkpoints(profile):
        if found is None:
            continue
        path, kind = found
        if kind == "gguf":
            _check_gguf_once(str(path), *_stamp(path))
        else:
            for shard in sorted(Path(path).glob("*.safetensors")):
                safetensors_header(shard)  # remembered by the file's size and time


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=32)
def _check_gguf_once(path: str, size: int, mtime_ns: int) -> None:
    """Profiles share a GGUF (eight name the default): its header is walked once per version of the file."""
    check_gguf(path)


def weight_bytes(profile: Profile, device: str = "cpu") -> Optional[int]:
    """The profile's target and drafter weights as loaded, with a GGUF's KV cache at the profile's
    context; None where a model is not on this machine."""
    total = 0
    for found in local_checkpoints(profile):
        if found is None:
            return None
        ck = read_checkpoint(*found)
        precision = precision_of(profile, ck, device)
        if profile.backend in ("llamacpp", "llamaserver"):
            total += ck.file_bytes
            continue
        if precision == "int4" and ck.int4_bytes is not None:
            total += ck.int4_bytes
        else:
            total += int(ck.parameters * BYTES_PER_PARAMETER[precision])
        # the cache in the compute dtype (bfloat16 for int4 but an F16 / BF16 file's; float16's is float32 on
        # CPU: model.cache_dtype)
        element = 2 if (precision == "int4" and not ck.float_activations) or precision == "bfloat16" \
            or (precision == "float16" and device != "cpu") else 4
        total += (ck.kv_position_elements * element + ck.rope_position_bytes) * (profile.context + 1)
    return total


def free_bytes(device: str) -> Optional[int]:
    """Memory the device has free now: MemAvailable on CPU, the CUDA allocator's free memory."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def check_fits(profile: Profile) -> None:
    """Refuse, before loading, a profile whose weights alone exceed the device's free memory."""
    if profile.backend == "openai":
        return
    device = profile.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    need, free = weight_bytes(profile, device), free_bytes(device)
    if need is not None and free is not None and need > free:
        raise BackendError(
            f"profile '{profile.name}' needs {size(need)} for its weights and KV cache and {device} has {size(free)} "
            f"free: close what else is running, or pick a smaller model or a narrower dtype (int4, bfloat16)")
