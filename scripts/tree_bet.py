"""What draft trees would buy before building them: replay target-only replies and count, pass by pass,
how many tokens a chain draft and a tree draft of each size would have had accepted.

    python scripts/tree_bet.py [-p smollm2-fast] [--prompts FILE] [--limit 48] [--max-tokens 128]
                               [--replies runs/tree-bet-replies.json]

Decodes each prompt greedily with the profile's target (compiled target-only; the replies are kept in
`--replies` and reused), then walks each reply as the speculative loop would: a pass at position i
drafts from tokens[:i], accepts the longest prefix of the draft (chain) or the deepest path of the
tree that the reply goes on with, and the next pass starts after the accepted tokens and the target's
own one. Drafters: suffix decoding over the conversation (suffix.py; its chain is what `smollm2-suffix`
drafts with an empty memory) and prompt lookup (ngram.py); their trees hold every continuation of the
matched occurrences (SuffixDecoding's speculation tree), the most frequent first, up to N nodes. Also,
when `--mtp` names an MTP profile, the MTP head's top-k at the first draft position.

Prints tokens per pass by drafter and tree size, and the mean nodes a pass verifies: a tree pays only
if its extra accepted tokens outweigh its extra rows (`python scripts/decode_step.py --rows ...`).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = (1, 2, 4, 8, 16)  # tree nodes (drafted tokens) a pass may verify; 1..depth is a chain


def replies(profile_name: str, prompts: str, limit: int, max_tokens: int, cache: Path) -> list[tuple[list[int], list[int]]]:
    key = f"{profile_name}|{prompts}|{limit}|{max_tokens}"
    if cache.exists():
        held = json.loads(cache.read_text())
        if held.get("key") == key:
            return [tuple(x) for x in held["items"]]
    from specchat.backends.base import Request, Step
    from specchat.loading import load_target, messages_for, sampling_of
    from specchat.profiles import load_profiles
    from specchat.prompts import load_prompts

    profile = load_profiles().get(profile_name).target_only()
    engine = load_target(profile)
    engine.warm_up()
    sampling = replace(sampling_of(profile), max_tokens=max_tokens)
    items = []
    for item in load_prompts(prompts, limit, None):
        prompt = engine.tokenize_chat(messages_for(profile, [{"role": "user", "content": item.first}]))
        reply = [t for ev in engine.stream(Request(prompt_ids=prompt), sampling) if isinstance(ev, Step)
                 for t in ev.token_ids]
        items.append((prompt, reply))
        print(f"{item.id}: {len(prompt)} + {len(reply)}", file=sys.stderr)
    engine.close()
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "items": items}))
    return items


def trie_of(continuations: Sequence[Sequence[int]]) -> dict[tuple[int, ...], int]:
    """Every prefix of the continuations, with how many continuations pass through it."""
    counts: dict[tuple[int, ...], int] = {}
    for c in continuations:
        for d in range(1, len(c) + 1):
            counts[tuple(c[:d])] = counts.get(tuple(c[:d]), 0) + 1
    return counts


def best_nodes(counts: dict[tuple[int, ...], int], total: int, n: int, min_prob: float) -> list[tuple[int, ...]]:
    """The n most frequent prefixes (a parent is never rarer than its child, so they form a tree;
    shorter first among equals), each followed by at least min_prob of the occurrences."""
    ranked = sorted(counts, key=lambda p: (-counts[p], len(p)))
    return [p for p in ranked if counts[p] / total >= min_prob][:n]


def accepted(nodes: Sequence[tuple[int, ...]], truth: Sequence[int]) -> int:
    """The deepest node that is a prefix of the truth."""
    return max((len(p) for p in nodes if tuple(truth[:len(p)]) == p), default=0)


def suffix_continuations(index, context: list[int], depth: int, every: bool) -> tuple[list[list[int]], int, list[int]]:
    """Continuations (up to depth tokens, read on into themselves as the drafter's loop does) of the
    occurrences of the context's tail: those of the longest match (`every` False) or all kept ones,
    their number, and the chain suffix.py drafts."""
    from specchat.backends.speculative.suffix import SEP, SuffixSettings

    index.sync(context)
    chain = index.find(context, depth, SuffixSettings(), loop=True).tokens
    occurrences, size = index._occurrences(context)
    if not occurrences:
        return [], 0, chain
    flat, n = index.flat, len(context)
    matched = []
    for p in occurrences:
        m = size
        while m < min(index.max_match, n) and p - m - 1 >= 0 and flat[p - m - 1] == context[n - m - 1]:
            m += 1
        matched.append(m)
    top = max(matched)
    live = occurrences if every else [p for p, m in zip(occurrences, matched) if m == top]
    cap = depth if every else min(depth, top)
    out, end = [], len(flat)
    for p in live:
        c: list[int] = []
        for k in range(cap):
            q = p + k
            t = flat[q] if q < end else c[q - end]
            if t == SEP:
                break
            c.append(t)
        out.append(c)
    return out, len(live), chain


def walk(items, depth: int) -> dict[str, list[float]]:
    """Per scheme: [passes, tokens, nodes verified]."""
    from specchat.backends.speculative.suffix import SuffixIndex

    stats: dict[str, list[float]] = {}

    def add(name: str, acc: int, nodes: int) -> None:
        s = stats.setdefault(name, [0, 0, 0])
        s[0] += 1
        s[1] += acc + 1
        s[2] += nodes

    for prompt, reply in items:
        for scheme in ["suffix chain"] + [f"suffix tree {n}" for n in SIZES] + [f"suffix all-occ tree {n}" for n in SIZES]:
            index = SuffixIndex()
            i = 1  # the first reply token comes from the prefill
            while i < len(reply):
                context = prompt + reply[:i]
                truth = reply[i:]
                every = "all-occ" in scheme
                conts, total, chain = suffix_continuations(index, context, depth, every)
                if scheme == "suffix chain":
                    acc = 0
                    while acc < len(chain) and acc < len(truth) and chain[acc] == truth[acc]:
                        acc += 1
                    nodes = len(chain)
                else:
                    n = int(scheme.split()[-1])
                    chosen = best_nodes(trie_of(conts), total, n, 0.1 if not every else 0.0) if total else []
                    acc, nodes = accepted(chosen, truth), len(chosen)
                add(scheme, acc, nodes)
                i += acc + 1
    return stats


WIDTHS = (4, 2, 2, 1)  # a head's candidates kept per level when expanding its tree (EAGLE-2 keeps top-k a node)
PRUNE = 0.02  # nodes whose path probability falls below this are not expanded further


def head_trees(profile_name: str, items, sizes: Sequence[int]) -> dict[str, list[list[int]]]:
    """For a head drafter's profile (MTP, EAGLE-3): at every reply position, how many tokens a chain
    of each depth and a tree of each size (its most probable nodes of the expanded tree) would have
    had accepted; {scheme: per item, per position}. The head is fed the target's hidden states of the
    whole reply at once (one prefill: the same values as decoding's, not always the same bits)."""
    import torch

    from specchat.backends.base import Sampling
    from specchat.loading import load_speculative
    from specchat.profiles import load_profiles

    backend = load_speculative(load_profiles().get(profile_name))
    target, drafter = backend.target, backend.drafter
    head = drafter.head
    out: dict[str, list[list[int]]] = {}
    for prompt, reply in items:
        seq = prompt + reply
        target.truncate(0)
        _, hidden = target.forward(seq, 0, drafter.hidden_layers, head=False)
        drafter.start(seq, hidden, Sampling(), 0)
        drafter.entries = 0
        per = {name: [] for name in [f"chain {d}" for d in (1, 2, 3, 4)] + [f"tree {n}" for n in sizes]}
        for i in range(1, len(reply)):
            n = len(prompt) + i  # committed tokens: seq[:n]
            truth = seq[n:]
            real = n - 1
            new = range(drafter.entries, real)
            g = head.forward(drafter.states[new.start:new.stop], torch.tensor(seq[new.start + 1:new.stop + 1]),
                             new.start)[-1:]
            drafter.entries = real
            nodes: dict[tuple[int, ...], float] = {}

            def expand(g, path: tuple[int, ...], prob: float) -> None:
                depth = len(path)
                p = torch.softmax(head.logits(g).float()[0], -1)
                top = torch.topk(p, WIDTHS[depth])
                for q, t in zip(top.values.tolist(), top.indices.tolist()):
                    child = path + (t,)
                    nodes[child] = prob * q
                    if depth + 1 < len(WIDTHS) and prob * q >= PRUNE:
                        expand(head.forward(g, torch.tensor([t]), real + depth), child, prob * q)

            expand(g, (), 1.0)
            greedy = max((p for p in nodes if len(p) == 1), key=nodes.get)
            for d in (1, 2, 3, 4):  # the chain: top-1 at every level (as far as the tree holds it)
                chain = [greedy]
                while len(chain[-1]) < d:
                    kids = [p for p in nodes if len(p) == len(chain[-1]) + 1 and p[:-1] == chain[-1]]
                    if not kids:
                        break
                    chain.append(max(kids, key=nodes.get))
                per[f"chain {d}"].append(accepted(chain, truth))
            ranked = sorted(nodes, key=lambda p: (-nodes[p], len(p)))
            for size in sizes:
                per[f"tree {size}"].append(accepted(ranked[:size], truth))
        for name, row in per.items():
            out.setdefault(name, []).append(row)
        print(f"{profile_name}: {len(reply)} tokens", file=sys.stderr)
    return out


def walk_precomputed(per_item: list[list[int]]) -> tuple[float, int]:
    """Tokens per pass when each pass at reply position i accepts per_item[..][i - 1] tokens."""
    passes = tokens = 0
    for row in per_item:
        i = 1
        while i < len(row) + 1:
            acc = row[i - 1]
            passes += 1
            tokens += acc + 1
            i += acc + 1
    return tokens / max(passes, 1), passes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--profile", default="smollm2-fast")
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[2] / "shared/data/spec-bench/question.jsonl"))
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=7)
    ap.add_argument("--replies", default="runs/tree-bet-replies.json")
    ap.add_argument("--head", action="append", default=[], help="a head drafter's profile (smollm2-mtp, smollm2-eagle3)")
    ap.add_argument("--no-suffix", action="store_true")
    args = ap.parse_args()
    items = replies(args.profile, args.prompts, args.limit, args.max_tokens, Path(args.replies))
    if not args.no_suffix:
        stats = walk(items, args.depth)
        print(f"{'scheme':28} {'tokens/pass':>11} {'nodes/pass':>10} {'passes':>7}")
        for name, (passes, tokens, nodes) in stats.items():
            print(f"{name:28} {tokens / passes:11.3f} {nodes / passes:10.2f} {int(passes):7d}")
    for profile in args.head:
        for name, per_item in head_trees(profile, items, SIZES[1:]).items():
            rate, passes = walk_precomputed(per_item)
            print(f"{profile + ' ' + name:34} {rate:7.3f} tokens/pass ({passes} passes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
