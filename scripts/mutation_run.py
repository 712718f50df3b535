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

--count-only stops after stage 2 and prints the mutant counts. --fresh throws OUT's session away.
The session remembers the commit, modules, limit, rules and test command it was made with; a run
with other ones stops and says so (use --fresh or another --out).
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures
import difflib
import hashlib
import io
import json
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tokenize
import tomllib
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_REPO = HERE.parent
PROMPTS = HERE / "mutation" / "verify-prompts.jsonl"
EQUIVALENT = HERE / "mutation" / "equivalent.toml"
TRACER = HERE / "mutation" / "line_trace.py"
SELECTOR = HERE / "mutation" / "tests_for_mutant.py"

# --- what is mutated -------------------------------------------------------------------------------
# Module -> the top-level functions / classes (or "Class.method") whose lines are in scope; None: the
# whole module. A name the committed tree does not have is reported and skipped (the scope was
# written against the code being edited; it is picked up once that code is committed).
SCOPES: dict[str, list[str] | None] = {
    "backends/speculative/acceptance.py": None,  # accept_exact, accept_rejection, Verdict, _width
    "backends/speculative/loop.py": ["speculative_stream", "target_choices", "keyed_generator", "_sample_dist",
                                     "common_prefix"],
    "backends/speculative/drafters.py": ["NgramDrafter", "LookupFirst", "DraftModelDrafter"],
    "backends/speculative/ngram.py": None,
    "backends/speculative/mtp.py": ["MtpDrafter"],
    "backends/speculative/dflash.py": ["DFlashDrafter", "ContextCache"],
    "backends/speculative/replay.py": ["verify_row_choice"],
    "backends/native/model.py": ["KVCache.write", "KVCache.truncate"],
    "backends/native/sampling.py": None,  # the position-keyed sampler, hash included (its noise is pinned)
    "specchat/compare.py": ["judge_tokens", "first_divergence", "judge_text", "Verdict"],
    "specchat/verify.py": ["shared_arithmetic", "row_choice_function", "judge_replies"],
}

# --- operator pairs kept ---------------------------------------------------------------------------
# cosmic-ray's ReplaceBinaryOperator turns every binary operator into each of the 12 others, and
# ReplaceComparisonOperator every comparison into each of the other 9: on the core that is ~1,600 of
# the ~2,200 mutants in scope. Most pairs only make noise here: `a + b` -> `a ** b`, `a % b`, `a << b`
# on tensors or floats fails at once with a TypeError or blows a shape up (killed by any test, telling
# nothing), and `==` -> `is` on small ints is CPython's int cache, not a bug a test should pin. We keep
# the mistake a person makes: the opposite arithmetic (Add<->Sub, Mul<->Div, Div<->FloorDiv), the
# neighbouring bit operator in the hash (BitXor/BitAnd -> BitOr, BitOr -> BitAnd, LShift<->RShift), the
# off-by-one boundary (Lt<->LtE, Gt<->GtE) and the flipped test (Eq<->NotEq, Is<->IsNot, In<->NotIn).
KEEP_BINARY = {"Add": {"Sub"}, "Sub": {"Add"}, "Mul": {"Div"}, "Div": {"Mul", "FloorDiv"}, "FloorDiv": {"Div"},
               "Mod": {"FloorDiv"}, "Pow": {"Mul"}, "MatMult": {"Mul"}, "BitXor": {"BitOr"}, "BitAnd": {"BitOr"},
               "BitOr": {"BitAnd"}, "LShift": {"RShift"}, "RShift": {"LShift"}}
KEEP_COMPARISON = {"Lt": {"LtE"}, "LtE": {"Lt"}, "Gt": {"GtE"}, "GtE": {"Gt"}, "Eq": {"NotEq"}, "NotEq": {"Eq"},
                   "Is": {"IsNot"}, "IsNot": {"Is"}, "In": {"NotIn"}, "NotIn": {"In"}}
# ReplaceUnaryOperator: USub -> UAdd is the same program as deleting the minus (Delete_USub, kept);
# USub -> Invert / Not on floats and tensors fails at once or turns an index into a bool.
KEEP_UNARY_PREFIX = "Delete_"
# NumberReplacer makes two mutants of every literal, n+1 and n-1 (occurrences 2k and 2k+1): ~350 of the
# core's mutants. The two land on the same site and are killed (or missed) by the same tests, so we keep
# n+1 only: every literal is still mutated once, and the count stays at a few hundred.
NUMBER_KEEP_EVEN_OCCURRENCE = True
# AddNot on a condition that is one ==, !=, is, is not, in, not in comparison is the same program as the
# kept comparison flip, and on `not x` it is the same program as ReplaceUnaryOperator_Delete_Not.
ADDNOT_DEDUPE = True

# Each rule: (name, reason). The reason is written into the session as the skipped item's output
# and into the report.
RULES = {
    "out-of-scope": "outside the speculative core's functions and classes (SCOPES)",
    "annotation": "inside a type annotation: every core module has `from __future__ import annotations`, "
                  "so annotations are never evaluated and the mutant cannot change behaviour",
    "string": "inside a string literal (an error message's f-string): only changes the message text",
    "binary-pair": "ReplaceBinaryOperator pair other than the kept partner (KEEP_BINARY): fails at once or "
                   "duplicates the kept one",
    "comparison-pair": "ReplaceComparisonOperator pair other than the boundary / flip (KEEP_COMPARISON): "
                       "duplicates those, or is CPython small-int caching (== -> is)",
    "unary-pair": "ReplaceUnaryOperator other than deleting the operator: USub->UAdd equals Delete_USub, "
                  "->Invert/->Not fail at once",
    "number-minus-one": "NumberReplacer's n-1 twin of a literal whose n+1 mutant is kept (same site, same tests)",
    "addnot-duplicate": "AddNot on a condition whose negation is already a kept mutant (a single ==/!=/is/in "
                        "comparison: its flip; `not x`: Delete_Not)",
    "limit": "beyond --limit",
}

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
    "tests/speculative/test_loop.py",
    "tests/speculative/test_rejection.py",
    "tests/speculative/test_mtp_drafter.py",
    "tests/speculative/test_dflash.py",
    "tests/speculative/test_gate.py",
    "tests/speculative/test_replay.py",
    "tests/speculative/test_parity.py",
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

# --- verify checks per surviving mutant ------------------------------------------------------------
_V = ["--prompts", "{prompts}", "--max-tokens", "64"]
VERIFY_CHECKS = {  # name -> `specchat verify` arguments; run in this order, the first non-zero exit kills
    "ngram": ["-p", "smollm2-ngram", *_V],
    "mtp-lookup": ["-p", "smollm2-mtp-lookup", *_V],
    "ngram-t0.7": ["-p", "smollm2-ngram", *_V, "--temperature", "0.7", "--seed", "1"],
    "mtp-lookup-t0.7": ["-p", "smollm2-mtp-lookup", *_V, "--temperature", "0.7", "--seed", "1"],
    "ngram-nonstrict": ["-p", "smollm2-ngram", *_V, "--set", "speculative.strict=false"],
    "mtp-lookup-nonstrict": ["-p", "smollm2-mtp-lookup", *_V, "--set", "speculative.strict=false"],
}


class Stop(Exception):
    """A reason to stop, printed as one line."""


def log(msg: str) -> None:
    print(msg, flush=True)


def sandbox_env(out: Path) -> dict:
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONSTARTUP"):
        env.pop(var, None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # On 2 shared cores torch's OpenMP threads spin while they wait; with another busy process (a
    # measurement, a second worker) that made the unmutated subset 8x slower (516 s against 64 s).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    home = out / "home"  # `verify` writes nothing that matters, but keep it out of the user's dirs
    env["SPECCHAT_CONFIG_DIR"] = str(home / "config")
    env["SPECCHAT_DATA_DIR"] = str(home / "data")
    env["SPECCHAT_PROFILES_DIR"] = str(home / "profiles")
    return env


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def committed_text(repo: Path, commit: str, path: str) -> str | None:
    done = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"], capture_output=True)
    return done.stdout.decode("utf-8") if done.returncode == 0 else None


# --- stage 1: sandbox ------------------------------------------------------------------------------
def make_tree(repo: Path, commit: str, tree: Path) -> None:
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(repo), "archive", commit], stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout)
    archive.stdout.close()
    if archive.wait() != 0 or untar.returncode != 0:
        raise Stop(f"git archive {commit} | tar -x -C {tree} failed")
    for link, target in (("specchat/backends", "../backends"), ("specchat/shipped_profiles", "../profiles")):
        if not (tree / link).is_symlink():
            os.symlink(target, tree / link)


def check_imports(tree: Path, env: dict) -> None:
    code = ("import json, specchat, specchat.backends.base as b, specchat.shipped_profiles as p, tests; "
            "print(json.dumps([specchat.__file__, b.__file__, p.__file__, tests.__file__]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise Stop(f"sandbox import check failed in {tree}: {done.stderr.strip().splitlines()[-1:]}")
    for f in json.loads(done.stdout):
        if not os.path.abspath(f).startswith(str(tree) + os.sep):
            raise Stop(f"sandbox import check failed: {f} is imported instead of the sandbox's copy under {tree}")


def restore_tree(repo: Path, commit: str, tree: Path, modules: list[str]) -> None:
    """Put back any module a stopped run left mutated."""
    for m in modules:
        want = committed_text(repo, commit, m)
        if want is not None and (tree / m).read_text(encoding="utf-8") != want:
            log(f"[sandbox] restoring {m} (a previous run stopped with it mutated)")
            (tree / m).write_text(want, encoding="utf-8")


# --- stage 2: init and the skip filter -------------------------------------------------------------
def scope_ranges(source: str, names: list[str] | None) -> tuple[list[tuple[int, int]], list[str]]:
    """Line ranges (decorators included) of the named top-level defs/classes, and the names not found."""
    if names is None:
        return [(1, len(source.splitlines()) + 1)], []
    found: dict[str, tuple[int, int]] = {}

    def span(node) -> tuple[int, int]:
        return min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno

    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in ast.parse(source).body:
        if isinstance(node, defs):
            found[node.name] = span(node)
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, defs):
                        found[f"{node.name}.{sub.name}"] = span(sub)
    return [found[n] for n in names if n in found], [n for n in names if n not in found]


def char_col(line: str, byte_col: int) -> int:
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    lines = source.splitlines()
    spans = []
    for node in ast.walk(ast.parse(source)):
        anns = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            anns.append(node.returns)
            anns += [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x]
        elif isinstance(node, ast.AnnAssign):
            anns.append(node.annotation)
        for x in anns:
            if x is not None:
                spans.append(((x.lineno, char_col(lines[x.lineno - 1], x.col_offset)),
                              (x.end_lineno, char_col(lines[x.end_lineno - 1], x.end_col_offset))))
    return spans


def string_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    toks = tokenize.generate_tokens(io.StringIO(source).readline)
    return [(t.start, t.end) for t in toks if t.type == tokenize.STRING]


def inside(pos: tuple[int, int], spans) -> bool:
    return any(a <= pos < b for a, b in spans)


def rule_for(mutation, module: dict) -> str | None:
    """The RULES key that skips this mutation, or None if it is kept."""
    row = mutation.start_pos[0]
    if not any(a <= row <= b for a, b in module["ranges"]):
        return "out-of-scope"
    pos = tuple(mutation.start_pos)
    if inside(pos, module["annotations"]):
        return "annotation"
    if inside(pos, module["strings"]):
        return "string"
    op = mutation.operator_name.split("/", 1)[-1]
    family, _, pair = op.partition("_")
    if family == "ReplaceBinaryOperator":
        src, dst = pair.split("_")
        return None if dst in KEEP_BINARY.get(src, ()) else "binary-pair"
    if family == "ReplaceComparisonOperator":
        src, dst = pair.split("_")
        return None if dst in KEEP_COMPARISON.get(src, ()) else "comparison-pair"
    if family == "ReplaceUnaryOperator":
        return None if pair.startswith(KEEP_UNARY_PREFIX) else "unary-pair"
    if op == "NumberReplacer" and NUMBER_KEEP_EVEN_OCCURRENCE and mutation.occurrence % 2:
        return "number-minus-one"
    if op == "AddNot" and ADDNOT_DEDUPE and pos in module["negated_elsewhere"]:
        return "addnot-duplicate"
    return None


FLIPPED_ELSEWHERE = (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn)


def negated_elsewhere(source: str) -> set[tuple[int, int]]:
    """Start positions of the expressions whose negation another kept mutant already makes: a single
    ==, !=, is, is not, in, not in comparison, or `not x`. (AddNot mutates the largest expression
    that starts at its position.)"""
    lines = source.splitlines()
    largest: dict[tuple[int, int], ast.expr] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.expr):
            pos = (node.lineno, char_col(lines[node.lineno - 1], node.col_offset))
            best = largest.get(pos)
            if best is None or (node.end_lineno, node.end_col_offset) > (best.end_lineno, best.end_col_offset):
                largest[pos] = node
    return {pos for pos, node in largest.items()
            if (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], FLIPPED_ELSEWHERE))
            or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not))}


def family(operator_name: str) -> str:
    """ReplaceBinaryOperator_Add_Sub -> ReplaceBinaryOperator; core/NumberReplacer -> NumberReplacer."""
    return operator_name.split("/", 1)[-1].split("_")[0]


def write_config(path: Path, modules: list[str], test_command: str, timeout: float, worker_urls=None) -> None:
    lines = ["[cosmic-ray]",
             "module-path = [" + ", ".join(json.dumps(m) for m in modules) + "]",
             f"timeout = {float(timeout)}",
             "excluded-modules = []",
             f"test-command = {json.dumps(test_command)}",
             "",
             "[cosmic-ray.distributor]",
             f'name = "{"http" if worker_urls else "local"}"']
    if worker_urls:
        lines += ["", "[cosmic-ray.distributor.http]",
                  "worker-urls = [" + ", ".join(json.dumps(u) for u in worker_urls) + "]"]
    path.write_text("\n".join(lines) + "\n")


def init_session(args, out: Path, tree: Path, env: dict, modules: list[str], test_command: str) -> dict:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkResult, WorkerOutcome

    session = out / "session.sqlite"
    if session.exists():
        session.unlink()
    write_config(out / "cosmic-ray.toml", modules, test_command, 600)
    log(f"[init] cosmic-ray init over {len(modules)} module(s)")
    done = subprocess.run(["cosmic-ray", "init", str(out / "cosmic-ray.toml"), str(session)], cwd=tree, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise Stop(f"cosmic-ray init failed: {(done.stderr or done.stdout).strip()[-500:]}")

    info = {}
    for m in modules:
        source = (tree / m).read_text(encoding="utf-8")
        ranges, missing = scope_ranges(source, SCOPES[m])
        info[m] = {"ranges": ranges, "missing": missing, "annotations": annotation_spans(source),
                   "strings": string_spans(source), "negated_elsewhere": negated_elsewhere(source)}
    with use_db(session, WorkDB.Mode.open) as db:
        items = db.work_items
        skip: dict[str, list[str]] = defaultdict(list)
        kept = []
        before, kept_by_rules, after = Counter(), Counter(), Counter()
        for item in items:
            (mu,) = item.mutations
            rule = rule_for(mu, info[str(mu.module_path)])
            if rule != "out-of-scope":
                before[(str(mu.module_path), family(mu.operator_name))] += 1
            if rule:
                skip[rule].append(item.job_id)
            else:
                kept.append(item)
                kept_by_rules[(str(mu.module_path), family(mu.operator_name))] += 1
        kept.sort(key=lambda w: (w.mutations[0].module_path.as_posix(), tuple(w.mutations[0].start_pos),
                                 w.mutations[0].operator_name, w.mutations[0].occurrence))
        if args.limit is not None and args.limit < len(kept):
            step = len(kept) / args.limit
            chosen = {int(i * step) for i in range(args.limit)}
            skip["limit"] = [w.job_id for i, w in enumerate(kept) if i not in chosen]
            kept = [w for i, w in enumerate(kept) if i in chosen]
        for w in kept:
            mu = w.mutations[0]
            after[(str(mu.module_path), family(mu.operator_name))] += 1
        for rule, ids in skip.items():
            db.set_multiple_results(ids, WorkResult(worker_outcome=WorkerOutcome.SKIPPED,
                                                    output=f"skipped [{rule}]: {RULES[rule]}"))
    counts = {"work_items": len(items), "skipped": {r: len(v) for r, v in skip.items()},
              "in_scope_before_rules": _nest(before), "in_scope": _nest(kept_by_rules), "to_run_by": _nest(after),
              "to_run": len(kept)}
    return counts


def _nest(c: Counter) -> dict:
    d: dict = defaultdict(dict)
    for (m, f), n in sorted(c.items()):
        d[m][f] = n
    return dict(d)


def print_counts(counts: dict) -> None:
    """Mutants per operator and module: in scope before the operator rules, kept by them, and run
    (the kept ones, less those beyond --limit)."""
    cols = [("in_scope_before_rules", "in scope"), ("in_scope", "kept"), ("to_run_by", "run")]
    by_op = {k: Counter() for k, _ in cols}
    for k, _ in cols:
        for ops in counts[k].values():
            by_op[k].update(ops)
    log(f"[init] {counts['work_items']} work items from cosmic-ray init; skipped: "
        + ", ".join(f"{r} {n}" for r, n in sorted(counts["skipped"].items())))
    head = " ".join(f"{title:>9}" for _, title in cols)
    log(f"[init] {'operator':<48} {head}")
    for op in sorted(by_op["in_scope_before_rules"], key=lambda o: (-by_op["in_scope_before_rules"][o], o)):
        log(f"[init] {op:<48} " + " ".join(f"{by_op[k].get(op, 0):>9}" for k, _ in cols))
    log(f"[init] {'module':<48} {head}")
    for m in counts["in_scope_before_rules"]:
        log(f"[init] {m:<48} " + " ".join(f"{sum(counts[k].get(m, {}).values()):>9}" for k, _ in cols))
    log(f"[init] {'total':<48} " + " ".join(f"{sum(by_op[k].values()):>9}" for k, _ in cols))


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


def run_exec(args, out: Path, tree: Path, env: dict, modules, test_command: str, timeout: float, repo, commit):
    session = out / "session.sqlite"
    done, total = progress(session)
    if done >= total:
        log(f"[exec] all {total} mutants have results")
        return
    log(f"[exec] {total - done} of {total} mutants to run (per-mutant timeout {timeout:.0f} s, "
        f"{args.workers} worker(s))")
    workers = []
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
            rate = (time.monotonic() - start) / max(1, now - first)
            log(f"[exec] {now}/{total} done, {time.monotonic() - start:.0f} s, ~{rate:.0f} s a mutant, "
                f"~{rate * (total - now) / 60:.0f} min left")
        if proc.returncode != 0:
            raise Stop(f"cosmic-ray exec exited {proc.returncode}; see {out / 'exec.log'}")
    finally:
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGTERM)
                w.wait(timeout=30)


# --- stage 5: verify -------------------------------------------------------------------------------
def verify_argv(check: str) -> list[str]:
    return [a.replace("{prompts}", str(PROMPTS)) for a in VERIFY_CHECKS[check]]


def verify_baseline(out: Path, tree: Path, env: dict, modules: list[str], commit: str, checks: list[str]) -> dict:
    path = out / "verify-baseline.json"
    base = json.loads(path.read_text()) if path.exists() else {}
    if base.get("commit") != commit or base.get("prompts") != PROMPTS.read_text():
        base = {"commit": commit, "prompts": PROMPTS.read_text(), "checks": {}}
    for check in checks:
        if check in base["checks"]:
            continue
        log(f"[verify] unmutated baseline of check {check} (traced) ...")
        trace = out / f"trace-{check}.json"
        cmd = [sys.executable, str(TRACER), str(trace), os.pathsep.join(modules), "--", "-m", "specchat.cli",
               "verify", *verify_argv(check)]
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()
            raise Stop(f"verify check {check} fails on the unmutated sandbox (exit {done.returncode}): "
                       f"{tail[-1] if tail else ''}")
        data = json.loads(trace.read_text())
        base["checks"][check] = {"seconds": data["seconds"], "lines": data["lines"],
                                 "summary": done.stdout.strip().splitlines()[-1:]}
        log(f"[verify] {check}: {base['checks'][check]['summary'][0] if base['checks'][check]['summary'] else ''} "
            f"({data['seconds']:.0f} s traced)")
        path.write_text(json.dumps(base))
    return base


def header_lines(source: str, row: int) -> range:
    """The lines of the innermost statement that holds `row`: all of a simple statement, the header
    (decorators to the line before its body) of a compound one. A line tracer sees at least one of
    them whenever the statement runs."""
    best = None
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.stmt):
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        body = [s.lineno for f in ("body", "orelse", "finalbody", "handlers") for s in getattr(node, f, [])]
        end = max(start, min(body) - 1) if body else node.end_lineno
        if start <= row <= end and (best is None or start >= best[0]):
            best = (start, end)
    return range(best[0], best[1] + 1) if best else range(row, row + 1)


def mutation_lines(original: str, mutated: str) -> tuple[str, str]:
    a, b = original.splitlines(), mutated.splitlines()
    old, new = [], []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            old += a[i1:i2]
            new += b[j1:j2]
    norm = lambda lines: "\n".join(" ".join(x.split()) for x in lines)  # noqa: E731
    return norm(old), norm(new)


def load_equivalents(path: Path) -> list[dict]:
    if not path.exists():
        return []
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise Stop(f"{path}: not valid TOML ({e})")
    entries = data.get("equivalent", [])
    for e in entries:
        for key in ("module", "operator", "original", "mutated", "reason"):
            if not isinstance(e.get(key), str) or not e[key].strip():
                raise Stop(f"{path}: an [[equivalent]] entry lacks `{key}`: {e}")
    return entries


def equivalent_reason(entries, module: str, operator: str, original: str, mutated: str) -> str | None:
    for e in entries:
        if (e["module"], e["operator"], " ".join(e["original"].split()), " ".join(e["mutated"].split())) == \
                (module, operator, " ".join(original.split()), " ".join(mutated.split())):
            return e["reason"]
    return None


def mutant_text(tree_source: str, mu) -> str | None:
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    operator = cosmic_ray.plugins.get_operator(mu.operator_name)(**(mu.operator_args or {}))
    return mutate_code(tree_source, operator, mu.occurrence)


def run_verify(args, out: Path, tree: Path, env: dict, modules: list[str], repo: Path, commit: str) -> dict:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    path = out / "verify.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    with use_db(out / "session.sqlite", WorkDB.Mode.open) as db:
        survivors = [(w, r) for w, r in db.completed_work_items
                     if r.worker_outcome == WorkerOutcome.NORMAL and r.test_outcome == TestOutcome.SURVIVED]
    survivors.sort(key=lambda wr: (str(wr[0].mutations[0].module_path), tuple(wr[0].mutations[0].start_pos)))
    equivalents = load_equivalents(args.equivalent)
    checks = args.verify_checks
    todo = [w for w, _ in survivors if w.job_id not in results or results[w.job_id].get("checks_asked") != checks
            or results[w.job_id].get("outcome") == "equivalent"]  # the list may have lost the entry
    if not survivors:
        log("[verify] no mutant survived the tests")
        return results
    log(f"[verify] {len(survivors)} mutants survived the tests; {len(todo)} to check with `specchat verify`")
    base = verify_baseline(out, tree, env, modules, commit, checks) if todo else None
    timeout = {c: 3 * base["checks"][c]["seconds"] + 120 for c in checks} if base else {}
    # One sandbox per parallel verify: the main tree, and the exec workers' copies for --workers > 1.
    trees = [tree] + [out / "workers" / f"w{i}" for i in range(1, args.workers)]
    for t in trees[1:]:
        if not t.exists():
            shutil.copytree(tree, t, symlinks=True, ignore=shutil.ignore_patterns(".hypothesis"))
        restore_tree(repo, commit, t, modules)
    free = queue.Queue()
    for t in trees:
        free.put(t)
    lock = threading.Lock()
    finished = [0]

    def verify_one(w) -> None:
        mu = w.mutations[0]
        module = str(mu.module_path)
        original = committed_text(repo, commit, module)
        mutated = mutant_text(original, mu)
        rec = {"checks_asked": checks, "checks": {}}
        if mutated is None:
            rec["outcome"] = "not-applied"
        elif reason := equivalent_reason(equivalents, module, mu.operator_name, *mutation_lines(original, mutated)):
            rec.update(outcome="equivalent", reason=reason)
        else:
            rec["outcome"] = "survived"
            lines = header_lines(original, mu.start_pos[0])
            sandbox = free.get()
            try:
                (sandbox / module).write_text(mutated, encoding="utf-8")
                for check in checks:
                    if not set(base["checks"][check]["lines"].get(module, [])).intersection(lines):
                        rec["checks"][check] = "not reached"
                        continue
                    start = time.monotonic()
                    try:
                        done = subprocess.run([sys.executable, "-m", "specchat.cli", "verify", *verify_argv(check)],
                                              cwd=sandbox, env=env, capture_output=True, text=True,
                                              timeout=timeout[check])
                        code, text = done.returncode, done.stdout + done.stderr
                    except subprocess.TimeoutExpired as e:
                        code, text = "timeout", str(e)
                    secs = time.monotonic() - start
                    if code == 0:
                        rec["checks"][check] = f"passed ({secs:.0f} s)"
                        continue
                    kind = ("mismatch" if code == 1 and "Traceback" not in text else "traceback"
                            if "Traceback" in text else "timeout" if code == "timeout" else f"exit {code}")
                    rec["checks"][check] = f"killed: {kind} ({secs:.0f} s)"
                    rec.update(outcome="killed-verify", kill=kind, by=check, output=text.strip().splitlines()[-8:])
                    break
            finally:
                (sandbox / module).write_text(original, encoding="utf-8")
                free.put(sandbox)
        with lock:
            results[w.job_id] = rec
            path.write_text(json.dumps(results, indent=1))
            finished[0] += 1
            log(f"[verify] {finished[0]}/{len(todo)} {module}:{mu.start_pos[0]} {mu.operator_name.split('/')[-1]}: "
                f"{rec['outcome']}" + (f" ({rec['kill']} in {rec['by']})" if rec.get("kill") else "")
                + (f"  [{', '.join(f'{k}: {v}' for k, v in rec['checks'].items())}]" if rec["checks"] else ""))

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(trees)) as pool:
        for f in [pool.submit(verify_one, w) for w in todo]:
            f.result()
    for t in trees:
        for m in modules:
            if (t / m).read_text(encoding="utf-8") != committed_text(repo, commit, m):
                raise Stop(f"could not restore {t / m}")
    return results


# --- stage 6: report -------------------------------------------------------------------------------
def classify(result, verify_rec) -> str:
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    if result is None:
        return "pending"
    if result.worker_outcome == WorkerOutcome.SKIPPED:
        return "skipped"
    if result.worker_outcome in (WorkerOutcome.NO_TEST,):
        return "not-applicable"
    if result.worker_outcome != WorkerOutcome.NORMAL or result.test_outcome == TestOutcome.INCOMPETENT:
        return "incompetent"
    if result.test_outcome == TestOutcome.KILLED:
        return "killed-tests"
    if verify_rec is None:
        return "survived-tests"  # verify stage not run yet
    return {"killed-verify": "killed-verify", "equivalent": "equivalent", "not-applied": "not-applicable"} \
        .get(verify_rec["outcome"], "survived")


COLUMNS = ["in scope", "killed by tests", "killed by verify", "equivalent", "survived", "awaiting verify", "not run",
           "n/a", "tests' kill rate", "kill rate"]


def tally(rows) -> dict:
    c = Counter(r["status"] for r in rows)
    killed = c["killed-tests"] + c["killed-verify"]
    na = c["not-applicable"] + c["incompetent"]
    judged = len(rows) - c["equivalent"] - na - c["pending"]  # mutants the tests have seen, equivalents aside
    denominator = judged - c["survived-tests"]  # ... and that verify has seen, where the tests missed them
    return {"in scope": len(rows), "killed by tests": c["killed-tests"], "killed by verify": c["killed-verify"],
            "equivalent": c["equivalent"], "survived": c["survived"], "awaiting verify": c["survived-tests"],
            "not run": c["pending"], "n/a": na,
            "tests' kill rate": f"{100 * c['killed-tests'] / judged:.0f}%" if judged else "-",
            "kill rate": f"{100 * killed / denominator:.0f}%" if denominator else "-",
            "timeouts": sum(1 for r in rows if r.get("timeout")),
            "verify errors": sum(1 for r in rows if r["status"] == "killed-verify"
                                 and r["verify"].get("kill") != "mismatch")}


def report(out: Path, repo: Path, commit: str, plan: dict, verify: dict, equivalents: list[dict]) -> None:
    from cosmic_ray.work_db import WorkDB, use_db

    with use_db(out / "session.sqlite", WorkDB.Mode.open) as db:
        results = dict(db.results)
        items = db.work_items
    sources: dict[str, str] = {}
    rows = []
    for w in items:
        mu = w.mutations[0]
        r = results.get(w.job_id)
        status = classify(r, verify.get(w.job_id))
        if status == "skipped":
            continue
        module = str(mu.module_path)
        row = {"job_id": w.job_id, "module": module, "line": mu.start_pos[0], "col": mu.start_pos[1],
               "operator": mu.operator_name, "occurrence": mu.occurrence, "definition": mu.definition_name,
               "status": status}
        if status == "killed-tests" and r.output == "timeout":
            row["timeout"] = True
        v = verify.get(w.job_id)
        if v:
            row["verify"] = v
        listed = any(e["module"] == module and e["operator"] == mu.operator_name for e in equivalents)
        if status in ("survived", "survived-tests", "equivalent", "killed-verify") or listed:
            if module not in sources:
                sources[module] = committed_text(repo, commit, module)
            mutated = mutant_text(sources[module], mu)
            if mutated is not None:
                row["original"], row["mutated"] = mutation_lines(sources[module], mutated)
                row["diff"] = "\n".join(difflib.unified_diff(sources[module].splitlines(), mutated.splitlines(),
                                                             f"a/{module}", f"b/{module}", lineterm="", n=2))
                reason = equivalent_reason(equivalents, module, mu.operator_name, row["original"], row["mutated"])
                if reason and status in ("survived", "survived-tests", "equivalent", "pending"):
                    row["status"], row["equivalent"] = "equivalent", reason
                elif reason:  # the hand-kept list says it cannot change output, yet something killed it
                    row["listed_equivalent_but_killed"] = reason
        rows.append(row)
    rows.sort(key=lambda r: (r["module"], r["line"], r["col"], r["operator"], r["occurrence"]))
    per_module = {m: tally([r for r in rows if r["module"] == m]) for m in sorted({r["module"] for r in rows})}
    per_operator = {o: tally([r for r in rows if family(r["operator"]) == o])
                    for o in sorted({family(r["operator"]) for r in rows})}
    total = tally(rows)
    data = {"commit": commit, "plan": plan, "total": total, "per_module": per_module, "per_operator": per_operator,
            "mutants": rows}
    (out / "report.json").write_text(json.dumps(data, indent=1))

    def table(title, groups) -> list[str]:
        lines = [f"| {title} | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
        for name, t in groups.items():
            lines.append(f"| {name} | " + " | ".join(str(t[c]) for c in COLUMNS) + " |")
        return lines

    md = ["# Mutation run of the speculative core", "",
          f"Commit `{commit[:12]}`, cosmic-ray {plan.get('cosmic_ray')}, sandbox `{out / 'tree'}`. "
          f"Made by `scripts/mutation_run.py` ({' '.join(plan.get('argv', []))}).", "",
          f"Tests per mutant ({plan.get('baseline_seconds', 0):.0f} s unmutated, timeout "
          f"{plan.get('timeout', 0):.0f} s): `{plan.get('test_command')}`", "",
          "Verify checks per surviving mutant (first non-zero exit kills): "
          + ", ".join(f"`{c}`" for c in plan.get("verify_checks", [])) + f" on `{PROMPTS.relative_to(DEFAULT_REPO)}`.",
          "", "Kill rate = killed (by tests or verify) / (in scope - equivalent - n/a - not run - awaiting verify); "
          "tests' kill rate = killed by tests / (in scope - equivalent - n/a - not run); n/a = the mutation could "
          "not be applied or crashed the worker; awaiting verify = survived the tests, verify not run yet; "
          "not run = no result yet.", ""]
    if plan.get("missing_scopes"):
        md += ["Scopes not in this commit (skipped): " + "; ".join(plan["missing_scopes"]), ""]
    if plan.get("missing_tests"):
        md += ["Test files not in this commit: " + ", ".join(plan["missing_tests"]), ""]
    if plan.get("limit") is not None:
        md += [f"**--limit {plan['limit']}: a sample, not the full scope.**", ""]
    md += table("module", {**per_module, "**total**": total}) + [""]
    md += table("operator", per_operator) + [""]
    md += [f"Timeouts counted as killed by tests: {total['timeouts']}; verify kills by an error (exit 2, "
           f"another exit code, a traceback or a timeout) rather than a mismatch: {total['verify errors']}.", ""]
    md += ["## Skipped by rule", ""] + [f"- {r}: {n} ({RULES[r]})" for r, n in
                                        sorted(plan.get("counts", {}).get("skipped", {}).items())] + [""]
    survivors = [r for r in rows if r["status"] in ("survived", "survived-tests")]
    md += [f"## Survivors ({len(survivors)})", ""]
    for r in survivors:
        checks = r.get("verify", {}).get("checks", {})
        md += [f"### {r['module']}:{r['line']} `{r['operator']}` #{r['occurrence']} in `{r['definition']}`", ""]
        if checks:
            md += ["verify: " + ", ".join(f"{k} {v}" for k, v in checks.items()), ""]
        elif r["status"] == "survived-tests":
            md += ["verify: not run yet", ""]
        md += ["```diff", r.get("diff", "(diff unavailable)"), "```", "",
               "If it cannot change output, add to `scripts/mutation/equivalent.toml`:", "", "```toml",
               "[[equivalent]]", f"module = {json.dumps(r['module'])}", f"operator = {json.dumps(r['operator'])}",
               f"original = {json.dumps(r.get('original', ''))}", f"mutated = {json.dumps(r.get('mutated', ''))}",
               'reason = "..."', "```", ""]
    eq_rows = [r for r in rows if r["status"] == "equivalent"]
    if eq_rows:
        md += [f"## Equivalent ({len(eq_rows)})", ""]
        md += [f"- {r['module']}:{r['line']} `{r['operator']}`: `{r.get('original')}` -> `{r.get('mutated')}`: "
               f"{r['equivalent']}" for r in eq_rows] + [""]
    wrong = [r for r in rows if r.get("listed_equivalent_but_killed")]
    if wrong:
        md += [f"## Listed as equivalent but killed ({len(wrong)}): fix equivalent.toml", ""]
        md += [f"- {r['module']}:{r['line']} `{r['operator']}` ({r['status']}): `{r.get('original')}` -> "
               f"`{r.get('mutated')}`; the list says: {r['listed_equivalent_but_killed']}" for r in wrong] + [""]
    killed_v = [r for r in rows if r["status"] == "killed-verify"]
    if killed_v:
        md += [f"## Killed only by verify ({len(killed_v)}): a test could catch these", ""]
        md += [f"- {r['module']}:{r['line']} `{r['operator']}` ({r['verify'].get('kill')} in "
               f"{r['verify'].get('by')}): `{r.get('original')}` -> `{r.get('mutated')}`" for r in killed_v] + [""]
    (out / "report.md").write_text("\n".join(md))

    log("")
    log(f"{'module':<40} " + " ".join(f"{c:>9}" if len(c) < 10 else f"{c:>16}" for c in COLUMNS))
    for name, t in {**per_module, "total": total}.items():
        log(f"{name:<40} " + " ".join(f"{str(t[c]):>9}" if len(c) < 10 else f"{str(t[c]):>16}" for c in COLUMNS))
    log(f"\n[report] {out / 'report.md'}, {out / 'report.json'}")


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
    run_exec(args, out, tree, env, present, test_command, timeout, repo, commit)
    restore_tree(repo, commit, tree, present)

    # 5. verify
    verify = {} if args.skip_verify else run_verify(args, out, tree, env, present, repo, commit)
    if args.skip_verify and (out / "verify.json").exists():
        verify = json.loads((out / "verify.json").read_text())

    # 6. report
    report(out, repo, commit, plan, verify, load_equivalents(args.equivalent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
