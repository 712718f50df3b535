#!/usr/bin/env python3
"""Mutation testing of the speculative core with cosmic-ray (8.x), in a sandbox copy of the committed tree.

    python scripts/mutation_run.py [--modules PATH ...] [--limit N] [--out runs/mutation] [--workers N]

Stages (each is resumable: run the same command again and it goes on where it stopped):

1. sandbox   `git archive <rev>` into OUT/tree, never the real checkout. In the installed project
             backends/ is `specchat.backends` and profiles/ is `specchat.shipped_profiles`; the
             sandbox gets symlinks specchat/backends -> ../backends and specchat/shipped_profiles
             -> ../profiles, and every command runs from its root with PYTHONDONTWRITEBYTECODE=1,
             so the sandbox's modules shadow the editable install (checked before anything runs).
2. init      OUT/cosmic-ray.toml, `cosmic-ray init` into OUT/session.sqlite, then every work item
             outside the speculative core (SCOPES below) or made by an operator pair that only makes
             noise here (RULES below) gets a SKIPPED result through cosmic-ray's WorkDB, with the
             reason as its output. `--limit N` keeps N of the rest, spread evenly over the modules.
3. baseline  the test subset (TEST_FILES, TEST_K) once on the unmutated sandbox, under coverage: it
             must pass, and it writes OUT/test-map.json (which test files ran which core lines); its
             time sets the per-mutant timeout (3x, at least 180 s) unless --timeout is given.
4. exec      `cosmic-ray exec` (local distributor; --workers N > 1: N cosmic-ray HTTP workers on
             127.0.0.1, each in its own copy of the sandbox). Each mutant runs only the subset's files
             that executed its statement, cheapest first, stopping at the first failure
             (scripts/mutation/tests_for_mutant.py; all files where it ran at import).
5. verify    each mutant that survived the tests is applied in the sandbox and `specchat verify` runs
             the fixed checks in VERIFY_CHECKS on scripts/mutation/verify-prompts.jsonl with the real
             default model; the file is restored from the commit afterwards. A non-zero exit kills the
             mutant (1: a mismatch; 2, another code, a traceback or a timeout: recorded as an error
             kill). Each check first runs once unmutated under scripts/mutation/line_trace.py; a check
             that never ran the mutated statement cannot see the mutant and is skipped ("not reached").
             Mutants listed in scripts/mutation/equivalent.toml are not run (see that file).
6. report    OUT/report.md and OUT/report.json: per module and operator, killed by tests, killed by
             verify, equivalent, survived, kill rate; every survivor with its line, operator, a unified
             diff and an equivalent.toml stanza to paste once someone has shown it cannot change output.

Each stage is a module of scripts/mutation/ (sandbox, session, baseline, execute, verify_stage, report;
scope holds what is mutated and which mutants are kept, common what they share).

--count-only stops after stage 2 and prints the mutant counts. --fresh throws OUT's session away.
The session remembers the commit, modules, limit, rules and test command it was made with; a run
with other ones stops and says so (use --fresh or another --out).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import signal
import sys
from pathlib import Path

from mutation import carry
from mutation.baseline import TEST_ARGS, TEST_FILES, TEST_K, baseline, test_command_for
from mutation.common import DEFAULT_REPO, EQUIVALENT, Stop, committed_text, git, log, sandbox_env
from mutation.execute import run_exec
from mutation.report import report
from mutation.sandbox import check_imports, make_tree, restore_tree
from mutation.scope import (ADDNOT_DEDUPE, KEEP_BINARY, KEEP_COMPARISON, KEEP_UNARY_PREFIX, NUMBER_KEEP_EVEN_OCCURRENCE,
                            SCOPES, scope_ranges)
from mutation.session import init_session, print_counts
from mutation.verify_stage import VERIFY_CHECKS, load_equivalents, run_verify


# --- main ------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--modules", nargs="+", metavar="PATH", choices=sorted(SCOPES), default=None,
                   help="modules to mutate (default: the whole core: " + ", ".join(SCOPES) + ")")
    p.add_argument("--limit", type=int, default=None, help="run only N of the mutants in scope, spread evenly")
    p.add_argument("--out", default="runs/mutation", help="output folder: sandbox, session, report")
    p.add_argument("--rev", default="HEAD", help="the commit to copy into the sandbox (default HEAD)")
    p.add_argument("--repo", default=str(DEFAULT_REPO), help="the repository (default: this checkout)")
    p.add_argument("--workers", type=int, default=1, help="cosmic-ray HTTP workers in parallel (default 1)")
    p.add_argument("--timeout", type=float, default=None, help="per-mutant test timeout, seconds "
                   "(default: 3x the unmutated subset, at least 180)")
    p.add_argument("--verify-checks", default=",".join(VERIFY_CHECKS),
                   help="comma-separated VERIFY_CHECKS to run on survivors, in order (default: all)")
    p.add_argument("--equivalent", type=Path, default=EQUIVALENT,
                   help="the hand-kept list of equivalent mutants (default scripts/mutation/equivalent.toml)")
    p.add_argument("--skip-verify", action="store_true", help="stop after cosmic-ray exec (report without verify)")
    p.add_argument("--report-only", action="store_true",
                   help="write the report from the session as it stands (a stopped run: the rest counts as not run)")
    p.add_argument("--count-only", action="store_true", help="init and filter, print the counts, stop")
    p.add_argument("--fresh", action="store_true", help="discard the session in --out and start over")
    p.add_argument("--rebaseline", action="store_true",
                   help="time the unmutated test subset again (and reset the default timeout from it)")
    args = p.parse_args(argv)
    args.verify_checks = [c for c in args.verify_checks.split(",") if c]
    for c in args.verify_checks:
        if c not in VERIFY_CHECKS:
            p.error(f"unknown verify check {c}; known: {', '.join(VERIFY_CHECKS)}")
    if shutil.which("cosmic-ray") is None:
        p.error("cosmic-ray is not installed: pip install 'cosmic-ray>=8,<9'")
    # A background run ignores Ctrl-C's signal; stopped with `kill`, it still takes its workers and the
    # distributor down (the `finally` of each stage) instead of leaving them running mutants.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(args)
    except Stop as e:
        log(f"mutation_run: {e}")
        return 2


def run(args) -> int:
    from importlib.metadata import version

    repo = Path(args.repo).resolve()
    out = Path(args.out)
    out = (out if out.is_absolute() else Path.cwd() / out).resolve()
    if (out == repo or repo in out.parents) and not (repo / "runs" == out or repo / "runs" in out.parents):
        raise Stop(f"--out {out} lies inside the checkout outside runs/; pick runs/... or a folder elsewhere")
    tree = out / "tree"
    commit = git(repo, "rev-parse", f"{args.rev}^{{commit}}").strip()
    requested = args.modules or list(SCOPES)
    present = [m for m in requested if committed_text(repo, commit, m) is not None]
    missing_scopes = [f"{m} (not in the commit)" for m in requested if m not in present]
    if not present:
        raise Stop(f"none of the modules is in commit {commit[:12]}: {', '.join(requested)}")
    rules_hash = hashlib.sha256(json.dumps([SCOPES, sorted((k, sorted(v)) for k, v in KEEP_BINARY.items()),
                                            sorted((k, sorted(v)) for k, v in KEEP_COMPARISON.items()),
                                            KEEP_UNARY_PREFIX, NUMBER_KEEP_EVEN_OCCURRENCE, ADDNOT_DEDUPE],
                                           sort_keys=True).encode()).hexdigest()[:16]
    key = {"commit": commit, "modules": present, "limit": args.limit, "rules": rules_hash,
           "tests": [TEST_FILES, TEST_K, TEST_ARGS, "files that ran the line"]}
    plan_path = out / "plan.json"
    plan = json.loads(plan_path.read_text()) if plan_path.exists() else None
    if args.fresh and out.exists():
        for name in ("tree", "workers", "home"):
            shutil.rmtree(out / name, ignore_errors=True)
        for f in out.glob("*"):
            if f.is_file():
                f.unlink()
        plan = None
    if plan and plan.get("key") != key:
        diff = [k for k in key if plan["key"].get(k) != key[k]]
        raise Stop(f"{out} holds a session made with another {', '.join(diff)}; rerun with --fresh to start over "
                   "or pick another --out")
    out.mkdir(parents=True, exist_ok=True)
    env = sandbox_env(out)

    # 1. sandbox
    if plan is None or not (tree / "pyproject.toml").exists():
        log(f"[sandbox] git archive {commit[:12]} -> {tree}")
        make_tree(repo, commit, tree)
        plan = None
    else:
        restore_tree(repo, commit, tree, present)
    check_imports(tree, env)
    test_command, missing_tests = test_command_for(tree, out)
    for m in present:  # names the commit lacks
        source = (tree / m).read_text(encoding="utf-8")
        _, missing = scope_ranges(source, SCOPES[m])
        missing_scopes += [f"{m}: {n} (not in the commit)" for n in missing]
    for line in missing_scopes:
        log(f"[sandbox] scope skipped: {line}")

    # 2. init + filter
    if plan is None or not (out / "session.sqlite").exists():
        counts = init_session(args, out, tree, env, present, test_command)
        plan = {"key": key, "counts": counts, "missing_scopes": missing_scopes, "missing_tests": missing_tests,
                "test_command": test_command, "limit": args.limit, "cosmic_ray": version("cosmic_ray")}
        plan_path.write_text(json.dumps(plan, indent=1))
    print_counts(plan["counts"])
    if args.count_only:
        return 0
    # Only a run of the whole core is carried in the repository (a smaller one would overwrite it).
    carried = carry.record_path(repo, commit) if present == list(SCOPES) and args.limit is None else None

    def keep() -> None:
        if carried:
            carry.save(carried, out / "session.sqlite", out / "verify.json", key)

    if carried:
        taken, verified = carry.restore(carried, out / "session.sqlite", out / "verify.json", key)
        if taken:
            log(f"[carry] {taken} mutants' results (and {verified} verify records) taken from {carried}")

    # 3. baseline
    if "baseline_seconds" not in plan or args.rebaseline or not (out / "test-map.json").exists():
        plan["baseline_seconds"] = baseline(tree, env, out, present)
        plan.pop("timeout", None)
        plan_path.write_text(json.dumps(plan, indent=1))
    else:
        log(f"[baseline] unmutated subset took {plan['baseline_seconds']:.0f} s (measured before)")
    timeout = args.timeout or plan.get("timeout") or max(180.0, round(3 * plan["baseline_seconds"]))
    plan["timeout"] = timeout
    plan["argv"] = sys.argv[1:]
    plan["verify_checks"] = args.verify_checks
    plan_path.write_text(json.dumps(plan, indent=1))

    if args.report_only:
        verify = json.loads((out / "verify.json").read_text()) if (out / "verify.json").exists() else {}
        report(out, repo, commit, plan, verify, load_equivalents(args.equivalent))
        return 0

    # 4. exec
    run_exec(args, out, tree, env, present, test_command, timeout, repo, commit, keep)
    restore_tree(repo, commit, tree, present)
    keep()

    # 5. verify
    verify = {} if args.skip_verify else run_verify(args, out, tree, env, present, repo, commit, keep)
    keep()
    if args.skip_verify and (out / "verify.json").exists():
        verify = json.loads((out / "verify.json").read_text())

    # 6. report
    report(out, repo, commit, plan, verify, load_equivalents(args.equivalent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
