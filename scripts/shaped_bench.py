"""The real-size table: specchat's engine against llama.cpp on GGUFs of a real model's shapes, by
weight type. Random weights make the replies noise: the table is about speed and memory only.

    python scripts/shaped_gguf.py --shape smollm2-1.7b --types Q4_0,Q4_K_M,Q6_K,Q8_0 --out /work/shaped
    python scripts/shaped_bench.py --dir /work/shaped --shape smollm2-1.7b --types Q4_0,Q4_K_M,Q6_K,Q8_0

For each file, one after another (never two at once):
- resident memory: the weights the engine holds once loaded (its own count, `memory_plan.held_bytes`),
  and the peak resident memory of a short `specchat run` on each engine (`/usr/bin/time`), against the
  file's size;
- a one-token decode step against the streaming bound, and verify blocks of 1, 2, 4, 8 and 16 rows
  in one-token passes (`scripts/decode_step.py`, compiled graphs, made on first use);
- one interleaved `specchat bench` of eager target-only (`smollm2`), compiled target-only (the
  target-only row of `smollm2-fast`) and prompt lookup on it, llama.cpp in-process (its extra
  buffers where the CPU allows them) and llama-server (`-m FILE` in place of each profile's model),
  decode tok/s and time to the first token (the prefill).
Prints one markdown table a part, and writes them all as JSON with `--json FILE`.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ("smollm2", "smollm2-fast", "smollm2-llamacpp", "smollm2-llamaserver")


def held_weights(path: Path) -> dict:
    """What the native engine holds of a loaded model, by part (its own count), in a child process."""
    code = ("import json, sys; from specchat.backends.native.engine import TorchBackend; "
            "from specchat.backends.native.memory_plan import held_bytes; "
            "print(json.dumps(held_bytes(TorchBackend(sys.argv[1], context=1024, threads=2).model)))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def peak_rss(path: Path, profile: str) -> int:
    """Peak resident bytes of a 32-token `specchat run` of `profile` on the file (eager for the native engine)."""
    cmd = ["/usr/bin/time", "-f", "%M", "specchat", "run", "-m", str(path), "-p", profile, "--set", "compile=false",
           "--set", "context=1024", "--max-tokens", "32", "Tell me about bicycles."]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return int(out.stderr.strip().splitlines()[-1]) * 1024


def decode_step(path: Path, steps: int) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "decode_step.py"), "-m", str(path), "--steps",
                          str(steps), "--rows", "1", "2", "4", "8", "16"], capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    step = float(re.search(r"step ([\d.]+) ms", text).group(1))
    blocks = {int(k): float(x) for k, x in re.findall(r"(\d+): [\d.]+ \(([\d.]+)x\)", text.split("verify block")[1])}
    bound = re.search(r"at ([\d.]+) GB/s: ([\d.]+) ms", text)
    return {"step_ms": step, "bound_ms": float(bound.group(2)), "bandwidth_gbs": float(bound.group(1)), "rows": blocks}


def bench(path: Path, prompts: str, limit: int, tokens: int) -> list[dict]:
    cmd = ["specchat", "bench", "-m", str(path), *[a for p in PROFILES for a in ("-p", p)], "--prompts", prompts,
           "--limit", str(limit), "--max-tokens", str(tokens), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["rows"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="where scripts/shaped_gguf.py wrote the files")
    ap.add_argument("--shape", default="smollm2-1.7b")
    ap.add_argument("--types", default="Q4_0,Q4_K_M,Q6_K,Q8_0")
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "data" / "spec-bench" / "question.jsonl"))
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args()
    results = {}
    for qtype in args.types.split(","):
        path = args.dir / f"{args.shape}-{qtype}.gguf"
        if not path.exists():
            sys.exit(f"{path} is missing: write it with scripts/shaped_gguf.py --shape {args.shape} --types {qtype}")
        size = path.stat().st_size
        print(f"{path.name}: memory", file=sys.stderr, flush=True)
        held = held_weights(path)
        peaks = {p: peak_rss(path, p) for p in ("smollm2", "smollm2-llamacpp")}
        print(f"{path.name}: decode step and verify blocks", file=sys.stderr, flush=True)
        step = decode_step(path, args.steps)
        print(f"{path.name}: bench", file=sys.stderr, flush=True)
        rows = bench(path, args.prompts, args.limit, args.max_tokens)
        results[qtype] = {"file_bytes": size, "held": held, "peak_rss": peaks, "decode_step": step, "bench": rows}

    print(f"\n{args.shape}: memory (GB; weights: what the native engine holds of the layers, head and embedding)\n")
    print("| type | file | weights held | x file | peak RSS specchat | peak RSS llama.cpp |\n|---|---|---|---|---|---|")
    for q, r in results.items():
        w = sum(r["held"][k] for k in ("layers", "head", "embed"))
        print(f"| {q} | {r['file_bytes'] / 1e9:.2f} | {w / 1e9:.2f} | {w / r['file_bytes']:.2f}x | "
              f"{r['peak_rss']['smollm2'] / 1e9:.2f} | {r['peak_rss']['smollm2-llamacpp'] / 1e9:.2f} |")
    print(f"\n{args.shape}: a compiled one-token step and verify blocks (x a one-token pass)\n")
    print("| type | step ms | streaming bound ms | x bound | 2 rows | 4 rows | 8 rows | 16 rows |\n|---|---|---|---|---|---|---|---|")
    for q, r in results.items():
        s = r["decode_step"]
        print(f"| {q} | {s['step_ms']:.1f} | {s['bound_ms']:.1f} | {s['step_ms'] / s['bound_ms']:.2f}x | "
              + " | ".join(f"{s['rows'].get(m, float('nan')):.2f}x" for m in (2, 4, 8, 16)) + " |")
    print(f"\n{args.shape}: decode tok/s, interleaved ({args.limit} Spec-Bench prompts, {args.max_tokens} tokens); "
          "x: against the best llama.cpp row; TTFT in ms\n")
    print("| type | row | tok/s | x llama.cpp's best | TTFT |\n|---|---|---|---|---|")
    for q, r in results.items():
        best = max(x["decode_tok_s"] for x in r["bench"] if x["backend"] in ("llamacpp", "llamaserver"))
        for x in r["bench"]:
            print(f"| {q} | {x['label']} | {x['decode_tok_s']:.1f} | {x['decode_tok_s'] / best:.2f}x | "
                  f"{x['ttft_s'] * 1e3:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
