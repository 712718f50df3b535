"""What one drafted token costs a draft model, by how long the context already is: the recurrent
drafter (a fixed-size state) against the attention draft model (a KV cache that grows).

A drafted token is a one-token forward of the draft model plus its greedy choice, as
DraftModelDrafter makes it. For each context length the drafters take turns, 5 rounds of 20
tokens each, medians per token:

    python scripts/drafter_token_cost.py profiles/drafters/smollm2-draft profiles/drafters/smollm2-replayssm \\
        --contexts 128 512 1024 2048
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specchat.backends.base import Sampling
from specchat.backends.native.engine import TorchBackend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafters", nargs="+")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=20)
    args = ap.parse_args()
    room = max(args.contexts) + args.rounds * args.tokens + 8
    engines = {d: TorchBackend(d, "hf_dir", threads=0, context=room) for d in args.drafters}
    ids = torch.randint(100, 40000, (room,), generator=torch.Generator().manual_seed(0)).tolist()
    greedy = Sampling()
    print("context  " + "  ".join(f"{d.rstrip('/').split('/')[-1]:>22}" for d in engines) + "   (ms per drafted token)")
    for n in args.contexts:
        times = {d: [] for d in engines}
        for e in engines.values():
            e.truncate(0)
            e.forward(ids[:n], 0)
        pos = {d: n for d in engines}
        for _ in range(args.rounds):
            for d, e in engines.items():
                start = time.perf_counter()
                for _ in range(args.tokens):
                    state, _ = e.forward([ids[pos[d]]], pos[d], all_logits=False, head=False)
                    e.choose(state, [pos[d] + 1], greedy)
                    pos[d] += 1
                times[d].append((time.perf_counter() - start) / args.tokens)
        print(f"{n:7d}  " + "  ".join(f"{statistics.median(times[d]) * 1e3:22.2f}" for d in engines))


if __name__ == "__main__":
    main()
