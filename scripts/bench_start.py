"""Start time as a user meets it: from the command to the first token of a short reply, and to
the command's end, for `specchat run` with each profile, over several runs taken in turns.

    python scripts/bench_start.py -p smollm2 -p smollm2-fast -p smollm2-llamacpp --runs 5

prints, per profile, the median and range of both times. The first run of each profile is left
out of the medians (`--warmup`, default 1): it reads the files cold from the disk after another
profile's run. A compiled profile must have its graphs stored already (one `specchat run` with it,
then wait for the background preparation) for a warm start. With `--first-start`, every run
starts with no stored graphs (the graph store is emptied before it, and the background process it
leaves preparing them is stopped after it): the start a new user meets.

    python scripts/bench_start.py -p smollm2 -p smollm2-fast --runs 5 --first-start
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time


def one_start(profile: str, prompt: str) -> tuple[float, float]:
    """(seconds to the first byte of the reply on stdout, seconds to the command's end)."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "specchat.cli", "run", "-p", profile, prompt],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=os.environ)
    first = proc.stdout.read(1)
    first_at = time.perf_counter() - started
    proc.stdout.read()
    if proc.wait() != 0 or not first:
        raise SystemExit(f"specchat run -p {profile} failed (exit {proc.returncode})")
    return first_at, time.perf_counter() - started


def empty_graph_store() -> None:
    """Stop any background preparation and remove every stored graph."""
    from specchat.paths import cache_dir

    subprocess.run(["pkill", "-f", "specchat.backends.native.prepare_graphs"], check=False)
    time.sleep(0.5)
    shutil.rmtree(cache_dir() / "graphs", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--profile", action="append", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompt", default="Say hello.")
    ap.add_argument("--first-start", action="store_true", help="no stored graphs before each run")
    args = ap.parse_args()
    times: dict[str, list[tuple[float, float]]] = {p: [] for p in args.profile}
    for run in range(args.warmup + args.runs):
        for profile in args.profile:
            if args.first_start:
                empty_graph_store()
            first, end = one_start(profile, args.prompt)
            print(f"run {run + 1} {profile}: first token {first:.2f} s, end {end:.2f} s", file=sys.stderr)
            if run >= args.warmup:
                times[profile].append((first, end))
    if args.first_start:
        empty_graph_store()
    print(f"{'profile':28} {'first token (s)':>22} {'end (s)':>22}")
    for profile, rows in times.items():
        cells = []
        for column in zip(*rows):
            cells.append(f"{statistics.median(column):.2f} ({min(column):.2f}-{max(column):.2f})")
        print(f"{profile:28} {cells[0]:>22} {cells[1]:>22}")


if __name__ == "__main__":
    main()
