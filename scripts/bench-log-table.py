#!/usr/bin/env python3
"""Markdown table from the per-prompt lines `specchat bench` prints on stderr (for a run that did not
finish: tokens/pass aggregated as total tokens / total passes from the per-prompt figures).

    scripts/bench-log-table.py BENCH_STDERR_LOG
"""
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"\s+(\S+) · (\S+)\s+(\d+) tok ([\d.]+) tok/s(?: · ([\d.]+)/pass)?", line)
    if m:
        rows.setdefault(m.group(1), []).append((int(m.group(3)), float(m.group(4)), float(m.group(5) or 1)))
base = statistics.median(x[1] for x in rows['t'])
print('| row | prompts | tokens/pass | median decode tok/s | speed-up |')
print('|---|---|---|---|---|')
for k, v in rows.items():
    tp = sum(x[0] for x in v) / sum(x[0] / x[2] for x in v)
    med = statistics.median(x[1] for x in v)
    print(f"| {k} | {len(v)} | {tp:.2f} | {med:.1f} | {med / base:.2f}x |")
