"""Suffix decoding with a warm and an empty memory against prompt lookup, on one shared target.

Every row decodes each prompt in turn on the same loaded target (smollm2-suffix's: compiled graphs),
so the rows share one arithmetic and take turns prompt by prompt: target-only, prompt lookup as
smollm2-fast runs it, suffix decoding with no memory, and suffix decoding whose memory holds the
earlier prompts' replies (each added once its prompt has run). Every speculative reply is checked
to equal target-only's. Prints per prompt, then per subtask: tokens per target pass, median decode
tok/s and the speed-up over target-only.

    python scripts/suffix_warm_vs_cold.py scripts/repeated-work-prompts.jsonl [MAX_TOKENS] [adaptive|fixed]

`specchat bench -p smollm2-fast -p smollm2-suffix --prompts ...` measures the same rows as
profiles (each on a target of its own).
"""
import statistics
import sys
from specchat.profiles import load_profiles
from specchat.loading import load_target, messages_for, sampling_of
from specchat.prompts import load_prompts
from specchat.backends.base import Request, run_to_summary
from specchat.backends.speculative.backend import SpeculativeBackend, make_suffix_drafter
from specchat.backends.speculative.drafters import NgramDrafter
from specchat.backends.speculative.suffix import SuffixSettings
from specchat.verify import fresh
from dataclasses import replace

max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
adaptive = sys.argv[3] == "adaptive" if len(sys.argv) > 3 else True
p = load_profiles().get("smollm2-suffix")
target = load_target(p)
rows = {
    "target-only": target,
    "lookup (smollm2-fast)": SpeculativeBackend(target, NgramDrafter(2, 3, 7), 2, strict=None, adaptive=adaptive),
    "suffix empty": SpeculativeBackend(target, make_suffix_drafter(SuffixSettings(memory=False)), 7, strict=None, adaptive=adaptive),
    "suffix warm": SpeculativeBackend(target, make_suffix_drafter(SuffixSettings()), 7, strict=None, adaptive=adaptive),
}
sampling = replace(sampling_of(p), max_tokens=max_tokens)
items = load_prompts(sys.argv[1])
res = {k: [] for k in rows}
for b in rows.values():
    run_to_summary(fresh(b).stream(Request(messages=messages_for(p, [{"role": "user", "content": "Hi"}])), replace(sampling, max_tokens=8)))
for item in items:
    req = Request(messages=messages_for(p, [{"role": "user", "content": item.first}]))
    for name, b in rows.items():
        s = run_to_summary(fresh(b).stream(req, sampling))
        res[name].append((item.task, s.tokens, s.passes, s.decode_tok_s, s.token_ids))
    warm = rows["suffix warm"]
    warm.memory.add(item.id, res["suffix warm"][-1][4])
    assert all(r[-1][4] == res["target-only"][-1][4] for r in res.values()), item.id
    print(item.id, " ".join(f"{k}:{v[-1][1]/v[-1][2]:.2f}t/p,{v[-1][3]:.0f}tok/s" for k, v in res.items()), flush=True)
tasks = sorted({t for t, *_ in res["target-only"]})
print("row", *tasks, "all", sep=" | ")
for name, runs in res.items():
    cells = []
    for t in tasks + [None]:
        sub = [r for r in runs if t is None or r[0] == t]
        tpp = sum(r[1] for r in sub) / sum(r[2] for r in sub)
        med = statistics.median(r[3] for r in sub)
        base = statistics.median(r[3] for r in res["target-only"] if t is None or r[0] == t)
        cells.append(f"{tpp:.2f} t/pass, {med:.1f} tok/s ({med/base:.2f}x)")
    print(name, *cells, sep=" | ")
print("memory at end:", rows["suffix warm"].memory.sequences, rows["suffix warm"].memory.live_tokens)
