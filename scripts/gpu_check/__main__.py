"""The device check: logits, the speculative parity grid, compiled against eager, decode speed.

    python -m gpu_check [--cpu] [--out DIR] [--parts a,b] [--threads N] [--peak-tb-s X]

Run through scripts/gpu_check.sh, which installs what the machine lacks first. Writes
DIR/report.json, DIR/summary.txt and DIR/log.txt (everything the libraries print); the output
folder is --out, else $OUT. Exit 0 when every part that ran passed, 1 otherwise, 2 for bad input.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

PARTS = ("logits", "parity", "compiled", "speed", "speed_compiled")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise SystemExit(usage_error(message))


def usage_error(message: str) -> int:
    print(f"gpu_check: {message}", file=sys.stderr)
    return 2


def parse(argv: list[str]) -> argparse.Namespace:
    ap = OneLineParser(prog="gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run on CPU with small shapes (seconds)")
    ap.add_argument("--out", type=Path, help="output folder (default: $OUT)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for the engines (0: every physical core)")
    ap.add_argument("--peak-tb-s", type=float, default=None,
                    help="the GPU's peak memory bandwidth in TB/s (default: the H200's 4.8)")
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part {unknown[0]!r}; the parts are {', '.join(PARTS)}")
    if args.threads < 0 or (args.peak_tb_s is not None and args.peak_tb_s <= 0):
        ap.error("--threads must be 0 or more and --peak-tb-s above 0")
    if args.out is None:
        if not os.environ.get("OUT"):
            ap.error("no output folder: pass --out DIR (or set OUT)")
        args.out = Path(os.environ["OUT"])
    return args


def run_part(name: str, fn, part, report: dict) -> None:
    record = report["parts"][name] = {"status": "running", "seconds": 0.0}
    try:
        result = fn(part)
        record |= {"status": "passed" if result["passed"] else "failed", "result": result}
    except Exception:
        record |= {"status": "error", "error": traceback.format_exc()}
    record |= {"seconds": part.seconds(), "skipped": part.skipped}


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        return usage_error("no CUDA device here (torch.cuda.is_available() is False); --cpu runs the CPU check")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        log = open(args.out / "log.txt", "w")
    except OSError as e:
        return usage_error(f"cannot write to {args.out}: {e.strerror}")
    # everything the libraries print goes to the log; stderr is then no terminal, so no progress
    # bar asks for rich (an app dependency the machine may lack)
    os.dup2(log.fileno(), 2)
    return run(args)


def run(args: argparse.Namespace) -> int:
    from .tree import use_tree

    use_tree()
    from . import checkpoints, compiled, logits, parity, report, speed
    from .budget import Clock, Part
    from .plan import H200_TB_S, cpu_plan, cuda_plan

    plan = cpu_plan(args.threads) if args.cpu else cuda_plan(args.threads, args.peak_tb_s or H200_TB_S)
    if args.threads:  # transformers' models too: every engine sets torch's threads as it loads
        import torch

        torch.set_num_threads(args.threads)
    out = {"mode": "cpu" if args.cpu else "cuda", "status": "running", "plan": asdict(plan),
           "machine": report.machine(), "parts": {}}
    clock = Clock(plan.total_s)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        root = Path(tmp)
        try:
            t = time.perf_counter()
            arch = checkpoints.architecture_checkpoints(root / "arch")
            pair = checkpoints.parity_checkpoints(root / "pair")
            out["setup_s"] = time.perf_counter() - t
            fns = {"logits": lambda part: logits.run(part, plan, arch),
                   "parity": lambda part: parity.run(part, plan, pair),
                   "compiled": lambda part: compiled.run(part, plan, pair),
                   "speed": lambda part: speed.run(part, plan, root, compile=False),
                   "speed_compiled": lambda part: speed.run(part, plan, root, compile=True)}
            for name in PARTS:
                if name not in args.parts or not plan.budgets.get(name):
                    why = f"not in the {out['mode']} plan" if name in args.parts else "not asked for (--parts)"
                    out["parts"][name] = {"status": "not run", "seconds": 0.0, "skipped": [why]}
                    continue
                run_part(name, fns[name], Part(clock, name, plan.budgets[name]), out)
                print(f"{name}: {out['parts'][name]['status']} ({out['parts'][name]['seconds']:.0f} s)", flush=True)
                out["seconds"] = clock.elapsed()
                report.write(args.out, out)
            ran = [p for p in out["parts"].values() if p["status"] != "not run"]
            out["status"] = "passed" if ran and all(p["status"] == "passed" for p in ran) else "failed"
        except KeyboardInterrupt:  # gpu_check.sh's time limit: keep what was measured
            out["status"] = "interrupted"
        out["seconds"] = clock.elapsed()
        report.write(args.out, out)
    print(report.summary(out), end="")
    return 0 if out["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
