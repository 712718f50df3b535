"""Stage 2: cosmic-ray's config and session, every work item outside the core or made by a noisy operator
pair skipped with its reason, --limit applied; the counts."""
from __future__ import annotations

import json
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

from mutation.common import Stop, log
from mutation.scope import (RULES, SCOPES, annotation_spans, family, negated_elsewhere, rule_for, scope_ranges,
                            string_spans)


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
