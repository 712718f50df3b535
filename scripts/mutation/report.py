"""Stage 6: report.md and report.json, per module and operator, every survivor with its diff."""
from __future__ import annotations

import difflib
import json
from collections import Counter
from pathlib import Path

from mutation.common import DEFAULT_REPO, PROMPTS, committed_text, log
from mutation.scope import RULES, family
from mutation.verify_stage import CANARY_KEY, equivalent_reason, mutant_text, mutation_context, mutation_lines


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
                row["before"] = mutation_context(sources[module], mutated)
                row["diff"] = "\n".join(difflib.unified_diff(sources[module].splitlines(), mutated.splitlines(),
                                                             f"a/{module}", f"b/{module}", lineterm="", n=2))
                reason = equivalent_reason(equivalents, module, mu.operator_name, row["original"], row["mutated"],
                                           row["before"])
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
    canary = verify.get(CANARY_KEY, {}).get("checks", {})
    if canary:
        blind = [c for c, seen in canary.items() if not seen.startswith("killed: mismatch")]
        md += ["Canary (acceptance keeps the first draft whatever the target chose; every check must call it a "
               "mismatch): " + ", ".join(f"{c} {seen}" for c, seen in canary.items()) + ". "
               + (f"**Blind checks: {', '.join(blind)}.**" if blind else "Every check sees it."), ""]
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
               f"# before = {json.dumps(r.get('before', ''))}  (only where the line's text stands elsewhere too)",
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
