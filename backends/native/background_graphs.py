"""Compiled decode graphs prepared by a background process while the engine answers on its eager
passes; the engine moves to them between replies (`TorchBackend.switch_if_ready`).

A process, not a thread: preparing is minutes of Python (dynamo tracing) and C++ builds, which
in a thread would hold the interpreter against the decode loop. The process runs at the lowest
CPU priority with one compile worker, so a reply on a 2-core machine keeps most of its speed
(re-measure: scripts/bench_background_prepare.py; docs/results.md). It loads the model, fills the
graph store (graph_store.py) as `compile: true` would at load, and exits. It outlives the command
that started it, so a one-shot `specchat run` still leaves the store filled for the next start.
One process per store works at a time (a lock file); a second waits for the first and then finds
its graphs stored.

Run as `python -m specchat.backends.native.background_graphs SETTINGS_JSON`.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

from .graph_store import GraphStore, Variant


class Progress(NamedTuple):
    """Where a background preparation stands: `done` of `total` graphs stored; `failed`: why the
    process ended without storing them all (one line), else None."""
    done: int
    total: int
    failed: Optional[str] = None

    @property
    def ready(self) -> bool:
        return self.done == self.total


def side_file(store: GraphStore, suffix: str) -> Path:
    """A file beside the store's directory (created only when the first graph is saved)."""
    return store.root.parent / f"{store.root.name}{suffix}"


class BackgroundGraphs:
    """One background process storing `variants` of the graphs of the engine `settings` describe
    (TorchBackend's arguments: model path and kind, precision, context, ...)."""

    def __init__(self, store: GraphStore, variants: Sequence[Variant], settings: dict):
        self.store, self.variants = store, list(variants)
        self.log = side_file(store, ".log")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        job = dict(settings, hidden=any(v.keep_hidden for v in self.variants),
                   lock=str(side_file(store, ".lock")))
        env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1")  # one C++ build at a time beside the chat
        with open(self.log, "w") as log:
            # its own session: a Ctrl-C meant for the chat does not stop it, nor does the chat's exit
            self.process = subprocess.Popen([sys.executable, "-m", __name__, json.dumps(job)], env=env,
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def progress(self) -> Progress:
        done = sum(self.store.path(v).exists() for v in self.variants)
        failed = None
        if done < len(self.variants) and self.process.poll() is not None:
            failed = last_line(self.log) or f"it exited with status {self.process.returncode}"
            failed += f" (log: {self.log})"
        return Progress(done, len(self.variants), failed)

    def wait(self, timeout: float | None = None) -> Progress:
        """Wait for the process to end (tests, and a caller that would rather wait)."""
        self.process.wait(timeout)
        return self.progress()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1][:300] if lines else ""
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    job = json.loads((argv or sys.argv[1:])[0])
    with contextlib.suppress(AttributeError, OSError):
        os.nice(19)  # the lowest priority: the chat in the foreground keeps the cores
    lock = open(job.pop("lock"), "a")
    with contextlib.suppress(ImportError):
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)  # another process preparing the same graphs: wait for it
    hidden = job.pop("hidden")
    from ..base import BackendError
    from .engine import TorchBackend

    try:
        engine = TorchBackend(job.pop("model_path"), job.pop("kind"), compile=True, **job)
        if hidden:
            engine.warm_up(hidden=True)
        missing = [v.file for v in engine.graph_variants(hidden) if not engine.graph_store.path(v).exists()]
        if missing:
            print(f"compiled, but could not store {', '.join(missing)} in {engine.graph_store.root}", flush=True)
            return 1
    except BackendError as e:
        print(e, flush=True)
        return 1
    print("decode graphs stored", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
