"""Part 4: decode speed on random-weight models of real shapes (shapes.py), built on the device.

Per shape: the engine's target-only decode rate against transformers' `generate` on the same
weights and against the bandwidth bound (bytes a decode pass must stream: weights, plus the KV
cache it attends over, at the peak and at the measured read bandwidth); the cost of one verify
block of 1..16 rows; and the speculative loop's own cost per pass, measured with a drafter that
never guesses, so that acceptance does not enter. Rates are 1 / the median time between
consecutive tokens (as scripts/bench_engine.py), best of `repeats` runs.
"""
from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import Sequence

import torch
from torch._dynamo.utils import counters

from bench_engine import weight_bytes_per_token
from specchat.backends.base import Request, Sampling, Step
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.loop import Draft, Drafter

from . import shapes
from .budget import Part
from .judge import fresh
from .plan import Plan
from .report import failure


# Least time left to start a shape: building it and a few replies; compiling takes longer.
STEP_NEED_S = {False: 20, True: 60}


class NoDrafts(Drafter):
    """Guesses nothing: every pass of the loop verifies a one-row block, as target-only decoding
    runs, so the difference in time per pass is the loop's own bookkeeping."""

    name = "none"

    def propose(self, tokens: Sequence[int], depth: int) -> Draft:
        return Draft([])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_rate(stamps: list[float]) -> float:
    return 1.0 / statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def stream_rate(backend, prompt: list[int], tokens: int, repeats: int) -> float:
    """Tokens (or passes: each Step is one) per second of a forced-length reply."""
    best = 0.0
    for _ in range(repeats):
        fresh(backend)
        stamps = [time.perf_counter() for e in backend.stream(Request(prompt_ids=prompt), Sampling(max_tokens=tokens))
                  if isinstance(e, Step)]
        best = max(best, median_rate(stamps))
    return best


def transformers_rate(hf, prompt: list[int], tokens: int, repeats: int, device: torch.device) -> float:
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    best, ids = 0.0, torch.tensor([prompt], device=device)
    for _ in range(repeats):
        stamps = Stamps()
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, eos_token_id=None,
                        pad_token_id=0, streamer=stamps)
        best = max(best, median_rate(stamps.times[1:]))  # the first put() is the prompt
    return best


def timed_ms(fn, device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def verify_costs(engine, prompt: list[int], rows: Sequence[int], reps: int, device: torch.device) -> dict[int, float]:
    """ms of one verify pass over k rows after the prompt: the block's forward and the target's
    greedy choice for every row (the loop's `target_choices`)."""
    engine.truncate(0)
    engine.prefill(prompt)
    n = len(prompt)
    block = prompt[:max(rows)]

    def one(k: int):
        engine.truncate(n)
        states, _ = engine.forward(block[:k], n, head=False)
        engine.choose(states, list(range(n + 1, n + k + 1)), Sampling()).tolist()

    return {k: timed_ms(lambda: one(k), device, reps) for k in rows}


def bytes_per_token(model, positions: int) -> dict:
    """What one decode pass streams: the weights (scripts/bench_engine.py's count) and the keys
    and values it attends over: with static shapes the whole cache, else up to `positions`."""
    cfg, cache = model.cfg, model.cache
    keys = cache.max_len if model.static else min(positions, cache.max_len)
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * cache.k[0].element_size() * keys
    return {"weights": weight_bytes_per_token(model), "kv_cache": kv}


def read_bandwidth(device: torch.device) -> float:
    """Bytes per second a full read of a large tensor achieves (best of 5)."""
    x = torch.ones((1 << 30) if device.type == "cuda" else (64 << 20), device=device)
    x.sum()
    ms = min(timed_ms(x.sum, device, 1) for _ in range(5))
    return x.numel() * x.element_size() / (ms / 1e3)


def measure_shape(part: Part, plan: Plan, name: str, workdir: Path, compile: bool) -> dict:
    device, precision = plan.torch_device, plan.speed_precision
    started = time.perf_counter()
    if compile:
        torch._dynamo.reset()  # a fresh recompile budget: the graphs of earlier models are of no use here
    model = shapes.build(name, device, getattr(torch, precision), workdir)
    engine = shapes.engine_on(model, **plan.engine(precision=precision, compile=compile))
    built_s = time.perf_counter() - started
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, model.hf.config.vocab_size, (plan.prompt_tokens,), generator=g).tolist()
    row = {"shape": name, "parameters": model.parameters, "precision": precision, "compiled": compile,
           "static_shapes": engine.model.static, "context": engine.context_length, "build_s": built_s,
           "bytes_per_token": bytes_per_token(engine.model, plan.prompt_tokens + plan.decode_tokens)}
    skips = counters["inductor"]["cudagraph_skips"]
    first = time.perf_counter()
    row["engine_tok_s"] = stream_rate(engine, prompt, plan.decode_tokens, 1)  # compiles the graphs, if compiled
    row["first_reply_s"] = time.perf_counter() - first
    row["engine_tok_s"] = max(row["engine_tok_s"], stream_rate(engine, prompt, plan.decode_tokens, plan.repeats))
    row["forward_ms"] = timed_ms(lambda: engine.forward(prompt[:1], len(prompt), all_logits=False), device, 20)
    if compile:  # graphs inductor ran without CUDA graphs (mutated inputs, CPU tensors...): see log.txt for why
        row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
    else:  # (compiled verify blocks: each row count is one more graph to compile, more time than this run has)
        if part.allows(10):
            row["verify_ms"] = verify_costs(engine, prompt, plan.verify_rows, 5, device)
        else:
            part.skip(f"{name} verify-block costs")
        if part.allows(10):
            loop = stream_rate(SpeculativeBackend(engine, NoDrafts(), 4), prompt, plan.decode_tokens, plan.repeats)
            row["loop_passes_per_s"] = loop
            row["loop_overhead_ms"] = (1 / loop - 1 / row["engine_tok_s"]) * 1e3
        else:
            part.skip(f"{name} loop overhead")
        if part.allows(10):
            row["transformers_tok_s"] = transformers_rate(model.hf, prompt, plan.decode_tokens, plan.repeats, device)
        else:
            part.skip(f"{name} transformers generate")
    engine.close()
    del engine, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    row["seconds"] = time.perf_counter() - started
    return row


def bounds(row: dict, peak_tb_s: float | None, measured_b_s: float) -> dict:
    total = sum(row["bytes_per_token"].values())
    out = {"measured_bandwidth_gb_s": measured_b_s / 1e9,
           "bound_tok_s_measured": measured_b_s / total,
           "fraction_of_measured_bound": row["engine_tok_s"] * total / measured_b_s}
    if peak_tb_s:
        out |= {"peak_tb_s": peak_tb_s, "bound_tok_s_peak": peak_tb_s * 1e12 / total,
                "fraction_of_peak_bound": row["engine_tok_s"] * total / (peak_tb_s * 1e12)}
    return out


def run(part: Part, plan: Plan, workdir: Path, compile: bool) -> dict:
    names = plan.compiled_speed_shapes if compile else plan.speed_shapes
    measured = read_bandwidth(plan.torch_device)
    rows = []
    for name in names:
        if not part.allows(STEP_NEED_S[compile]):
            part.skip(f"{name}{' compiled' if compile else ''}")
            continue
        try:
            row = measure_shape(part, plan, name, workdir, compile)
            row |= bounds(row, plan.peak_tb_s, measured)
        except Exception:
            row = {"shape": name, "compiled": compile, **failure()}
        if "error" in row:  # free what the failed step held (its frames are gone once handled)
            gc.collect()
            if plan.device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    speeds = [v for r in rows for k, v in r.items() if k.endswith("tok_s") and not k.startswith("bound")]
    return {"passed": bool(rows) and not any("error" in r for r in rows) and all(v > 0 for v in speeds),
            "rows": rows}
