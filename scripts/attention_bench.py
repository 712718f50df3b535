"""The attention of one SmolLM2-135M pass on specchat's kernel (`attend_rows`): all 30 layers'
calls over a bfloat16 KV cache of C keys, for blocks of 1..8 query rows (a decode step, verify
blocks), in ms per pass and in one-row units.

    python scripts/attention_bench.py [--context 128 512 1024 2048] [--rows 1 2 4 8] [--repeats 30]

To compare two versions of the kernel, run it from each checkout in turn (one library per process).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specchat.backends.native import q4_kernel

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30  # SmolLM2-135M


def pass_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(LAYERS):
            torch.ops.specchat.attend_rows(q, k, v, start)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, nargs="+", default=[128, 512, 1024, 2048])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    if not q4_kernel.available():
        raise SystemExit("specchat's kernels are not built here")
    g = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}; ms per pass (x the one-row pass)")
    for context in args.context:
        k, v = (torch.randn(1, KV_HEADS, context + max(args.rows), HEAD_DIM, generator=g).bfloat16() for _ in range(2))
        cells, one = [], None
        for n in args.rows:
            q = torch.randn(HEADS, n, HEAD_DIM, generator=g).bfloat16()
            pass_ms(q, k, v, context - 1, 3)  # warm-up
            ms = pass_ms(q, k, v, context - 1, args.repeats)
            one = one or ms
            cells.append(f"{n} rows {ms:.3f} ({ms / one:.2f}x)")
        print(f"context {context}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
