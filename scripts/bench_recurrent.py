"""What a verify block costs on a hybrid (Gated DeltaNet + attention) target against a dense target of
the same size, with the recurrent state rolled back by snapshot and by replay.

Both targets are random checkpoints written by transformers' own classes, SmolLM2-135M's shape
(hidden 576, 30 layers, MLP 1536, 9 query / 3 key-value heads of 64); the hybrid puts a full
attention layer every 4th layer and Qwen3.5's linear heads in proportion (4 key / 8 value heads of
64, 4 conv taps). A "cycle" is what the speculative loop does per pass: a verify block of K rows
after a context of --context tokens, then the rollback to the accepted prefix (half the block; in
replay mode the next block first replays it). Configurations take turns, cycle by cycle, so
machine noise falls on all alike; medians per K. Also prints each mode's rollback memory per block.

    python scripts/bench_recurrent.py --context 512 --cycles 40 --out docs/data/recurrent-block.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' tokenizer writer

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True)
LINEAR = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
              linear_conv_kernel_dim=4, full_attention_interval=4)


def checkpoint(root: Path, kind: str) -> Path:
    """A random model of SHAPE, written once into `root`, with the small tokenizer of the tests."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config

    out = root / kind
    if (out / "config.json").exists():
        return out
    from tests.native.tiny import make_tokenizer

    out.mkdir(parents=True)
    make_tokenizer(out)
    cfg = Qwen3_5TextConfig(**SHAPE, **LINEAR) if kind == "hybrid" else Qwen3Config(**SHAPE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(out))
    return out


def main() -> None:
    from specchat.backends.native.engine import TorchBackend

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--cycles", type=int, default=40, help="cycles per configuration and block size")
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--precision", default="float32")
    ap.add_argument("--models", type=Path, default=Path("runs/bench-recurrent-models"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    configs = {"dense": (checkpoint(args.models, "dense"), "snapshot"),
               "hybrid snapshot": (checkpoint(args.models, "hybrid"), "snapshot"),
               "hybrid replay": (checkpoint(args.models, "hybrid"), "replay")}
    engines = {name: TorchBackend(path, "hf_dir", precision=args.precision, threads=0,
                                  context=args.context + 8 * (args.cycles + 2), rollback=mode)
               for name, (path, mode) in configs.items()}
    ids = torch.randint(3, 300, (args.context + 8 * (args.cycles + 2),), generator=torch.Generator().manual_seed(1))
    ids = ids.tolist()
    times: dict[str, dict[int, list[float]]] = {name: {k: [] for k in rows} for name in engines}
    for k in rows:
        for e in engines.values():
            e.truncate(0)
            e.forward(ids[:args.context], 0)
        pos = {name: args.context for name in engines}
        for _ in range(args.cycles):
            for name, e in engines.items():
                keep = max(1, k // 2)
                start = time.perf_counter()
                e.forward(ids[pos[name]:pos[name] + k], pos[name])
                e.truncate(pos[name] + keep)
                times[name][k].append(time.perf_counter() - start)
                pos[name] += keep
    result = {"context": args.context, "cycles": args.cycles, "precision": args.precision,
              "cpu": cpu_name(), "threads": torch.get_num_threads(),
              "ms": {name: {k: statistics.median(v) * 1e3 for k, v in by_k.items()} for name, by_k in times.items()}}
    state = engines["hybrid snapshot"].model.cache.recurrent
    result["rollback_bytes"] = {mode: {k: state.block_bytes(k, mode) for k in rows} for mode in ("snapshot", "replay")}
    print(f"verify block + rollback, median ms ({args.precision}, context {args.context}, {result['cpu']}, "
          f"{result['threads']} threads)")
    print("rows  " + "".join(f"{name:>17}" for name in engines) + "   snapshot MiB  replay MiB")
    for k in rows:
        cells = "".join(f"{result['ms'][name][k]:17.2f}" for name in engines)
        mib = [result["rollback_bytes"][m][k] / 2**20 for m in ("snapshot", "replay")]
        print(f"{k:4d}  {cells}   {mib[0]:12.2f}  {mib[1]:10.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
