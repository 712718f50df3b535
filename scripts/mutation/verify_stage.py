"""Stage 5: each mutant that survived the tests, applied in the sandbox, against `specchat verify` on the
real default model (VERIFY_CHECKS), skipping checks that never run the mutated line."""
from __future__ import annotations

import ast
import concurrent.futures
import difflib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

from mutation.common import PROMPTS, Stop, TRACER, committed_text, log
from mutation.sandbox import restore_tree


# --- verify checks per surviving mutant ------------------------------------------------------------
_V = ["--prompts", "{prompts}", "--max-tokens", "64"]
VERIFY_CHECKS = {  # name -> `specchat verify` arguments; run in this order, the first non-zero exit kills
    "ngram": ["-p", "smollm2-ngram", *_V],
    "mtp-lookup": ["-p", "smollm2-mtp-lookup", *_V],
    "ngram-t0.7": ["-p", "smollm2-ngram", *_V, "--temperature", "0.7", "--seed", "1"],
    "mtp-lookup-t0.7": ["-p", "smollm2-mtp-lookup", *_V, "--temperature", "0.7", "--seed", "1"],
    "ngram-nonstrict": ["-p", "smollm2-ngram", *_V, "--set", "speculative.strict=false"],
    "mtp-lookup-nonstrict": ["-p", "smollm2-mtp-lookup", *_V, "--set", "speculative.strict=false"],
    # suffix decoding and constrained decoding, which the checks above never run (no history: the
    # memory holds what the check's own replies taught it, nothing of the machine's chats)
    "suffix": ["-p", "smollm2-suffix", *_V, "--set", "speculative.suffix.history=false"],
    "suffix-schema": ["-p", "smollm2-suffix", "--prompts", "scripts/extraction-prompts.jsonl", "--limit", "4",
                      "--max-tokens", "64", "--set", "speculative.suffix.history=false"],
}



# --- stage 5: verify -------------------------------------------------------------------------------
def verify_argv(check: str) -> list[str]:
    return [a.replace("{prompts}", str(PROMPTS)) for a in VERIFY_CHECKS[check]]


# A mutant every verify check must see: acceptance keeps the first draft whatever the target chose.
# The checks catch nothing the tests missed when the survivors change no output on their prompts,
# and also when a check cannot see an output change at all; the canary tells the two apart (a
# check that passes with it in place is blind, and the report says so).
CANARY_KEY = "canary"  # its entry in verify.json, beside the mutants' job ids
CANARY = ("backends/speculative/acceptance.py",
          "    while n < len(draft) and draft[n] == target_choice[n]:\n",
          "    while n < len(draft) and (draft[n] == target_choice[n] or n == 0):\n")


RUNNING: set[subprocess.Popen] = set()  # the checks under way, stopped when the run is (stop_checks)
STOPPING = threading.Event()


def stop_checks() -> None:
    """End the checks under way and start no other: their outcomes are not recorded."""
    STOPPING.set()
    for proc in list(RUNNING):
        proc.kill()


def run_check(sandbox: Path, env: dict, check: str, timeout: float) -> tuple[str, str]:
    """One `specchat verify` check in a sandbox: ("passed (N s)" or "killed: KIND (N s)", its output)."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "specchat.cli", "verify", *verify_argv(check)],
                            cwd=sandbox, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    RUNNING.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
        code, text = proc.returncode, out + err
    except subprocess.TimeoutExpired as e:
        proc.kill()
        proc.communicate()
        code, text = "timeout", str(e)
    finally:
        RUNNING.discard(proc)
    secs = time.monotonic() - start
    if code == 0:
        return f"passed ({secs:.0f} s)", text
    kind = ("mismatch" if code == 1 and "Traceback" not in text else "traceback"
            if "Traceback" in text else "timeout" if code == "timeout" else f"exit {code}")
    return f"killed: {kind} ({secs:.0f} s)", text


def run_canary(tree: Path, env: dict, repo: Path, commit: str, checks: list[str], timeout: dict) -> dict:
    """Every check against the canary mutant: {check: its result}."""
    module, line, mutated_line = CANARY
    original = committed_text(repo, commit, module)
    if original is None or original.count(line) != 1:
        log(f"[verify] canary: the line it mutates is not in {module} at this commit; not run")
        return {}
    seen = {}
    try:
        (tree / module).write_text(original.replace(line, mutated_line), encoding="utf-8")
        for check in checks:
            seen[check], _ = run_check(tree, env, check, timeout[check])
            log(f"[verify] canary ({module}: accept the first draft whatever it is) under {check}: {seen[check]}")
    finally:
        (tree / module).write_text(original, encoding="utf-8")
    return seen


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


def mutation_context(original: str, mutated: str) -> str:
    """The nearest non-blank line above the first changed one (whitespace runs as one space): what
    an equivalent.toml entry's optional `before` names where the changed line's text stands
    elsewhere in the module too (a bare `break`)."""
    a, b = original.splitlines(), mutated.splitlines()
    first = next((i1 for tag, i1, *_ in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
                  if tag != "equal"), 0)
    above = [line for line in a[:first] if line.strip()]
    return " ".join(above[-1].split()) if above else ""


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
        if "before" in e and not isinstance(e["before"], str):
            raise Stop(f"{path}: an [[equivalent]] entry's `before` is not a string: {e}")
    return entries


def equivalent_reason(entries, module: str, operator: str, original: str, mutated: str,
                      before: str = "") -> str | None:
    """The reason of the entry that names this mutant (`before`: mutation_context's line, checked
    only where the entry gives one)."""
    for e in entries:
        if (e["module"], e["operator"], " ".join(e["original"].split()), " ".join(e["mutated"].split())) == \
                (module, operator, " ".join(original.split()), " ".join(mutated.split())) \
                and ("before" not in e or " ".join(e["before"].split()) == before):
            return e["reason"]
    return None


def mutant_text(tree_source: str, mu) -> str | None:
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    operator = cosmic_ray.plugins.get_operator(mu.operator_name)(**(mu.operator_args or {}))
    return mutate_code(tree_source, operator, mu.occurrence)


def run_verify(args, out: Path, tree: Path, env: dict, modules: list[str], repo: Path, commit: str,
               keep=lambda: None) -> dict:
    """`keep`: called after each mutant's record is written (the results carried in the repository)."""
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
    if base and results.get(CANARY_KEY, {}).get("checks_asked") != checks:
        results[CANARY_KEY] = {"checks_asked": checks, "checks": run_canary(tree, env, repo, commit, checks, timeout)}
        path.write_text(json.dumps(results, indent=1))
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
        elif reason := equivalent_reason(equivalents, module, mu.operator_name, *mutation_lines(original, mutated),
                                         before=mutation_context(original, mutated)):
            rec.update(outcome="equivalent", reason=reason)
        else:
            rec["outcome"] = "survived"
            lines = header_lines(original, mu.start_pos[0])
            sandbox = free.get()
            try:
                (sandbox / module).write_text(mutated, encoding="utf-8")
                for check in checks:
                    if STOPPING.is_set():
                        return
                    if not set(base["checks"][check]["lines"].get(module, [])).intersection(lines):
                        rec["checks"][check] = "not reached"
                        continue
                    rec["checks"][check], text = run_check(sandbox, env, check, timeout[check])
                    if STOPPING.is_set():  # cut short by the stop, not by the mutant: not recorded
                        return
                    if rec["checks"][check].startswith("killed: "):
                        kind = rec["checks"][check][len("killed: "):].rsplit(" (", 1)[0]
                        rec.update(outcome="killed-verify", kill=kind, by=check, output=text.strip().splitlines()[-8:])
                        break
            finally:
                (sandbox / module).write_text(original, encoding="utf-8")
                free.put(sandbox)
        with lock:
            results[w.job_id] = rec
            path.write_text(json.dumps(results, indent=1))
            keep()
            finished[0] += 1
            log(f"[verify] {finished[0]}/{len(todo)} {module}:{mu.start_pos[0]} {mu.operator_name.split('/')[-1]}: "
                f"{rec['outcome']}" + (f" ({rec['kill']} in {rec['by']})" if rec.get("kill") else "")
                + (f"  [{', '.join(f'{k}: {v}' for k, v in rec['checks'].items())}]" if rec["checks"] else ""))

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(trees))
    try:
        for f in [pool.submit(verify_one, w) for w in todo]:
            f.result()
    except BaseException:  # a stop (SIGTERM's SystemExit) or a failure: no mutant after it is checked
        stop_checks()
        pool.shutdown(wait=True, cancel_futures=True)  # the mutated sandboxes are restored in verify_one
        raise
    pool.shutdown()
    for t in trees:
        for m in modules:
            if (t / m).read_text(encoding="utf-8") != committed_text(repo, commit, m):
                raise Stop(f"could not restore {t / m}")
    return results
