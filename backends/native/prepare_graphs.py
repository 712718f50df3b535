"""The background process of background_graphs.py: loads the engine with `compile: true`, which
stores its compiled graphs in the graph store, and exits; its last line says why if it could not.

Run as `python -m specchat.backends.native.prepare_graphs JOB_JSON` (BackgroundGraphs does).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..base import BackendError
from .engine import TorchBackend


def prepare(job: dict) -> Optional[str]:
    """Store the graphs `job` describes; why not, in one line (None: stored)."""
    hidden, store = job.pop("hidden"), Path(job.pop("store"))
    job["cache_dir"] = Path(job["cache_dir"])
    try:
        with open(job.pop("lock"), "a") as lock:
            with contextlib.suppress(ImportError):
                import fcntl

                fcntl.flock(lock, fcntl.LOCK_EX)  # another process preparing the same graphs: wait for it
            engine = TorchBackend(job.pop("model_path"), job.pop("kind"), compile=True, **job)
            if hidden:
                engine.warm_up(hidden=True)
    except BackendError as e:
        return str(e)
    except Exception as e:  # the traceback goes to the log; the line to the chat
        import traceback

        traceback.print_exc()
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    if engine.graph_store.root != store:
        return ("specchat's engine changed since the chat started (an upgrade?); its graphs are stored for the "
                "new one: restart specchat to use them")
    missing = [v.file for v in engine.graph_variants(hidden) if not store.joinpath(v.file).exists()]
    return f"compiled, but could not store {', '.join(missing)} in {store}" if missing else None


def main(argv: Sequence[str] | None = None) -> int:
    job = json.loads((argv or sys.argv[1:])[0])
    # The lowest priority the OS offers (SCHED_IDLE on Linux, else nice 19), so that compiling yields
    # to anything else; priority alone did not keep the chat's speed (see threads_beside)
    with contextlib.suppress(AttributeError, OSError):
        os.nice(19)
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    failed = Path(job.pop("failed"))
    why = prepare(job)
    if why is None:
        print("decode graphs stored", flush=True)
        return 0
    print(why, flush=True)
    if "restart specchat" not in why:  # remembered: a later start stays on eager passes at once
        with contextlib.suppress(OSError):
            failed.write_text(why + "\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
