"""Compiled decode graphs kept on disk, so that a later start loads them in milliseconds instead
of tracing and compiling the model again (minutes).

Each graph is an AOTInductor package (exported_graph.py): a shared library and its wrapper,
loaded without tracing or a compiler. Re-measure: `time specchat run -p smollm2-fast "Say
hello."` twice on a fresh cache (docs/results.md).

A stored graph is never trusted stale:
- its directory is named by a digest of everything the graphs depend on (`store_key`): torch's
  and Python's versions, the source of this engine, the CPU's flags, the model file (path, size,
  modification time) and the settings that shape the graphs;
- each graph is saved with a fingerprint, its output on a fixed input, and a loaded graph must
  reproduce it bit for bit; one that fails to load or differs is removed and made again.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch

from ..cpu import cpu_tag

ENGINE_SOURCE = Path(__file__).parent
log = logging.getLogger(__name__)
Graph = Any  # a loaded graph, as the caller's `load` makes it


class Variant(NamedTuple):
    """One compiled graph: single-token passes or row-exact groups of several rows, with or
    without every layer's output (the taps DFlash and EAGLE-3 read)."""
    one_row: bool
    keep_hidden: bool

    @property
    def file(self) -> str:
        return f"{'one' if self.one_row else 'rows'}{'-hidden' if self.keep_hidden else ''}.pt2"


def origin(model_path: Path, settings: dict) -> str:
    """Which model and settings a store serves; `settings`: what shapes the graphs (precision,
    context, attention mode, ...)."""
    return f"{Path(model_path).resolve()}|{sorted(settings.items())}"


def store_key(model_path: Path, settings: dict) -> str:
    """Digest of everything the compiled graphs depend on."""
    h = hashlib.sha256()
    stat = Path(model_path).stat()
    h.update(f"{origin(model_path, settings)}|{torch.__version__}|{sys.version}|{cpu_tag()}|{stat.st_size}|"
             f"{stat.st_mtime_ns}".encode())
    calls_kernels = str(settings.get("kernel", "")).startswith("specchat") or settings.get("attention") == "kernel"
    kernels = sorted(ENGINE_SOURCE.glob("kernels/*")) if calls_kernels else []
    for source in sorted(ENGINE_SOURCE.glob("*.py")) + kernels:  # the C++ only where the graphs call it
        h.update(source.name.encode() + source.read_bytes())
    return h.hexdigest()[:16]


class GraphStore:
    """The saved graphs of one (model, settings, torch, CPU, engine source) under `root`."""

    def __init__(self, cache_dir: Path, model_path: Path, settings: dict):
        self.origin = origin(model_path, settings)
        self.root = Path(cache_dir) / "graphs" / store_key(model_path, settings)

    def path(self, variant: Variant) -> Path:
        return self.root / variant.file

    def load(self, variant: Variant, load: Callable[[Path], Graph], check: Callable[[Graph], torch.Tensor]
             ) -> Optional[Graph]:
        """The saved graph (`load(path)`) if there is one and `check(graph)` reproduces its
        fingerprint bit for bit; else None (and a stale or broken entry is removed)."""
        path = self.path(variant)
        if not path.exists():
            return None
        try:
            graph = load(path)
            expected = torch.load(path.with_suffix(".fingerprint"), weights_only=True)
            if torch.equal(check(graph), expected):
                return graph
            log.info("stored decode graph %s differs from its fingerprint; making it again", path)
        except Exception:  # noqa: BLE001 - any failure means "make it again", never a broken engine
            log.info("stored decode graph %s does not load; making it again", path, exc_info=True)
        self.remove(variant)
        return None

    def save(self, variant: Variant, write: Callable[[str], None], load: Callable[[Path], Graph],
             check: Callable[[Graph], torch.Tensor]) -> Graph:
        """The graph `write(path)` makes, stored with its fingerprint (`check`) and loaded back.
        Written under a temporary name and renamed, so that a concurrent or interrupted start
        never reads half a graph."""
        if not self.root.exists():
            self.remove_stale()
            self.root.mkdir(parents=True)
            (self.root / "origin.txt").write_text(self.origin)
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp.pt2")
        os.close(fd)
        try:
            write(tmp)
            graph = load(Path(tmp))  # the library is loaded: renaming its package leaves it usable
            torch.save(check(graph), tmp + ".fp")
            os.replace(tmp + ".fp", self.path(variant).with_suffix(".fingerprint"))
            os.replace(tmp, self.path(variant))
            return graph
        finally:
            for leftover in (tmp, tmp + ".fp"):
                if os.path.exists(leftover):
                    os.remove(leftover)

    def remove(self, variant: Variant) -> None:
        for p in (self.path(variant), self.path(variant).with_suffix(".fingerprint")):
            p.unlink(missing_ok=True)

    def remove_stale(self) -> None:
        """Other stores of the same model and settings: made by another torch, engine source or
        model file, they can never be loaded again."""
        for other in self.root.parent.glob("*/origin.txt"):
            if other.parent != self.root and other.read_text() == self.origin:
                shutil.rmtree(other.parent, ignore_errors=True)
                for beside in other.parent.parent.glob(f"{other.parent.name}.*"):  # its lock, log, ...
                    beside.unlink(missing_ok=True)
