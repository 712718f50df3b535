"""Decode speed of a chat while its compiled graphs are prepared in the background, how long the
preparation and the switch take, and the speed after it.

One engine of the profile's target (target-only, greedy) with `compile_in_background`, on a
fresh graph store (a temporary cache directory), answers chat prompts in turns:
  1. before: a second engine without compile answers, no preparation running (all threads);
  2. during: the chat engine answers on eager passes while the background process prepares;
  3. after: once the graphs are stored, the chat engine switches (timed) and answers compiled;
the eager engine answers again at the end, so that machine drift shows. Prints one line per
reply and a summary. Usage (from the repository root):

    python scripts/bench_background_prepare.py -p smollm2-fast --prompts scripts/chat-prompts.jsonl
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native.engine import TorchBackend
from specchat.loading import messages_for, target_path
from specchat.profiles import get_profile
from specchat.prompts import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-p", "--profile", default="smollm2-fast")
    ap.add_argument("--prompts", default="scripts/chat-prompts.jsonl")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    profile = get_profile(args.profile)
    path, kind = target_path(profile)
    prompts = load_prompts(args.prompts)
    sampling = Sampling(max_tokens=args.max_tokens)
    cache = Path(tempfile.mkdtemp(prefix="specchat-bench-background-"))
    settings = dict(precision=profile.dtype, threads=profile.threads, context=profile.context, cache_dir=cache)

    def answer(engine: TorchBackend, item) -> float:
        engine.truncate(0)  # every reply prefills its whole prompt, as a new chat does
        s = run_to_summary(engine.stream(Request(messages=messages_for(profile, [
            {"role": "user", "content": item.first}])), sampling))
        return s.decode_tok_s

    eager = TorchBackend(path, kind, **settings)
    rates: dict[str, list[float]] = {"before": [], "during": [], "after": [], "eager again": []}
    for item in prompts[:4]:
        rates["before"].append(answer(eager, item))
    started = time.perf_counter()
    chat = TorchBackend(path, kind, **settings, compile=True, compile_in_background=True)
    chat.prepare_in_background()  # as the chat starts it, at load
    print(f"chat engine loaded in {time.perf_counter() - started:.1f} s, graphs: {chat.background_status()}")
    i = 0
    while chat.background is not None and not chat.background.progress().ready:
        if chat.background.progress().failed:
            raise SystemExit(f"preparation failed: {chat.background.progress().failed}")
        rates["during"].append(answer(chat, prompts[i % len(prompts)]))
        print(f"during ({chat.background_status()}): {rates['during'][-1]:.1f} tok/s", flush=True)
        i += 1
    prepared = time.perf_counter() - started
    switch = time.perf_counter()
    print(chat.switch_if_ready())
    switch = time.perf_counter() - switch
    for item in prompts:
        rates["after"].append(answer(chat, item))
    for item in prompts[:4]:
        rates["eager again"].append(answer(eager, item))
    print(f"\nprofile {profile.name}, {path.name}, {args.max_tokens} tokens a reply, greedy")
    print(f"background preparation: {prepared:.0f} s from the chat engine's load; switch: {switch:.1f} s")
    for what, r in rates.items():
        if r:
            print(f"{what:>12}: {statistics.median(r):6.1f} tok/s median over {len(r)} replies")
    base = statistics.median(rates["before"] + rates["eager again"])
    print(f"during / eager without preparation: {statistics.median(rates['during']) / base:.2f}x; "
          f"compiled / eager: {statistics.median(rates['after']) / base:.2f}x")


if __name__ == "__main__":
    main()
