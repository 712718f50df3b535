"""Where a compiled single-token decode step goes: the layers' graph, the LM head's choice, and the
operators behind them, next to what streaming the weights once would take.

    python scripts/decode_step.py [-p smollm2-fast] [-m FILE.gguf] [--steps 150]

Loads the profile's target (its compiled graphs from the graph store: run the profile once
first), prefills a chat prompt and decodes greedily, timing per step the pass through the layers
(`forward`, the exported graph plus embedding and final norm), the choice of the next token
(`choose`: the int8 head's bound and the exact recomputation of the few tokens that could win),
and the graph alone; verify blocks of 1..8 rows (row-exact forward and choice); then a profile of 20 steps by operator, and the bytes of weights a step
reads over a measured memory bandwidth.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--profile", default="smollm2-fast")
    ap.add_argument("-m", "--model", help="run the profile on this GGUF (e.g. one of scripts/shaped_gguf.py's)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8], help="verify block sizes to time")
    args = ap.parse_args()

    from specchat.backends.base import Sampling
    from specchat.backends.native.exact_rows import row_groups
    from specchat.loading import load_target
    from specchat.profiles import get_profile

    profile = get_profile(args.profile)
    profile = profile.with_overrides({"model": args.model}) if args.model else profile
    engine = load_target(profile)  # target-only; its graphs loaded (or made) now
    model = engine.model
    if model.compiled is None or not model.compiled.ready:
        raise SystemExit(f"{args.profile}: no compiled graphs loaded (a compile: true profile, graphs stored)")
    ids = engine.tokenize_chat([{"role": "user", "content": "Write a short story about a robot who learns to paint."}])
    greedy = Sampling(max_tokens=args.steps)
    forward, choose = [], []
    with torch.inference_mode():
        state, _ = engine.forward(ids, 0, all_logits=False, head=False)
        pos = len(ids)
        token = int(engine.choose(state, [pos], greedy)[0])
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, _ = engine.forward([token], pos, all_logits=False, head=False)
            t1 = time.perf_counter()
            token = int(engine.choose(state, [pos + 1], greedy)[0])
            choose.append(time.perf_counter() - t1)
            forward.append(t1 - t0)
            pos += 1
        graph = next(g for v, g in model.compiled.ready.items() if v.one_row and not v.keep_hidden)
        group = row_groups(pos, 1, model.max_len, model.device, model.cache_dtype,
                           (model.cfg.n_kv_heads, model.cfg.n_heads // model.cfg.n_kv_heads))[0]
        x = model.embed[torch.tensor([token])].float()
        alone = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            graph(model, x, pos, group.n_keys, group.mask, False)
            alone.append(time.perf_counter() - t0)
        print(f"threads {torch.get_num_threads()}: forward {median_ms(forward):.2f} ms (graph alone "
              f"{median_ms(alone):.2f}), choose {median_ms(choose):.2f} ms, step "
              f"{median_ms([a + b for a, b in zip(forward, choose)]):.2f} ms")
        # verify blocks of K rows: a row-exact forward and the choice of every row, as strict
        # verification runs them, in units of a one-token pass (K = 1)
        blocks = {}
        for K in args.rows:
            times = []
            for i in range(max(20, args.steps // 5)):
                engine.truncate(pos)
                t0 = time.perf_counter()
                state, _ = engine.forward([token] * K, pos, all_logits=True, head=False, row_exact=True)
                engine.choose(state, list(range(pos + 1, pos + K + 1)), greedy)
                times.append(time.perf_counter() - t0)
            blocks[K] = median_ms(times)
        engine.truncate(pos)
        print("verify block of K rows (forward + choice), ms and x a one-token pass: " +
              ", ".join(f"{K}: {ms:.2f} ({ms / blocks[args.rows[0]]:.2f}x)" for K, ms in blocks.items()))
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                state, _ = engine.forward([token], pos, all_logits=False, head=False)
                token = int(engine.choose(state, [pos + 1], greedy)[0])
                pos += 1
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    # bench_engine.py's measures, from this directory: the bytes a step reads, the memory bandwidth
    from bench_engine import memory_bandwidth_gbs, weight_bytes_per_token

    total, bandwidth = weight_bytes_per_token(model), memory_bandwidth_gbs()
    print(f"weights read per step: {total / 1e6:.0f} MB (layers' int4 matrices and the int8 head); "
          f"at {bandwidth:.1f} GB/s: {total / bandwidth / 1e6:.2f} ms")


if __name__ == "__main__":
    main()
