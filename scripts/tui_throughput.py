#!/usr/bin/env python3
"""Does the TUI slow the engine down? Decode tok/s inside the TUI vs headless, same backend.

    python3 scripts/tui_throughput.py -p smollm2            # the real default model
    python3 scripts/tui_throughput.py --synthetic           # a stand-in engine (numpy work per pass)

Headless is the loop `specchat run` uses (stream, write text, flush), run in this process on
the same loaded backend; the TUI run drives the real chat screen under `App.run_test`
(headless terminal, full layout and Markdown rendering), typing the same prompt each time
in a fresh chat. Runs alternate headless/TUI; the report gives medians and the ratio
(target >= 0.95).
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specchat.backends.base import (STOP_CANCELLED, STOP_EOS, Backend, Request, Sampling, Step, StreamStats,  # noqa: E402
                                    Summary)
from specchat.loading import load_backend, messages_for, sampling_of  # noqa: E402
from specchat.profiles import Profile, load_profiles  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


class SyntheticEngine(Backend):
    """A stand-in for a native engine: each pass releases the GIL for `pass_ms` (as llama.cpp or a
    torch kernel does while it computes), then does a little Python bookkeeping holding the GIL.
    What the TUI can cost it is GIL and event-loop contention, which is what this measures; CPU
    contention with the real model's threads needs the real model (`-p PROFILE`)."""

    name = "synthetic"

    def __init__(self, pass_ms: float = 12.0, accept=(3, 1, 4, 0, 2)):
        self.pass_s = pass_ms / 1000
        self.accept = accept
        words = ("the keeper climbed the stairs and **lit** the lamp while waves broke on `rocks` "
                 "below\n\n- one\n- two\n\n```python\nfor i in range(3):\n    print(i)\n```\n\n").split(" ")
        self.words = [w if i == 0 else " " + w for i, w in enumerate(words)]

    @property
    def context_length(self) -> int:
        return 4096

    def tokenize_chat(self, messages):
        return list(range(sum(len(m["content"].split()) for m in messages)))

    def detokenize(self, token_ids):
        return "".join(self.words[i % len(self.words)] for i in token_ids)

    def stream(self, request: Request, sampling: Sampling, cancel=None):
        stats = StreamStats(len(self.prompt_ids(request)))
        i, n = 0, 0
        while i < sampling.max_tokens:
            if cancel is not None and cancel.is_set():
                yield stats.finish(STOP_CANCELLED)
                return
            time.sleep(self.pass_s)  # one "target pass" in native code, GIL released
            sum(range(2000))  # Python-side bookkeeping, GIL held
            acc = min(self.accept[n % len(self.accept)], sampling.max_tokens - i - 1)
            ids = list(range(i, i + acc + 1))
            i += len(ids)
            n += 1
            yield stats.add(Step(ids, self.detokenize(ids), drafted=4, accepted=acc))
        yield stats.finish(STOP_EOS)


def headless_once(backend: Backend, profile: Profile, sampling: Sampling) -> Summary:
    out = io.StringIO()
    request = Request(messages=messages_for(profile, [{"role": "user", "content": PROMPT}]))
    summary = None
    for ev in backend.stream(request, sampling, threading.Event()):
        if isinstance(ev, Summary):
            summary = ev
        else:
            out.write(ev.text)
            out.flush()
    return summary


async def tui_runs(backend: Backend, base: str, profile: Profile, runs: int, headless_between, size=(120, 40)):
    from specchat.tui.app import SpecChatApp

    app = SpecChatApp(base, loader=lambda p: backend, history=False)
    tui, head = [], []
    async with app.run_test(size=size) as pilot:
        while app.backend is None:
            await pilot.pause(0.05)
        app.profile = profile  # the same sampling override as headless
        chat = app.chat
        for _ in range(runs):
            await pilot.press("ctrl+n")
            await pilot.pause(0.1)
            area = chat.query_one("#prompt")
            area.text = PROMPT
            await pilot.click("#prompt")
            await pilot.press("enter")
            await pilot.pause(0.05)
            while chat.generating:
                # plain sleep: Pilot.pause would force an extra screen update each time
                await asyncio.sleep(0.05)
            tui.append(app.last_summary)
            # a headless run between TUI runs, with the app idle (it only ticks its timers)
            head.append(headless_between())
    return tui, head


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--profile", default="smollm2")
    ap.add_argument("--synthetic", action="store_true", help="use a stand-in engine instead of the profile's model")
    ap.add_argument("--pass-ms", type=float, default=12.0, help="synthetic: compute per pass (12 ms ≈ 170 tok/s)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    profile = load_profiles().get(args.profile).with_overrides(max_tokens=args.max_tokens, temperature=0.0)
    if args.synthetic:
        profile = profile.model_copy(update={"name": "synthetic"})
    backend = SyntheticEngine(args.pass_ms) if args.synthetic else load_backend(profile)
    sampling = sampling_of(profile)
    headless_once(backend, profile, sampling)  # warm-up (first-call costs), not counted
    head = [headless_once(backend, profile, sampling)]
    tui, more = asyncio.run(tui_runs(backend, args.profile, profile, args.runs, lambda: headless_once(backend, profile, sampling)))
    head += more
    h = statistics.median(s.decode_tok_s for s in head)
    t = statistics.median(s.decode_tok_s for s in tui)
    result = {"profile": profile.name, "backend": backend.name, "runs": args.runs,
              "tokens": [s.tokens for s in tui], "headless_tok_s": [round(s.decode_tok_s, 1) for s in head],
              "tui_tok_s": [round(s.decode_tok_s, 1) for s in tui], "headless_median": round(h, 1),
              "tui_median": round(t, 1), "ratio": round(t / h, 3) if h else None}
    backend.close()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{profile.name} ({backend.name}): headless {h:.1f} tok/s · TUI {t:.1f} tok/s · "
              f"ratio {result['ratio']:.1%} (target ≥ 95%)")
        print(f"  headless runs {result['headless_tok_s']} · TUI runs {result['tui_tok_s']}")
    return 0 if result["ratio"] and result["ratio"] >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
