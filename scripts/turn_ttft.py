"""Time to first token by turn over one long conversation, per method, as the chat runs it.

Every profile gets the same conversation: the first turns of MT-Bench's questions in order, one per
turn, continued with each profile's own replies, fitted to the context the way the chat fits it
(context_window.py: the oldest turns left out when the next would not fit). Profiles take turns
(turn 1 of every profile, then turn 2, ...) so machine noise falls on all of them alike. Per turn it
records TTFT, the prompt's length, how much of it the prefill reused from the cache, and whether
the turn moved the cut, and whether the reply is token for token the first profile's (list a
target-only profile first: a lossless method then gives the same reply every turn, with its caches
and its drafter's state carried from turn to turn).

    python scripts/turn_ttft.py --turns 20 --context 1024 --max-tokens 64 \\
        -p smollm2 -p smollm2-ngram -p smollm2-mtp -p smollm2-mtp-lookup -p smollm2-dflash -p smollm2-draft \\
        --out runs/turn-ttft.jsonl

prints a table (TTFT of turn 2 and turn N, their ratio, the worst turn that moved no cut, the
turns whose reply equals the first profile's) and writes every turn's record to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specchat.backends.base import run_to_summary
from specchat.context_window import fit_request
from specchat.conversation import Conversation
from specchat.loading import load_backend, sampling_of
from specchat.profiles import get_profile
from specchat.prompts import load_prompts

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec-bench" / "question.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--profile", action="append", required=True)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", default=str(QUESTIONS))
    ap.add_argument("--out", default="runs/turn-ttft.jsonl")
    args = ap.parse_args()

    questions = [item.first for item in load_prompts(args.prompts, categories=["mt_bench"])][:args.turns]
    runs = []
    for name in args.profile:
        profile = get_profile(name).with_overrides({"context": args.context}, max_tokens=args.max_tokens,
                                                   temperature=args.temperature, seed=args.seed)
        print(f"loading {name} …", flush=True)
        runs.append((name, profile, load_backend(profile), Conversation(None, name)))
    records = []
    for turn, question in enumerate(questions, 1):
        first_ids = None
        for name, profile, backend, conv in runs:
            conv.add("user", question)
            request, note = fit_request(backend, profile, conv)
            s = run_to_summary(backend.stream(request, sampling_of(profile)))
            conv.add("assistant", s.text)
            first_ids = s.token_ids if first_ids is None else first_ids
            records.append({"profile": name, "turn": turn, "ttft_s": s.ttft_s, "prompt_tokens": s.prompt_tokens,
                            "reused": s.prefill_start or 0, "cut_moved": note is not None, "tokens": s.tokens,
                            "same_reply": s.token_ids == first_ids})
            print(f"turn {turn:2d} {name:20s} TTFT {s.ttft_s * 1000:7.1f} ms · prompt {s.prompt_tokens:4d} "
                  f"· reused {s.prefill_start or 0:4d}" + (" · cut moved" if note else ""), flush=True)
    for _, _, backend, _ in runs:
        backend.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))

    last = len(questions)
    print(f"\nTTFT by turn, {last} turns, context {args.context}, max {args.max_tokens} tokens a reply")
    print(f"{'profile':20s} {'turn 2':>8s} {f'turn {last}':>8s} {'ratio':>6s} {'median':>8s} {'worst*':>8s} same  cuts")
    for name, *_ in runs:
        mine = [r for r in records if r["profile"] == name]
        t2, tn = mine[1]["ttft_s"], mine[-1]["ttft_s"]
        steady = [r["ttft_s"] for r in mine[1:] if not r["cut_moved"]]
        cuts = [r["turn"] for r in mine if r["cut_moved"]]
        same = sum(r["same_reply"] for r in mine)
        print(f"{name:20s} {t2 * 1000:7.1f}m {tn * 1000:7.1f}m {tn / t2:6.2f} "
              f"{statistics.median(steady) * 1000:7.1f}m {max(steady) * 1000:7.1f}m {same:2d}/{last} {cuts}")
    print(f"(ms; worst*: the slowest turn after the first that moved no cut; same: replies equal to {runs[0][0]}'s)")


if __name__ == "__main__":
    main()
