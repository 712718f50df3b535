"""A run's results kept in the repository, so a run at one commit goes on across machines and sessions.

The whole core takes several hours of both cores, longer than a working session, and OUT (under
runs/, ignored) does not outlive the machine. After every minute of exec and every verify result the
finished mutants are written to docs/data/mutation-<commit>.json.gz (compact: outcome, the last
lines of the test output, the verify record); a new session at the same commit and settings
starts its cosmic-ray session, then takes those results back instead of running them again.

cosmic-ray's job ids are new at every `init`, so a mutant is keyed by what makes it: module,
operator, occurrence and position.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from mutation.execute import LOST_WORKER

OUTPUT_TAIL = 1200  # characters of a mutant's test output kept (the failing test's name and assertion)


def record_path(repo: Path, commit: str) -> Path:
    return repo / "docs" / "data" / f"mutation-{commit[:12]}.json.gz"


def mutant_key(item) -> str:
    (mu,) = item.mutations
    return f"{mu.module_path.as_posix()}|{mu.operator_name}|{mu.occurrence}|{mu.start_pos[0]}:{mu.start_pos[1]}"


def _read(path: Path) -> dict | None:
    if not path.exists():
        return None
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def save(path: Path, session: Path, verify_path: Path, plan_key: dict) -> int:
    """Writes every mutant with a result (skipped ones excepted: `init` skips them again); returns how many."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome

    verify = json.loads(verify_path.read_text()) if verify_path.exists() else {}
    exec_results, verify_results = {}, {}
    with use_db(session, WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED or (result.output or "").startswith(LOST_WORKER):
                continue
            key = mutant_key(item)
            exec_results[key] = {"worker": result.worker_outcome.value,
                                 "test": result.test_outcome.value if result.test_outcome else None,
                                 "output": (result.output or "")[-OUTPUT_TAIL:]}
            if item.job_id in verify:
                verify_results[key] = verify[item.job_id]
    record = {"key": plan_key, "exec": exec_results, "verify": verify_results}
    if "canary" in verify:
        record["canary"] = verify["canary"]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    data = json.dumps(record, sort_keys=True, separators=(",", ":")).encode("utf-8")
    with gzip.GzipFile(tmp, "wb", mtime=0) as f:  # mtime 0: the same results give the same bytes
        f.write(data)
    tmp.replace(path)
    return len(exec_results)


def restore(path: Path, session: Path, verify_path: Path, plan_key: dict) -> tuple[int, int]:
    """Gives the session's unfinished mutants the results the record holds for them (only a record made
    with the same commit, modules, limit, rules and tests); returns (exec results, verify results) taken."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkResult

    record = _read(path)
    if not record or record.get("key") != plan_key:
        return 0, 0
    verify = json.loads(verify_path.read_text()) if verify_path.exists() else {}
    taken = verified = 0
    with use_db(session, WorkDB.Mode.open) as db:
        for item in db.pending_work_items:
            r = record["exec"].get(mutant_key(item))
            if r is None:
                continue
            db.set_result(item.job_id, WorkResult(worker_outcome=r["worker"], test_outcome=r["test"],
                                                  output=r["output"]))
            taken += 1
            if (v := record["verify"].get(mutant_key(item))) is not None and item.job_id not in verify:
                verify[item.job_id] = v
                verified += 1
    if "canary" in record and "canary" not in verify:
        verify["canary"] = record["canary"]
    if verified or "canary" in verify:
        verify_path.write_text(json.dumps(verify, indent=1))
    return taken, verified
