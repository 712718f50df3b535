"""How often prompt lookup would be right, by how long its match is, and what verifying costs.

    python3 scripts/lookup_hit_rates.py [-p smollm2] [--prompts FILE] [--limit 48] [--max-tokens 128]
                                        [--category summarization ...]

Decodes each prompt target-only (greedy unless the profile samples), then replays the reply: at
every position it finds the longest n (up to 8) for which the last n tokens stood earlier in the
conversation, takes what followed their latest such occurrence, and counts how many of its tokens
the reply goes on with. The table gives, per match length, P(the first j tokens proposed are
right); the numbers behind `ngram.py`'s rule that a match of n tokens proposes at most n.

It also times a strict verify pass of k drafted tokens (forward of k+1 rows plus the target's
choice) against a single-token pass, at each reply's own context: the cost a drafted token must
pay for.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MAX_MATCH = 8  # lengths from here up share a row
DEPTHS = 8  # proposed tokens counted, and drafted tokens timed


def longest_match(tokens: list[int]) -> tuple[int, int | None]:
    """The longest n <= MAX_MATCH with tokens[-n:] earlier in `tokens`, and where what followed
    its latest occurrence starts (None when not even the last token occurred before)."""
    n_tokens, best = len(tokens), (0, None)
    for p in range(n_tokens - 2, -1, -1):
        if tokens[p] != tokens[-1]:
            continue
        n = 1
        while n < MAX_MATCH and p - n >= 0 and tokens[p - n] == tokens[n_tokens - 1 - n]:
            n += 1
        if n > best[0]:
            best = (n, p + 1)
            if n == MAX_MATCH:
                break
    return best


def hit_counts(prompt: list[int], reply: list[int], counts: dict[int, list[int]]) -> None:
    """Add to counts[n] = [positions, right >= 1, right >= 2, ...] for every reply position."""
    tokens = prompt + reply[:1]
    for i in range(1, len(reply)):
        n, start = longest_match(tokens)
        row = counts.setdefault(n, [0] * (DEPTHS + 1))
        row[0] += 1
        if start is not None:
            right = 0
            while (right < DEPTHS and i + right < len(reply) and start + right < len(tokens)
                   and tokens[start + right] == reply[i + right]):
                right += 1
            for j in range(1, right + 1):
                row[j] += 1
        tokens.append(reply[i])


def pass_costs(engine, sequence: list[int], sampling) -> list[float]:
    """Seconds of a strict verify pass of k drafted tokens (k = 0..DEPTHS) at the end of
    `sequence`, best of three each (other work on the machine only ever slows a pass)."""
    base = len(sequence) - 1 - DEPTHS
    if engine.cache_len > base:
        engine.truncate(base)
    if engine.cache_len < base:
        engine.forward(sequence[engine.cache_len:base], engine.cache_len, all_logits=False, head=False)
    best = [float("inf")] * (DEPTHS + 1)
    for _ in range(3):
        for k in range(DEPTHS + 1):
            engine.truncate(base)
            t0 = time.perf_counter()
            states, _ = engine.forward(sequence[base:base + k + 1], base, row_exact=True, head=False)
            engine.choose(states, list(range(base + 1, base + k + 2)), sampling)
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    from specchat.backends.base import Request, Step
    from specchat.loading import load_target, messages_for, sampling_of
    from specchat.profiles import load_profiles
    from specchat.prompts import load_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--profile", default="smollm2", help="a torch-engine profile (its target is used)")
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[2] / "shared/data/spec-bench/question.jsonl"))
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--category", action="append")
    args = ap.parse_args()

    profile = load_profiles().get(args.profile).target_only()
    engine = load_target(profile)
    engine.warm_up()
    sampling = replace(sampling_of(profile), max_tokens=args.max_tokens)
    console = Console(stderr=True)
    counts: dict[int, list[int]] = {}
    costs: list[list[float]] = []
    for item in load_prompts(args.prompts, args.limit, args.category):
        prompt = engine.tokenize_chat(messages_for(profile, [{"role": "user", "content": item.first}]))
        reply = [t for ev in engine.stream(Request(prompt_ids=prompt), sampling) if isinstance(ev, Step)
                 for t in ev.token_ids]
        hit_counts(prompt, reply, counts)
        if len(prompt) + len(reply) > DEPTHS + 2:
            seconds = pass_costs(engine, prompt + reply, sampling)
            costs.append([s / seconds[0] for s in seconds])
        console.print(f"{item.id} [{item.task}] {len(prompt)} + {len(reply)} tokens", highlight=False)

    table = Table(title=f"Prompt lookup: P(first j proposed tokens right) by match length ({args.profile}, "
                        f"{sum(r[0] for r in counts.values())} positions)")
    table.add_column("match")
    table.add_column("positions", justify="right")
    for j in range(1, DEPTHS + 1):
        table.add_column(f"j={j}", justify="right")
    for n in sorted(counts):
        row = counts[n]
        label = "none" if n == 0 else (f"{n}+" if n == MAX_MATCH else str(n))
        table.add_row(label, str(row[0]), *(f"{row[j] / row[0]:.2f}" for j in range(1, DEPTHS + 1)))
    Console().print(table)
    if costs:
        cost = Table(title="Strict verify pass of k drafted tokens, in single-token passes (median over prompts)")
        for k in range(1, DEPTHS + 1):
            cost.add_column(f"k={k}", justify="right")
        cost.add_row(*(f"{statistics.median(c[k] for c in costs):.2f}" for k in range(1, DEPTHS + 1)))
        Console().print(cost)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
