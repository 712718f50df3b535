#!/usr/bin/env python3
"""Markdown tables from `specchat bench --json` files written by bench-drafter-depths.sh.

    scripts/bench-table.py OUT/bench-t0.json OUT/bench-t0.7.json [OUT/verify-*.json]
"""
import json
import sys
from pathlib import Path


def table(path: Path) -> str:
    rows = json.loads(path.read_text())["rows"]
    ref = next(r for r in rows if r["method"] == "none")
    lines = [f"`{path.name}`: target-only {ref['decode_tok_s']:.1f} tok/s (median over {ref['prompts']} prompts)", "",
             "| depth | tokens/pass | acceptance by position | decode tok/s | speed-up |", "|---|---|---|---|---|"]
    for r in rows:
        if r["method"] == "none":
            continue
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        lines.append(f"| {r['depth']} | {r['mean_accepted']:.2f} | {acc} | {r['decode_tok_s']:.1f} | {sp} |")
    return "\n".join(lines)


def verify_line(path: Path) -> str:
    v = json.loads(path.read_text())
    return (f"`{path.name}`: {v['prompts']} prompts, {v['identical']} identical, {v['near_ties']} near-ties, "
            f"{v['mismatches']} mismatches")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        p = Path(arg)
        if not p.exists() or not p.stat().st_size:
            print(f"`{p.name}`: missing\n")
            continue
        print((verify_line(p) if p.name.startswith("verify") else table(p)) + "\n")
