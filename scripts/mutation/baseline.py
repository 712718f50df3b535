"""Stage 3, and the tests every mutant runs: the test subset (TEST_FILES, TEST_K), timed once unmutated
under coverage, which writes the map of which test files ran which core lines."""
from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

from mutation.common import SELECTOR, Stop, log


# --- tests per mutant ------------------------------------------------------------------------------
# The fast part of the suite that exercises the core, cheapest first (with -x the first failure ends
# the run). What is left out, and why:
#   test_planted_bugs.py: its tests plant bugs by text into the loaded source, so any mutant on a line
#     it names fails it ("the line to mutate is gone"): a kill for the wrong reason; and 90 s.
#   test_property_*: Hypothesis draws new cases each run (a flaky kill signal), 25 long examples.
#   test_end_to_end_drafted_token_follows_the_target: 1,000 seeded replies (30 s); the rejection rule
#     itself is pinned by the other test_rejection.py tests.
#   test_strict_* / *int4* / test_verify_rows_reach_*: the row-exact bfloat16 and int4 kernels, not the
#     core, and the slowest tests (50 s each under load); the verify stage runs strict and strict=false
#     on the real model.
#   test_copying_runs_*: 25 s, most of it finding a looping prompt; test_lookup_first_copies_past_its
#     _lookup_depth drives the same copy-run path (ngram.py COPY_MIN, LookupFirst) with that prompt.
#   test_profiles_load_*: profile loading, not the core.
#   test_parity.py's grid: depth 3 of the 7 drafters x 3 samplings, and depth 2 of the lookup-first
#     grid, instead of every depth (1..6; 1, 2, 5).
TEST_FILES = [
    "tests/test_compare.py",
    "tests/native/test_sampling.py",
    "tests/speculative/test_ngram.py",
    "tests/speculative/test_suffix_index.py",
    "tests/speculative/test_suffix.py",
    "tests/speculative/test_loop.py",
    "tests/speculative/test_rejection.py",
    "tests/speculative/test_mtp_drafter.py",
    "tests/speculative/test_dflash.py",
    "tests/speculative/test_dspark.py",
    "tests/speculative/test_gate.py",
    "tests/speculative/test_replay.py",
    "tests/speculative/test_parity.py",
    "tests/test_constraint.py",
    "tests/speculative/test_constrained_parity.py",
    "tests/test_verify.py",
    "tests/speculative/test_drafters.py",
    "tests/test_cli.py::test_verify_says_whether_verification_was_strict",  # judge_replies via `verify`
]
TEST_K = ("not test_property and not test_end_to_end_drafted and not test_strict and not int4 "
          "and not test_verify_rows_reach and not test_profiles_load and not test_copying_runs "
          "and (not test_speculative_equals_target_only or -3-) and (not test_lookup_first_keeps_parity or -2-)")
# --hypothesis-profile=ci: derandomized and no example database, so a mutant's verdict does not depend
# on the failing examples earlier mutants left in .hypothesis/ (test_sampling's property test).
TEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider", "-m", "not slow", "--hypothesis-profile=ci"]


# --- stage 3: baseline -----------------------------------------------------------------------------
def test_command_for(tree: Path, out: Path) -> tuple[str, list[str]]:
    """The per-mutant command: the subset's files that executed the mutated statement (SELECTOR)."""
    files = [f for f in TEST_FILES if (tree / f.split("::")[0]).exists()]
    missing = [f for f in TEST_FILES if f not in files]
    cmd = [sys.executable, str(SELECTOR), "run", str(out / "test-map.json"), "--",
           *TEST_ARGS, "-k", TEST_K, *files]
    return shlex.join(cmd), missing


def baseline(tree: Path, env: dict, out: Path, modules: list[str]) -> float:
    """Run the subset unmutated under coverage: it must pass, and it writes the line -> test file map
    the per-mutant command selects from."""
    log("[baseline] the per-mutant test subset on the unmutated sandbox, mapping which files run which lines ...")
    files = [f for f in TEST_FILES if (tree / f.split("::")[0]).exists()]
    cmd = [sys.executable, str(SELECTOR), "map", str(out / "test-map.json"), *modules, "--",
           *TEST_ARGS, "-k", TEST_K, *files]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    tail = (done.stdout + done.stderr).strip().splitlines()
    if done.returncode != 0:
        raise Stop(f"the test subset fails on the unmutated sandbox ({tail[-1] if tail else done.returncode})")
    log(f"[baseline] {tail[-1] if tail else ''} -- {seconds:.0f} s")
    return seconds
