"""`specchat bench` and `specchat ladder` tables read in an 80-column terminal: no line longer than 80,
every header whole on one line, names never wrapped."""
from __future__ import annotations

import pytest
from rich.console import Console

from specchat import bench, ladder
from specchat.profiles import load_profiles
from tests import results

LADDER_HEADERS = ["depth", "t/pass", "t/dp", "by position %", "pass cost", "tok/s", "speed-up"]
BENCH_HEADERS = ["profile", "method", "tok/s", "TTFT", "t/pass", "t/dp", "speed-up"]


def rendered(renderable) -> list[str]:
    console = Console(width=80, record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def header_line(lines: list[str], headers: list[str], after: int = 0) -> int:
    """The index of the line holding every header whole; the header's rule must follow it at once."""
    n = next(i for i, line in enumerate(lines) if i >= after and all(h in line for h in headers))
    assert set(lines[n + 1].strip()) == {"─"}, "the header took more than one line"
    return n


def rows_of(lines: list[str], header: int, caption: str) -> list[str]:
    """The table's lines from below its header to its caption (which starts with `caption`)."""
    rows = []
    for line in lines[header + 2:]:
        if line.startswith(caption):
            break
        rows.append(line)
    return rows


def assert_fits(lines: list[str]) -> None:
    assert max(len(line) for line in lines) <= 80


@pytest.mark.parametrize("depths", [range(1, 7), range(1, 13), [1]])
def test_the_ladder_table_fits_80_columns(depths):
    result = results.ladder("smollm2-mtp-lookup", depths)
    lines = rendered(ladder.render(result))
    assert_fits(lines)
    n = header_line(lines, LADDER_HEADERS)
    rows = rows_of(lines, n, "t/pass: ")
    assert rows[0].startswith("target-only ") and rows[0].rstrip().endswith("1.00x")
    # one line per depth up to 6 (acceptance at positions 1-6 as whole percentages), and every depth's row
    # keeps its figures on its first line; only the positions wrap for deeper drafts
    firsts = [r for r in rows[1:] if r.split()[0].isdigit() and r.startswith(r.split()[0] + " ")]
    assert [int(r.split()[0]) for r in firsts] == list(depths)
    if max(depths) <= 6:
        assert len(rows) == 1 + len(depths)
    for d, r in result.rungs:
        line = next(x for x in firsts if int(x.split()[0]) == d)
        assert f"{result.speedup(r):.2f}x" in line and f"{r.mean_accepted():.2f}" in line
        assert line.split()[3] == f"{r.acceptance_by_position()[0] * 100:.0f}"
        assert line.split()[1] == f"{r.tokens_per_pass():.2f}" and line.split()[2] == f"{r.mean_accepted():.2f}"
    assert "best depth" in "\n".join(lines)


def test_the_bench_table_fits_80_columns_with_the_longest_names():
    ps = load_profiles()
    items = results.prompts()
    spec = ps.get("smollm2-mtp-lookup")
    ref = spec.target_only()
    res = [results.result(spec.name, spec, items, 151.2, ref.name, depth=1),
           results.result(ref.name, ref, items, 1023.4)]
    lines = rendered(bench.render(res))
    assert_fits(lines)
    n = header_line(lines, BENCH_HEADERS)
    assert "backend" not in lines[n] and "torch" in lines[n - 1]  # one backend: named in the title
    rows = rows_of(lines, n, "t/pass: ")
    assert rows[0].startswith("smollm2-mtp-lookup ") and rows[0].rstrip().endswith("0.15x")
    fast = bench.tok_s(res[1].decode_tok_s())
    assert fast.isdigit() and any(r.startswith("smollm2-mtp-lookup:target-only ") and f" {fast} " in r for r in rows)
    assert "12ms" in rows[0]
    # the per-subtask speed-ups: a second table, one column per Spec-Bench subtask
    m = header_line(lines, ["profile", "mt-bench", "transl", "summ", "qa", "math", "rag"], after=n + 1)
    by_task = rows_of(lines, m, "plain numbers: ")
    assert by_task[0].startswith("smollm2-mtp-lookup ") and by_task[0].count("x") == 6
    assert by_task[1].startswith("smollm2-mtp-lookup:target-only ")
    # first-position acceptance per subtask: a third table, for the rows that drafted only
    k = header_line(lines, ["profile", "mt-bench", "transl", "summ", "qa", "math", "rag"], after=m + 1)
    accepted = rows_of(lines, k, "lookup-first rows")
    assert len(accepted) == 1 and accepted[0].split() == ["smollm2-mtp-lookup"] + [
        f"{res[0].acceptance_by_position(t)[0] * 100:.0f}" for t in bench.tasks_of(res)]
    assert accepted[0].split()[1] == "90"  # results.summary accepts 0.9 of the first position


def test_the_bench_table_names_each_backend_when_they_differ():
    ps = load_profiles()
    items = results.prompts(["qa"])
    rows = [results.result(name, ps.get(name), items, 100.0) for name in ("smollm2", "smollm2-llamacpp")]
    ngram = ps.get("smollm2-ngram")
    rows.append(results.result(ngram.name, ngram, items, 150.0, "smollm2", depth=3))
    lines = rendered(bench.render(rows))
    assert_fits(lines)
    n = header_line(lines, BENCH_HEADERS)
    body = rows_of(lines, n, "method (backend)")
    assert len(body) == 3 and "none (llamacpp)" in body[1] and "ngram:3 (torch)" in body[2] and "1.50x" in body[2]
    assert "speed-up by subtask" not in "\n".join(lines)  # one subtask: no second table


def test_the_longest_names_on_two_backends_wrap_only_the_method():
    ps = load_profiles()
    items = results.prompts(["qa"])
    spec = ps.get("smollm2-mtp-lookup")
    ref = spec.target_only()
    rows = [results.result(spec.name, spec, items, 150.0, ref.name, depth=1),
            results.result(ref.name, ref, items, 100.0),
            results.result("smollm2-llamacpp", ps.get("smollm2-llamacpp"), items, 300.0)]
    lines = rendered(bench.render(rows))
    assert_fits(lines)
    n = header_line(lines, BENCH_HEADERS)
    body = rows_of(lines, n, "method (backend)")
    firsts = [line for line in body if not line.startswith(" ")]
    assert [line.split()[0] for line in firsts] == [spec.name, ref.name, "smollm2-llamacpp"]  # whole names
    assert "1.50x" in firsts[0] and "300.0" in firsts[2]
    continued = " ".join(line.strip() for line in body)
    assert "+lookup:3" in continued and "(llamacpp)" in continued and "(torch)" in continued
