"""Run only the tests that execute a mutant's statement: the per-mutant test command of mutation_run.py.

    python scripts/mutation/tests_for_mutant.py map MAP.json MODULE... -- PYTEST_ARGS... FILES...
    python scripts/mutation/tests_for_mutant.py run MAP.json -- PYTEST_ARGS... FILES...

`map` runs the test subset once, unmutated, in-process under coverage, with the coverage context
switched to each test (its node id), and writes MAP.json: for every core module, which tests ran
each of its lines ("" = before any test), each test's and file's time, and the module's unmutated
text. It exits with pytest's code (the subset must pass unmutated).

`run` (from the sandbox cosmic-ray has just mutated) finds the lines whose text differs from the
map's unmutated copy and widens each to its whole statement (a multi-line call counts wherever it
ran). It runs the tests that executed one of them, cheapest first (with -x the first failure ends
it), and if they pass, the rest of those tests' files: a module- or session-scoped fixture runs
core code once, in the setup of whichever test asked first, and every test using it depends on
it. A statement that runs at import (module and class level, a `def` line with its defaults, a
decorator), read from the code since a module imported inside a test runs its top level in that
test's context, is a change every file sees: all files run. A statement no test executed cannot
change any test's outcome: no test runs and the mutant goes on to the verify stage.
"""
from __future__ import annotations

import ast
import difflib
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: tests_for_mutant.py map|run MAP.json [MODULE...] -- PYTEST_ARGS... FILES...")
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def test_files(pytest_args: list[str]) -> list[str]:
    """The positional file arguments (those ending in .py, with or without ::test)."""
    return [a for a in pytest_args if a.split("::")[0].endswith(".py")]


class Recorder:
    """A pytest plugin: coverage's context follows the test being run (its node id)."""

    def __init__(self, cov):
        self.cov = cov
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_setup(self, item):
        self.cov.switch_context(item.nodeid)

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] += report.duration


def build_map(map_path: Path, modules: list[str], pytest_args: list[str]) -> int:
    import coverage
    import pytest

    root = Path.cwd()
    # The sandbox imports backends/ through the specchat/backends symlink: match files by real path.
    wanted = {os.path.realpath(root / m): m for m in modules}
    cov = coverage.Coverage(data_file=None, branch=False)
    recorder = Recorder(cov)
    cov.start()
    try:
        code = pytest.main(pytest_args, plugins=[recorder])
    finally:
        cov.stop()
    data = cov.get_data()
    by_line: dict[str, dict[int, set[str]]] = {m: defaultdict(set) for m in modules}
    measured = [(f, wanted[os.path.realpath(f)]) for f in data.measured_files() if os.path.realpath(f) in wanted]
    for f, m in measured:  # (set_query_contexts takes regexes, and "" would match every context)
        for n, contexts in data.contexts_by_lineno(f).items():
            by_line[m][n].update(contexts)
    lines = {m: {str(n): sorted(c) for n, c in sorted(ran.items())} for m, ran in by_line.items()}
    files = test_files(pytest_args)
    per_file: dict[str, float] = defaultdict(float)
    for node, seconds in recorder.seconds.items():
        per_file[node.split("::")[0]] += seconds
    map_path.write_text(json.dumps({
        "modules": lines,
        "seconds": {f: round(per_file.get(f.split("::")[0], 0.0), 2) for f in files},
        "test_seconds": {n: round(t, 3) for n, t in recorder.seconds.items()},
        "source": {m: (root / m).read_text(encoding="utf-8") for m in modules},
    }))
    return int(code)


def changed_lines(before: str, after: str) -> set[int]:
    """1-based line numbers of `before` that the mutation replaced or deleted (or inserted after)."""
    a, b = before.splitlines(), after.splitlines()
    out: set[int] = set()
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag != "equal":
            out |= set(range(i1 + 1, i2 + 1)) or {max(1, i1)}
    return out


def statement_lines(source: str, line: int) -> tuple[range, bool] | None:
    """The lines of the innermost statement holding `line` (of a compound statement, its header) and
    whether it runs at import (outside every function body: a module or class statement, a `def`
    line with its defaults); None for a decorator line or a line outside every statement. Import
    time is read from the code, not from coverage: a module imported inside a test runs its
    top level in that test's context."""
    best, bodies = None, []
    for node in ast.walk(ast.parse(source)):
        for d in getattr(node, "decorator_list", []):
            if d.lineno <= line <= d.end_lineno:
                return None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bodies.append((node.body[0].lineno, node.end_lineno))
        if isinstance(node, ast.stmt) and node.lineno <= line <= node.end_lineno:
            if best is None or node.lineno >= best.lineno and node.end_lineno <= best.end_lineno:
                best = node
    if best is None:
        return None
    at_import = not any(first <= best.lineno <= last for first, last in bodies)
    body = getattr(best, "body", None)
    if isinstance(body, list) and body and line < body[0].lineno:
        return range(best.lineno, body[0].lineno), at_import or isinstance(best, (ast.FunctionDef, ast.AsyncFunctionDef))
    return range(best.lineno, best.end_lineno + 1), at_import


def tests_for_mutant(test_map: dict, root: Path) -> tuple[list[str] | None, list[str], str]:
    """(the test files to run, None for every file; the tests that executed the mutated statement;
    a one-line reason)."""
    files = list(test_map["seconds"])
    for m, before in test_map["source"].items():
        after = (root / m).read_text(encoding="utf-8")
        if after == before:
            continue
        ran = test_map["modules"].get(m, {})
        nodes: set[str] = set()
        lines = sorted(changed_lines(before, after))
        for line in lines:
            found = statement_lines(before, line)
            if found is None:
                return None, [], f"{m}:{line} is outside any statement (a decorator?): every file"
            span, at_import = found
            contexts = {c for n in span for c in ran.get(str(n), [])}
            if at_import or "" in contexts:
                return None, [], f"{m}:{line} runs at import: every file"
            nodes |= contexts
        in_files = {n.split("::")[0] for n in nodes}
        picked = [f for f in files if f.split("::")[0] in in_files]
        return picked, sorted(nodes), (f"{m}: lines {lines} ran in "
                                       f"{len(nodes)} test(s) of {len(picked)} file(s)")
    return None, [], "no core module differs from the map's copy: every file"


def pytest(args: list[str]) -> int:
    start = time.monotonic()
    code = subprocess.run([sys.executable, "-m", "pytest", *args], env=os.environ).returncode
    print(f"[tests_for_mutant] pytest exited {code} after {time.monotonic() - start:.0f} s", flush=True)
    return code


def run_selected(map_path: Path, pytest_args: list[str]) -> int:
    """First the tests that executed the statement, cheapest first (most mutants die there, in
    seconds); if they all pass, the rest of their files (module fixtures: see the docstring)."""
    test_map = json.loads(map_path.read_text())
    files, nodes, why = tests_for_mutant(test_map, Path.cwd())
    all_files = test_files(pytest_args)
    options = [a for a in pytest_args if a not in all_files]
    chosen = all_files if files is None else [f for f in all_files if f in files]
    chosen.sort(key=lambda f: test_map["seconds"].get(f, 0.0))
    print(f"[tests_for_mutant] {why}", flush=True)
    if not chosen:
        print("[tests_for_mutant] no test executes the mutated statement: nothing to run", flush=True)
        return 0
    seconds = test_map.get("test_seconds", {})
    nodes = sorted(nodes, key=lambda n: seconds.get(n, 0.0))
    if nodes:
        code = pytest([*options, *nodes])
        if code != 0:  # a test failed, or the run broke (a hang cut by the timeout is an internal error):
            return code  # the subset passes unmutated, so the mutant did it
    code = pytest([*options, *(a for n in nodes for a in ("--deselect", n)), *chosen])
    return 0 if code == 5 and nodes else code  # 5: those files hold no other test, all passed already


def main(argv: list[str]) -> int:
    head, pytest_args = split_args(argv)
    if len(head) < 2 or head[0] not in ("map", "run"):
        raise SystemExit("usage: tests_for_mutant.py map|run MAP.json [MODULE...] -- PYTEST_ARGS... FILES...")
    if head[0] == "map":
        return build_map(Path(head[1]), head[2:], pytest_args)
    return run_selected(Path(head[1]), pytest_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
