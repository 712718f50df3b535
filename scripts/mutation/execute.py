"""Stage 4: `cosmic-ray exec`, locally or with N HTTP workers, each in its own copy of the sandbox."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from mutation.common import Stop, log
from mutation.sandbox import restore_tree
from mutation.session import write_config


# --- stage 4: exec ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORKER_CODE = ("import sys; from aiohttp import web; from cosmic_ray.distribution.http import handle_mutate_and_test; "
               "app = web.Application(); app.add_routes([web.post('/', handle_mutate_and_test)]); "
               "web.run_app(app, host='127.0.0.1', port=int(sys.argv[1]), print=None)")


def progress(session: Path) -> tuple[int, int]:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome

    with use_db(session, WorkDB.Mode.open) as db:
        done = [r for _, r in db.results if r.worker_outcome != WorkerOutcome.SKIPPED]
        skipped = db.num_results - len(done)
        return len(done), db.num_work_items - skipped


LOST_WORKER = "Cannot connect to host"  # how cosmic-ray's HTTP distributor records a worker that is gone


def forget_lost_workers(session: Path) -> int:
    """Drops the results a dead worker left: cosmic-ray records a refused connection as the mutant's
    abnormal outcome, although the mutant never ran; they run again. Returns how many."""
    with contextlib.closing(sqlite3.connect(session)) as db, db:
        return db.execute("DELETE FROM work_results WHERE worker_outcome = 'ABNORMAL' AND output LIKE ?",
                          (LOST_WORKER + "%",)).rowcount


def run_exec(args, out: Path, tree: Path, env: dict, modules, test_command: str, timeout: float, repo, commit,
             keep=lambda: None):
    """`keep`: called every minute while mutants run (the results carried in the repository)."""
    session = out / "session.sqlite"
    if lost := forget_lost_workers(session):
        log(f"[exec] {lost} results left by a worker that was gone: run again")
    done, total = progress(session)
    if done >= total:
        log(f"[exec] all {total} mutants have results")
        return
    log(f"[exec] {total - done} of {total} mutants to run (per-mutant timeout {timeout:.0f} s, "
        f"{args.workers} worker(s))")
    workers, proc = [], None
    config = out / "cosmic-ray.toml"
    try:
        if args.workers > 1:
            urls = []
            for i in range(args.workers):
                copy = out / "workers" / f"w{i}"
                if not copy.exists():
                    shutil.copytree(tree, copy, symlinks=True)
                restore_tree(repo, commit, copy, modules)
                port = free_port()
                workers.append(subprocess.Popen([sys.executable, "-c", WORKER_CODE, str(port)], cwd=copy, env=env,
                                                stdout=subprocess.DEVNULL, stderr=(out / f"worker-{i}.log").open("w"),
                                                start_new_session=True))
                urls.append(f"http://127.0.0.1:{port}")
            time.sleep(3)
            config = out / "cosmic-ray-http.toml"
            write_config(config, modules, test_command, timeout, urls)
        else:
            write_config(config, modules, test_command, timeout)
        start = time.monotonic()
        proc = subprocess.Popen(["cosmic-ray", "exec", str(config), str(session)], cwd=tree, env=env,
                                stderr=(out / "exec.log").open("a"), stdout=subprocess.DEVNULL)
        first = done
        while proc.poll() is None:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            now, _ = progress(session)
            keep()
            rate = (time.monotonic() - start) / max(1, now - first)
            log(f"[exec] {now}/{total} done, {time.monotonic() - start:.0f} s, ~{rate:.0f} s a mutant, "
                f"~{rate * (total - now) / 60:.0f} min left")
        if proc.returncode != 0:
            raise Stop(f"cosmic-ray exec exited {proc.returncode}; see {out / 'exec.log'}")
    finally:
        if proc is not None and proc.poll() is None:  # stopped early: the workers go, so must the distributor
            proc.terminate()
            proc.wait(timeout=30)
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGTERM)
                try:
                    w.wait(timeout=30)
                except subprocess.TimeoutExpired:  # a worker waits for its mutant's tests: they go too
                    os.killpg(w.pid, signal.SIGKILL)
                    w.wait(timeout=30)
