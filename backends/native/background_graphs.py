"""Compiled decode graphs prepared by a background process while the engine answers on its eager
passes; the engine moves to them between replies (`TorchBackend.switch_if_ready`).

A process, not a thread: preparing is minutes of Python (exporting the graphs) and C++ builds, which
in a thread would hold the interpreter against the decode loop. The process runs at the lowest
CPU priority with one compile worker, and the engine's passes leave it a core meanwhile
(`threads_beside`), so that a chat keeps most of its speed (re-measure:
scripts/bench_background_prepare.py; docs/results.md). It loads the model, fills the
graph store (graph_store.py) as `compile: true` would at load, and exits. It outlives the command
that started it, so a one-shot `specchat run` still leaves the store filled for the next start.
One process per store works at a time (a lock file); a second waits for the first and then finds
its graphs stored.

The process is `prepare_graphs.py`.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

from .graph_store import GraphStore, Variant


class Progress(NamedTuple):
    """Where a background preparation stands: `done` of `total` graphs stored; whether the process
    still runs; `failed`: why it ended without storing them all (one line), else None."""
    done: int
    total: int
    running: bool
    failed: Optional[str] = None

    @property
    def ready(self) -> bool:
        """All stored and the process gone (its core back)."""
        return self.done == self.total and not self.running


def side_file(store: GraphStore, suffix: str) -> Path:
    """A file beside the store's directory (created only when the first graph is saved)."""
    return store.root.parent / f"{store.root.name}{suffix}"


CHILD = __name__.rsplit(".", 1)[0] + ".prepare_graphs"  # the module the process runs
_RUNNING: "weakref.WeakSet[BackgroundGraphs]" = weakref.WeakSet()


def threads_beside(threads: int) -> int:
    """How many threads this process's passes should use while a background preparation it
    started runs: one core left to it. Passes whose threads share a core with it ran ~10x slower
    on 2 cores, even at its lowest priority (each parallel region waits for the thread the OS gave
    away); with one thread fewer, 0.66x (re-measure: scripts/bench_background_prepare.py)."""
    alive = any(b.process.poll() is None for b in list(_RUNNING))
    return max(1, threads - 1) if alive else threads


class BackgroundGraphs:
    """One background process storing `variants` of the graphs of the engine `settings` describe
    (TorchBackend's arguments: model path and kind, precision, context, ...)."""

    def __init__(self, store: GraphStore, variants: Sequence[Variant], settings: dict):
        self.store, self.variants = store, list(variants)
        self.log = side_file(store, ".log")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        job = dict(settings, hidden=any(v.keep_hidden for v in self.variants), store=str(store.root),
                   lock=str(side_file(store, ".lock")), failed=str(side_file(store, ".failed")))
        env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1")  # one C++ build at a time beside the chat
        with open(self.log, "w") as log:
            # its own session: a Ctrl-C meant for the chat does not stop it, nor does the chat's exit
            self.process = subprocess.Popen([sys.executable, "-m", CHILD, json.dumps(job)], env=env,
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        _RUNNING.add(self)

    def progress(self) -> Progress:
        done = sum(self.store.path(v).exists() for v in self.variants)
        running = self.process.poll() is None
        failed = None
        if done < len(self.variants) and not running:
            failed = last_line(self.log) or f"it exited with status {self.process.returncode}"
            failed += f" (log: {self.log})"
        return Progress(done, len(self.variants), running, failed)

    def wait(self, timeout: float | None = None) -> Progress:
        """Wait for the process to end (tests, and a caller that would rather wait)."""
        self.process.wait(timeout)
        return self.progress()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def compile_unavailable(store: GraphStore) -> Optional[str]:
    """Why preparing these graphs would fail (None: nothing known): no C++ compiler for torch's CPU
    code, or an earlier preparation of the same store that failed (its line kept beside the
    store; a new torch, engine or model file is another store and is tried again)."""
    import shutil

    # torch's own default (torch._inductor.config.cpp.cxx), whose import would take a second
    compiler = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    if not shutil.which(compiler):
        return (f"torch.compile on CPU needs a C++ compiler ({compiler}), which this machine "
                "lacks; install one (e.g. apt install g++) or set compile: false")
    failed = side_file(store, ".failed")
    if failed.exists():
        return f"{last_line(failed)} (an earlier try; delete {failed} to try again)"
    return None


def is_compiler_error(e: BaseException | None) -> bool:
    """Whether a failed compilation came from the C++ toolchain (missing or broken g++)."""
    while e is not None:
        text = f"{type(e).__name__} {e}".lower()
        if any(word in text for word in ("cxx", "cppcompile", "c++ compiler", "g++")):
            return True
        e = e.__cause__ or e.__context__
    return False


def last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1][:300] if lines else ""
    return ""
