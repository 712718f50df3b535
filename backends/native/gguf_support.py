"""Whether the native engine runs a GGUF file as it is: its architecture and every tensor's type.

A file it does not run goes to llama.cpp in-process, target-only, with this reason said to the
user (specchat/model_flag.py; a file's MTP layers are gguf_mtp.no_mtp_reason's to judge): never a float32 copy of weights the engine has no kernel for, which
would be several times the file's size and far slower than llama.cpp on its own blocks.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..base import BackendError
from .gguf_loader import SUPPORTED_ARCHS, config_from_gguf, read_index
from .memory_plan import TILE_BYTES

# The GGUF tensor types the native engine runs as they are stored: float32, and the types its CPU
# kernels run (memory_plan.TILE_BYTES: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
# F16, BF16). Any other type (Q2_K, Q3_K, IQ2/IQ3, TQ*, ...) would be dequantized to float32 at load:
# such a file runs on llama.cpp instead.
NATIVE_MATRIX_TYPES = ("F32", "F16", "BF16", *TILE_BYTES)

__all__ = ["NATIVE_MATRIX_TYPES", "native_compiles", "native_refusal"]


def native_refusal(path: Path | str, cache_dir: Optional[Path] = None) -> Optional[str]:
    """None when the native engine runs the model at `path` as it is stored, else why not, in a
    few words ("architecture 'phi3' is not one the native engine runs (llama, qwen2, ...)").

    A GGUF is judged from its tensor index (gguf_loader.read_index: the file's header checked
    against its size first, so a broken file raises BrokenWeightFile; kept under `cache_dir` when
    given, so a second start reads no more than a small JSON file). A checkpoint directory is
    None: its loader checks it as it loads."""
    path = Path(path)
    if path.is_dir():
        return None
    index = read_index(path, cache_dir)
    arch = index.field("general.architecture")
    if not arch:
        return "the file names no architecture (general.architecture)"
    if arch not in SUPPORTED_ARCHS:
        return f"architecture '{arch}' is not one the native engine runs ({', '.join(SUPPORTED_ARCHS)})"
    other = [(name, t.tensor_type.name) for name, t in index.tensors.items()
             if t.tensor_type.name not in NATIVE_MATRIX_TYPES]
    if not other:
        return None
    name, kind = other[0]
    more = f" (as are {len(other) - 1} more tensors)" if len(other) > 1 else ""
    return f"{name} is {kind}, a weight type the native engine does not run{more}"


def native_compiles(path: Path | str, cache_dir: Optional[Path] = None) -> bool:
    """Whether the native engine builds compiled decode graphs for the GGUF at `path` (one it runs:
    `native_refusal` None), from its metadata: not for routed experts or sliding windows yet
    (config.ModelConfig.compiles). Metadata the engine cannot build a model from: True, as for any
    other file; loading it says what is missing, in one line."""
    try:
        return config_from_gguf(read_index(Path(path), cache_dir), str(path)).compiles
    except BackendError:
        return True
