"""What a block of rows costs on specchat's kernels, by GGUF weight type: one matrix multiply of
M = 1, 2, 4, 8, 16 rows, in units of the one-row call, with the weights out of the cache.

    python scripts/kquant_rows_bench.py [--types Q4_0,Q4_K,Q5_K,Q6_K,Q8_0,IQ4_XS] [--shape 8192x2048] [--threads 2]
    SPECCHAT_Q4_ISA=avx2 python scripts/kquant_rows_bench.py   # the AVX2 path (same bits, other speed)

Eight different random matrices of the shape are multiplied in turn (about 80-140 MB of tiles, more
than the last-level cache of the machines here), the best of 10 rounds is kept. A block of rows is
what a verify pass multiplies; where its cost stays near the one-row call, drafts are cheap to check.
Re-measures the prefetch distance in kernels/kquant_avx512vnni.cpp and q4_avx512vnni.cpp.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROWS = (1, 2, 4, 8, 16)


def random_tiles(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    from specchat.backends.native import kquant, q4_kernel
    from specchat.backends.native.int4 import Int4Rows

    if qtype in ("Q4_0", "Q4_1"):
        return q4_kernel.pack(Int4Rows.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed))))
    rng = np.random.default_rng(seed)
    _, size, per = kquant.TYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    where = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q5_1": (0, 2), "Q6_K": (208,)}.get(qtype, (0,))  # fp16 factors
    for at in where:  # finite float16 factors
        raw[..., at:at + 2] = rng.uniform(0, 0.01, size=raw.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
    return kquant.pack(kquant.QuantRows(qtype, torch.from_numpy(raw.reshape(n, -1)), k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_0,Q4_K,Q5_K,Q6_K,Q8_0,IQ4_XS")
    ap.add_argument("--shape", default="8192x2048", help="N x K of each matrix (SmolLM2-1.7B's gate/up)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from specchat.backends.native import kquant, q4_kernel

    if not q4_kernel.available():
        sys.exit("specchat's kernels could not be built here")
    torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.lower().split("x"))
    print(f"{q4_kernel.isa()}, {args.threads} threads, {n}x{k}; ms a call and x the one-row call")
    for qtype in args.types.split(","):
        mats = [random_tiles(qtype, n, k, seed) for seed in range(8)]
        if qtype in ("Q4_0", "Q4_1"):
            call = lambda x, t: torch.ops.specchat.q4_linear(x, t, n)  # noqa: E731
        else:
            call = lambda x, t, kind=kquant.type_id(qtype): torch.ops.specchat.kq_linear(x, t, kind, n)  # noqa: E731
        best = {}
        for m in ROWS:
            x = torch.randn(m, k)
            for t in mats:
                call(x, t)
            rounds = []
            for _ in range(10):
                start = time.perf_counter()
                for t in mats:
                    call(x, t)
                rounds.append((time.perf_counter() - start) / len(mats))
            best[m] = min(rounds)
        size = mats[0].numel() / 1e6
        cells = "  ".join(f"M={m} {best[m] * 1e3:.3f} ({best[m] / best[1]:.2f}x)" for m in ROWS)
        print(f"{qtype:5s} {size:5.1f} MB  {cells}  one row {size / 1e3 / best[1]:.0f} GB/s")


if __name__ == "__main__":
    main()
