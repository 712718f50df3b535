"""The 4-bit matmuls of one SmolLM2-135M decode pass, on specchat's kernel and on torch's int4
kernel, for blocks of 1..16 rows: time per pass (all 30 layers' qkv, o, gate_up and down) and
each row count in one-row units, interleaved so both kernels see the same machine state.

    python scripts/q4_kernel_bench.py [--rows 1 2 3 4 5 8 16] [--repeats 30] [--threads 2]

Prints the streaming bound of those weights too, from a measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specchat.backends.native import q4_kernel
from specchat.backends.native.int4 import INT4_GROUP, Int4Rows

# SmolLM2-135M: dim 576, 9 query and 3 kv heads of 64, MLP 1536, 30 layers
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def bandwidth_gbs() -> float:
    src = torch.empty(256 * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() / min(times) / 1e9  # read + write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 16])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not q4_kernel.available():
        raise SystemExit("specchat's 4-bit kernel is not available here")

    g = torch.Generator().manual_seed(0)
    mats = [Int4Rows.quantize(torch.randn(n, k, generator=g) * 0.05) for n, k in SHAPES for _ in range(LAYERS)]
    ours = [(q4_kernel.pack(w), w.q.shape[0]) for w in mats]
    theirs = [(torch.ops.aten._weight_int4pack_mm_for_cpu, torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        w.q.to(torch.int32), 1), torch.stack([w.scale.t(), w.zero.t()], -1).to(torch.bfloat16).contiguous())
        for w in mats]
    weight_bytes = sum(t.numel() for t, _ in ours)

    def run_ours(x: dict) -> None:
        for tiles, n in ours:
            torch.ops.specchat.q4_linear(x[tiles.shape[1] * INT4_GROUP], tiles, n)

    def run_torch(x: dict) -> None:
        for op, packed, sz in theirs:
            op(x[sz.shape[0] * INT4_GROUP], packed, INT4_GROUP, sz)  # sz: [K / 32, N, 2]

    results = {("specchat", m): [] for m in args.rows} | {("torch", m): [] for m in args.rows}
    with torch.inference_mode():
        inputs = {m: {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for k in (576, 1536)} for m in args.rows}
        for _ in range(args.repeats):
            for m in args.rows:
                for name, fn in (("specchat", run_ours), ("torch", run_torch)):
                    t0 = time.perf_counter()
                    fn(inputs[m])
                    results[(name, m)].append(time.perf_counter() - t0)
    bw = bandwidth_gbs()
    print(f"ISA {q4_kernel.isa()}, {args.threads} threads; weights {weight_bytes / 1e6:.1f} MB, copy bandwidth "
          f"{bw:.1f} GB/s: streaming bound {weight_bytes / (bw * 1e9) * 1e3:.2f} ms")
    print("| rows | specchat ms | x one row | torch int4 ms | x one row | torch / specchat |")
    print("|---|---|---|---|---|---|")
    med = {key: statistics.median(v) * 1e3 for key, v in results.items()}
    for m in args.rows:
        a, b = med[("specchat", m)], med[("torch", m)]
        print(f"| {m} | {a:.2f} | {a / med[('specchat', args.rows[0])]:.2f} | {b:.2f} | "
              f"{b / med[('torch', args.rows[0])]:.2f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
