"""The check's output: one JSON report (everything measured, every verdict) and a short summary."""
from __future__ import annotations

import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch


def failure() -> dict:
    """The exception being handled, for the report: one step's error must not hide the others'
    results (on a machine lent for minutes, every finding of one run counts)."""
    exc = sys.exc_info()[1]
    return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300],
            "traceback": traceback.format_exc()[-4000:]}


def machine() -> dict:
    import transformers

    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
            "cpu": platform.processor() or platform.machine()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gb"] = torch.cuda.get_device_properties(0).total_memory / 1e9
    return info


def write(out: Path, report: dict) -> None:
    """Written after every part, so that a run stopped early still leaves what it measured."""
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "summary.txt").write_text(summary(report))


def summary(report: dict) -> str:
    m = report["machine"]
    lines = [f"gpu check, {report['mode']}: {report['status']} in {report.get('seconds', 0):.0f} s "
             f"({m.get('gpu', m['cpu'])}, torch {m['torch']}, transformers {m['transformers']}, {m['date']})"]
    for name, part in report["parts"].items():
        lines.append(f"{name}: {part['status']} ({part['seconds']:.0f} s){_figures(name, part)}")
        lines += [f"  {note}" for note in part.get("skipped", [])]
        if part.get("error"):
            lines.append(f"  error: {part['error'].strip().splitlines()[-1]}")
    return "\n".join(lines) + "\n"


def _figures(name: str, part: dict) -> str:
    r = part.get("result") or {}
    errors = [x for x in r.get("rows", []) + [c for g in r.get("grids", []) for c in g["differences"]]
              + [c for _, c in (r.get("cases") or {}).items()] if "error" in x]
    text = _FIGURES.get(name.split("_")[0], lambda r: "")(r) if r else ""
    if errors:
        text += f"\n  {len(errors)} step(s) failed, the first: {errors[0]['error']}"
    return text


def _logits(r: dict) -> str:
    rows = [x for x in r["rows"] if "engine_error" in x]
    if not rows:
        return ""
    worst = max(rows, key=lambda x: x["engine_error"] / max(x["bound"], 1e-12))
    return (f": {sum(x['passed'] for x in r['rows'])}/{len(r['rows'])} within tolerance; closest to its bound: "
            f"{worst['checkpoint']} {worst['precision']} error {worst['engine_error']:.2e} "
            f"(bound {worst['bound']:.2e})")


def _parity(r: dict) -> str:
    return "".join(f"; {g['precision']}: {g['cases']} cases, strict {g['strict']}, {g['identical']} identical, "
                   f"{g['near_tie']} near-tie, {g['mismatch']} mismatch, {g['errors']} error" for g in r["grids"])


def _compiled(r: dict) -> str:
    d = r["decode_logits"]
    return (f": {r['precision']}, logits max diff {d['max_diff']:.2e}, argmax agreement {d['argmax_agreement']:.2f}; "
            f"{r['identical']} identical, {r['near_tie']} near-tie, {r['mismatch']} mismatch")


def _speed(r: dict) -> str:
    return "".join(_speed_line(row) for row in r["rows"] if "engine_tok_s" in row)


_FIGURES = {"logits": _logits, "parity": _parity, "compiled": _compiled, "speed": _speed}


def _speed_line(row: dict) -> str:
    compiled = " compiled" if row["compiled"] else ""
    text = f"\n  {row['shape']} {row['precision']}{compiled}: engine {row['engine_tok_s']:.1f} tok/s"
    if "transformers_tok_s" in row:
        text += f", transformers {row['transformers_tok_s']:.1f}"
    if "bound_tok_s_peak" in row:
        text += (f", bound {row['bound_tok_s_peak']:.0f} at {row['peak_tb_s']} TB/s "
                 f"({row['fraction_of_peak_bound']:.0%})")
    text += f", bound {row['bound_tok_s_measured']:.0f} at the measured {row['measured_bandwidth_gb_s']:.0f} GB/s"
    if "verify_ms" in row:
        v = row["verify_ms"]
        text += f"; verify 1 row {v[1]:.2f} ms, {max(v)} rows {v[max(v)]:.2f} ms"
    if "loop_overhead_ms" in row:
        text += f"; loop overhead {row['loop_overhead_ms']:.2f} ms/pass"
    return text
