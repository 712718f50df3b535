"""Decode speed of the torch engine (every precision) against transformers, on one model.

    python3 scripts/bench_engine.py [--model PATH] [--tokens 128] [--threads 0] [--rows ...]

Each row runs in its own process (so peak RSS is per row). Decode tok/s is 1 / the median time
between consecutive tokens of a forced-length reply (eos ignored) to a chat prompt, best of
--repeats runs: other work on the machine only ever slows a run, and the median ignores the
passes it interrupted. The mean rate (tokens after the first / time after the first) is shown too.
Also reports the engine's single-token forward time next to a weight-streaming estimate:
bytes of weights read per token / measured memory bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
ROWS = ["torch:float32", "torch:bfloat16", "torch:int4", "transformers:float32", "transformers:bfloat16"]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_bandwidth_gbs() -> float:
    """Best-of read bandwidth summing a 256 MiB float32 tensor."""
    import torch

    x = torch.ones(64 * 1024 * 1024)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def weight_bytes_per_token(model) -> int:
    """Bytes of matmul weights a greedy single-token forward reads (embedding row lookup excluded;
    with an int8 argmax head, its int8 rows and not the float32 head)."""
    total = 0
    if model.argmax_head is not None:
        head = model.argmax_head
        total += (head.q if head.tiles is None else head.tiles).numel() + 2 * head.scale.numel()
    heads = [] if model.argmax_head is not None else [model.head]
    matmuls = [m for layer in model.layers for m in (layer.attention.qkv, layer.attention.o, layer.mlp.gate_up,
                                                     layer.mlp.down)]
    for lin in matmuls + heads:
        if lin.q4 is not None:  # specchat's kernel: its tiles
            total += lin.q4.numel()
        elif lin.kq is not None:  # a GGUF type's tiles, a segment each
            total += sum(t.numel() for t in lin.kq)
        elif lin.int4 is not None:
            packed, sz, _ = lin.int4
            total += packed.numel() * packed.element_size() + sz.numel() * sz.element_size()
        else:
            total += lin.weight.numel() * lin.weight.element_size()
    return total


def run_torch(model_path: str, precision: str, tokens: int, threads: int, repeats: int) -> dict:
    import torch

    from specchat import paths
    from specchat.backends.base import Request, Sampling, run_to_summary
    from specchat.backends.native.engine import TorchBackend

    row = f"torch:{precision}"
    precision, _, flag = precision.partition("+")  # torch:int4+compile: the compiled decode graphs
    t = time.perf_counter()
    engine = TorchBackend(model_path, precision=precision, threads=threads, context=1024, compile=flag == "compile",
                          cache_dir=paths.cache_dir())
    load_s = time.perf_counter() - t
    engine.eos_ids = frozenset()  # forced length
    best, best_mean = 0.0, 0.0
    for _ in range(repeats):
        engine.truncate(0)
        stamps = []
        for event in engine.stream(Request(messages=PROMPT), Sampling(max_tokens=tokens)):
            stamps.append(time.perf_counter())
        best = max(best, _median_rate(stamps[:-1]))
        best_mean = max(best_mean, (len(stamps) - 2) / (stamps[-2] - stamps[0]))
    # single-token forward, best of many, at a mid-reply position
    pos = engine.cache_len
    engine.truncate(pos - 1)
    times = []
    for _ in range(30):
        engine.truncate(pos - 1)
        t = time.perf_counter()
        state, _ = engine.forward([42], pos - 1, all_logits=False, head=False)
        engine.choose(state, [pos], Sampling())  # the greedy token, as the decode above
        times.append(time.perf_counter() - t)
    wbytes = weight_bytes_per_token(engine.model)
    return {"row": row, "decode_tok_s": best, "mean_tok_s": best_mean, "load_s": load_s,
            "peak_rss_mb": peak_rss_mb(),
            "forward_ms": min(times) * 1e3, "weight_mb": wbytes / 1e6, "threads": torch.get_num_threads()}


def run_transformers(model_path: str, dtype: str, tokens: int, threads: int, repeats: int) -> dict:
    import torch

    from specchat.backends.hf_reference import load_hf_model
    from specchat import paths
    from specchat.backends.cpu import thread_count
    from specchat.backends.native.tokenizer import ChatTokenizer

    torch.set_num_threads(thread_count(threads))
    t = time.perf_counter()
    model = load_hf_model(Path(model_path), getattr(torch, dtype))
    load_s = time.perf_counter() - t
    ids = torch.tensor([ChatTokenizer(Path(model_path), paths.cache_dir()).encode_chat(PROMPT)])

    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    best, best_mean = 0.0, 0.0
    for _ in range(repeats):
        stamps = Stamps()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0, streamer=stamps)
        generated = stamps.times[1:]  # the first put() is the prompt
        best = max(best, _median_rate(generated))
        best_mean = max(best_mean, (len(generated) - 1) / (generated[-1] - generated[0]))
    return {"row": f"transformers:{dtype}", "decode_tok_s": best, "mean_tok_s": best_mean, "load_s": load_s,
            "peak_rss_mb": peak_rss_mb(), "threads": torch.get_num_threads()}


def _median_rate(stamps: list[float]) -> float:
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    return 1.0 / gaps[len(gaps) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file or model directory (default: the default model)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", nargs="*", default=ROWS)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one row, print JSON
    args = ap.parse_args()
    if args.model is None:
        from specchat.models import pull

        args.model = str(pull())
    if args.one:
        kind, setting = args.one.split(":")
        run = run_torch if kind == "torch" else run_transformers
        print(json.dumps(run(args.model, setting, args.tokens, args.threads, args.repeats)))
        return
    bandwidth = memory_bandwidth_gbs()
    load = os.getloadavg()[0]
    print(f"model: {args.model}\nmemory read bandwidth: {bandwidth:.1f} GB/s; {args.tokens} tokens, "
          f"best of {args.repeats}; load average {load:.1f} on {os.cpu_count()} CPUs "
          f"(other work on the machine slows every row)\n")
    print(f"{'row':24} {'decode tok/s':>12} {'(mean)':>7} {'load s':>7} {'peak RSS MB':>12}  single-token forward")
    for row in args.rows:
        cmd = [sys.executable, __file__, "--model", args.model, "--tokens", str(args.tokens), "--threads",
               str(args.threads), "--repeats", str(args.repeats), "--one", row]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{row:24} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        extra = ""
        if "forward_ms" in r:
            estimate = r["weight_mb"] / 1e3 / bandwidth * 1e3
            extra = (f"{r['forward_ms']:.2f} ms vs {estimate:.2f} ms to stream {r['weight_mb']:.0f} MB of weights")
        print(f"{row:24} {r['decode_tok_s']:12.1f} {r['mean_tok_s']:7.1f} {r['load_s']:7.1f} {r['peak_rss_mb']:12.0f}  "
              f"{extra}", flush=True)


if __name__ == "__main__":
    main()
