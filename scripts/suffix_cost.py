"""What a suffix-decoding proposal costs per pass, on real text: the memory filled with
Spec-Bench's questions (every turn, as stand-ins for earlier replies) tokenized by SmolLM2's
tokenizer, then a held-out text walked token by token as a reply commits, drafting at every step
from the conversation so far and from the memory.

    python scripts/suffix_cost.py [--tokens 200000] [--depth 8]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specchat import paths
from specchat.backends.native.tokenizer import ChatTokenizer
from specchat.backends.speculative.suffix import SuffixIndex, SuffixSettings
from specchat.models import local_model

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec-bench" / "question.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=200_000, help="memory size to fill to (repeating the texts)")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--questions", default=str(QUESTIONS))
    args = ap.parse_args()
    path, _ = local_model("smollm2-135m-instruct", Path.cwd())
    tok = ChatTokenizer(path, paths.cache_dir())
    texts = [t for line in open(args.questions) for t in json.loads(line)["turns"]]
    held_out, texts = texts[-40:], texts[:-40]
    ids = [tok.encode(t) for t in texts]
    memory = SuffixIndex(max_tokens=args.tokens)
    t0 = time.perf_counter()
    added = 0
    while added < args.tokens:
        for i, seq in enumerate(ids):
            memory.add((added, i), seq)
            added += len(seq)
    fill = time.perf_counter() - t0
    print(f"memory: {memory.sequences} sequences, {memory.live_tokens} tokens, filled in {fill:.2f}s "
          f"({fill / added * 1e6:.1f} us/token)")
    s = SuffixSettings()
    reply = [t for text in held_out for t in tok.encode(text)][:4000]
    local = SuffixIndex()
    times_local, times_memory, drafted = [], [], 0
    context = reply[:16]  # one list, extended as the loop extends its committed tokens
    for n in range(16, len(reply)):
        context.append(reply[n])
        t = time.perf_counter()
        local.sync(context)
        a = local.find(context, args.depth, s, loop=True)
        t1 = time.perf_counter()
        b = memory.find(context, args.depth, s)
        t2 = time.perf_counter()
        times_local.append(t1 - t)
        times_memory.append(t2 - t1)
        drafted += bool(a.tokens or b.tokens)
    for name, ts in (("conversation (sync + find)", times_local), ("memory (find)", times_memory)):
        ts = sorted(ts)
        print(f"{name}: median {ts[len(ts) // 2] * 1e6:.1f} us, p99 {ts[int(len(ts) * 0.99)] * 1e6:.1f} us, "
              f"max {ts[-1] * 1e6:.0f} us per pass over {len(ts)} passes")
    print(f"passes with a draft: {drafted / len(times_local):.0%}")


if __name__ == "__main__":
    main()
