"""A built model kept in the cache, so that a warm start maps it from disk instead of building it
again: decoding the file's blocks, repacking them into the kernels' tiles, widening the prefill
copies and quantizing the argmax head are most of the engine's share of a start
(`python scripts/bench_start.py` re-measures; docs/results.md).

An entry is the `Transformer` as build_model made it, less its KV cache and RoPE tables (sized by
the context: made again on load), written by torch.save and read by torch.load(mmap=True): its
tensors are the entry's pages, read when first touched and shared with the page cache, so a load
costs what reading the file costs, not the build's arithmetic. An entry is keyed (derived_files.py)
by the model file, the settings that shape what is built, the ISA the kernels run on here, torch's
version and a digest of the engine's code, so a changed loader or tile layout is a new entry, never
a stale model; one that cannot be read is removed and the model built again. Only CPU models are
kept (on CUDA the weights are copied to the device anyway), and only the newest few entries.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from ..base import BackendError
from ..derived_files import derived_path
from . import memory_plan, weights
from .config import ModelConfig
from .kquant import activation_dtype, has_blocks
from .model import Transformer
from .weights import Checkpoint, build_model, load_hf_dir

log = logging.getLogger(__name__)

KIND = "built-models"
KEEP = 4  # entries kept: a few models switched between; each is about its model's memory on disk
CODE = Path(__file__).parent  # every module and kernel source here shapes what is built
SPARE_DISK = 10 << 30  # disk left free beside an entry (twice its size: the newest and one being written)
SIZED = ("cache", "rope_cos", "rope_sin", "local_rope")  # a model's parts sized by the context: not kept


def load_checkpoint(path: Path, kind: str, keep_int4: bool, cache_dir: Path | None = None, quantize=False):
    if kind == "gguf":
        from .gguf_loader import load_gguf

        return load_gguf(path, keep_int4=keep_int4, cache_dir=cache_dir)  # other types stay as they are
    return load_hf_dir(path, int4=quantize)


def choose_precision(requested: str, device: torch.device, ck: Checkpoint) -> str:
    """'auto' on CPU: the int4 kernel when the GGUF holds Q4 blocks (the fastest path for a small
    model), else float32 (no slower than bfloat16 on CPU for small models; re-measure:
    scripts/bench_engine.py). On CUDA: bfloat16. A fixed rule, not a timing at load, so one
    profile always computes the same thing."""
    if requested != "auto":
        return requested
    if device.type != "cpu":
        return "bfloat16"
    return "int4" if has_blocks(ck.layers) else "float32"


def load_or_build(path: Path, kind: str, precision: str, device: torch.device, context: int, rollback: str,
                  cache_dir: Path | None, check: Callable[[ModelConfig, str], None] = lambda cfg, precision: None,
                  ) -> tuple[Transformer, str, Optional[threading.Thread]]:
    """(the model with a KV cache of `context` positions, at most the model's own limit; its precision;
    the thread storing it for the next start, if one does). `precision` as asked (auto, or one of
    engine.PRECISIONS); `check(config, precision)` may refuse the model (raise) before it is built.
    On CPU with a cache directory, a model kept by an earlier start is mapped from there; else it is
    built from the file and kept."""
    entry = None
    if cache_dir is not None and device.type == "cpu" and enabled():
        settings = dict(kind=kind, precision=precision, rollback=rollback, head=memory_plan.HEAD_FLOAT_MAX_BYTES,
                        copies=weights.DENSE_COPY_MAX_BYTES)
        entry = entry_path(cache_dir, path, settings)
        found = load(entry, context)
        if found is not None:
            check(found[0].cfg, found[1])
            return (*found, None)
    ck = load_checkpoint(path, kind, keep_int4=precision in ("auto", "int4") and device.type == "cpu",
                         cache_dir=cache_dir, quantize=precision == "int4" and device.type == "cpu")
    chosen = choose_precision(precision, device, ck)
    if chosen == "int4" and device.type != "cpu":
        raise BackendError("precision int4 runs on CPU only; use bfloat16 on CUDA")
    check(ck.cfg, chosen)
    dtype = activation_dtype(ck.layers) if chosen == "int4" else getattr(torch, chosen)
    context = min(context, ck.cfg.max_position) if ck.cfg.max_position else context
    model = build_model(ck, dtype, context, int4=chosen == "int4", device=device, rollback=rollback)
    return model, chosen, keep(entry, model, chosen) if entry is not None else None


def enabled() -> bool:
    """SPECCHAT_BUILT_MODELS=0 builds every model from its file (the tests do, so that a test which
    changes how a model is read or built meets its own build, not one kept by another)."""
    return os.environ.get("SPECCHAT_BUILT_MODELS", "1").strip().lower() not in ("0", "off", "false", "no")


@functools.cache
def code_digest() -> str:
    h = hashlib.sha256(torch.__version__.encode())
    for path in sorted(CODE.rglob("*")):
        if path.suffix in (".py", ".h", ".cpp"):
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def entry_path(cache_dir: Path, model_path: Path, settings: dict) -> Path:
    """Where the model built from `model_path` with `settings` (what the caller asked for: precision,
    rollback, ...) is kept."""
    from . import q4_kernel

    isa = q4_kernel.isa() if q4_kernel.available() else "torch"
    parts = [f"{k}={settings[k]}" for k in sorted(settings)] + [isa, code_digest()]
    return derived_path(cache_dir, KIND, Path(model_path), *parts, suffix=".pt")


def load(entry: Path, context: int) -> Optional[tuple[Transformer, str]]:
    """(the model with a cache of `context` positions, its precision) from the entry; None where there
    is none or it cannot be read (then it is removed)."""
    if not entry.exists():
        return None
    try:
        saved = torch.load(entry, mmap=True, weights_only=False)
        model, precision = saved["model"], saved["precision"]
        model.setup_cache(min(context, model.cfg.max_position) if model.cfg.max_position else context)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: build the model again
        log.warning("a stored model could not be read (%s: %s); building it again", type(e).__name__, e)
        entry.unlink(missing_ok=True)
        return None
    os.utime(entry)  # the newest-used entries are the ones kept
    return model, precision


def keep(entry: Path, model: Transformer, precision: str) -> Optional[threading.Thread]:
    """Write the entry in a thread (the first start answers meanwhile; the process waits for it
    before it exits): a shallow copy of the model without its KV cache and RoPE tables (the model
    itself is not touched), then the oldest entries past KEEP removed. A failed write is said in one
    log line and leaves nothing behind; where the disk would keep less than SPARE_DISK beside twice the
    entry, nothing is written."""
    size = sum(n for part, n in memory_plan.held_bytes(model).items() if part != "cache")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(entry.parent).free
    except OSError as e:
        log.warning("the built model is not stored (%s)", e)
        return None
    if free < 2 * size + SPARE_DISK:  # a big model's entry would crowd the disk: every start builds it
        log.warning("the built model (%.1f GB) is not stored: %.1f GB free on the cache's disk", size / 1e9,
                    free / 1e9)
        return None
    bare = copy.copy(model)  # its own attribute dict; modules and parameters shared
    for name in SIZED:
        bare.__dict__[name] = None

    def write() -> None:
        tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
        try:
            torch.save({"model": bare, "precision": precision}, tmp)
            os.replace(tmp, entry)
            for old in sorted(entry.parent.glob("*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)[KEEP:]:
                old.unlink(missing_ok=True)
            for stray in entry.parent.glob("*.pt.tmp*"):  # a write cut off when its process was killed
                if time.time() - stray.stat().st_mtime > 3600:
                    stray.unlink(missing_ok=True)
        except Exception as e:  # noqa: BLE001 - a full disk, or something that does not pickle: not kept
            log.warning("the built model could not be stored (%s: %s); the next start builds it too",
                        type(e).__name__, e)
            tmp.unlink(missing_ok=True)

    thread = threading.Thread(target=write, name="keep-built-model")
    thread.start()
    return thread
