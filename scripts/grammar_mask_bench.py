"""Per-token cost of a grammar library's next-token mask on this CPU: llguidance against xgrammar.

Both compile the same JSON schema against SmolLM2's tokenizer (49,152 tokens), then walk a valid
reply token by token: fill the next-token bitmask, advance by the reply's token. Every
`--rollback-every` tokens both roll back 3 tokens and advance again, as a speculative loop does
after rejected drafts. Reported: compile time and microseconds per mask fill / advance / rollback.

    python scripts/grammar_mask_bench.py [--model GGUF] [--repeats 5] [--engine]

--engine: also what a constrained token costs specchat's torch engine on top of an unconstrained
one: the matcher's mask (fill and unpack) and the LM head's choice under it, against the head's
unmasked choice (greedy, the int8 argmax head's fast path), over the same reply.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
REPLY = ('{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["mathematics", "poetry", '
         '"engines"], "address": {"city": "London", "zip": "W1"}}')


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def bench_llguidance(hf, ids, rollback_every):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf)
    tok_s = time.perf_counter() - t
    t = time.perf_counter()
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - t
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    fills, advances, rollbacks = [], [], []
    for i, tok in enumerate(ids):
        t = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(m, mask, 0)
        fills.append(time.perf_counter() - t)
        assert (mask[0, tok // 32] >> (tok % 32)) & 1, f"llguidance masked the reply's token {i}"
        t = time.perf_counter()
        assert m.consume_token(tok), m.get_error()
        advances.append(time.perf_counter() - t)
        if rollback_every and i >= 3 and i % rollback_every == 0:
            t = time.perf_counter()
            m.rollback(3)
            rollbacks.append(time.perf_counter() - t)
            assert m.consume_tokens(ids[i - 2:i + 1]), m.get_error()
    assert m.is_accepting()
    return tok_s, compile_s, fills, advances, rollbacks


def bench_xgrammar(hf, ids, rollback_every):
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    tok_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
    compile_s = time.perf_counter() - t
    m = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    fills, advances, rollbacks = [], [], []
    for i, tok in enumerate(ids):
        t = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        fills.append(time.perf_counter() - t)
        assert (mask[0, tok // 32] >> (tok % 32)) & 1, f"xgrammar masked the reply's token {i}"
        t = time.perf_counter()
        assert m.accept_token(tok)
        advances.append(time.perf_counter() - t)
        if rollback_every and i >= 3 and i % rollback_every == 0:
            t = time.perf_counter()
            m.rollback(3)
            rollbacks.append(time.perf_counter() - t)
            for again in ids[i - 2:i + 1]:
                assert m.accept_token(again)
    assert m.is_terminated() or m.accept_token(hf.eos_token_id)
    return tok_s, compile_s, fills, advances, rollbacks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/specchat/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rollback-every", type=int, default=4)
    ap.add_argument("--engine", action="store_true", help="also the torch engine's cost of a constrained token")
    args = ap.parse_args()
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from specchat.backends.native.tokenizer import ChatTokenizer
    from specchat.paths import cache_dir

    torch.set_num_threads(1)
    hf = ChatTokenizer(Path(args.model), cache_dir()).hf
    ids = hf(REPLY, add_special_tokens=False)["input_ids"]
    print(f"CPU: {cpu_name()}; vocabulary {len(hf)} tokens; reply of {len(ids)} tokens; {args.repeats} repeats")
    us = lambda xs: f"{statistics.median(xs) * 1e6:8.1f}"  # noqa: E731
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        fills, advances, rollbacks, compiles, toks = [], [], [], [], []
        for _ in range(args.repeats):
            tok_s, compile_s, f, a, r = fn(hf, ids, args.rollback_every)
            toks.append(tok_s), compiles.append(compile_s)
            fills += f
            advances += a
            rollbacks += r
        print(f"{name:>10}: tokenizer {statistics.median(toks) * 1e3:7.1f} ms, schema compile "
              f"{statistics.median(compiles) * 1e3:7.1f} ms; median us per token: mask {us(fills)} "
              f"(p90 {sorted(fills)[int(len(fills) * 0.9)] * 1e6:.1f}), advance {us(advances)}, "
              f"rollback(3) {us(rollbacks)}")
    if args.engine:
        bench_engine(args.model, ids, args.repeats)


def bench_engine(model: str, ids: list[int], repeats: int) -> None:
    from specchat.backends.base import Constraint, Sampling
    from specchat.backends.constrained import target_matcher
    from specchat.backends.native.engine import TorchBackend
    from specchat.paths import cache_dir

    engine = TorchBackend(model, cache_dir=cache_dir())
    prompt = engine.tokenize_chat([{"role": "user", "content": "Ada Lovelace as JSON"}])
    states, _ = engine.forward(prompt + ids, 0, head=False)  # the reply's rows: one state per position
    rows = states[len(prompt) - 1:len(prompt) - 1 + len(ids)]
    s = Sampling()
    masks, free, masked = [], [], []
    for _ in range(repeats):
        matcher = target_matcher(engine, Constraint("json_schema", json.dumps(SCHEMA), "bench"))
        for i, tok in enumerate(ids):
            state = rows[i:i + 1]
            t = time.perf_counter()
            allowed = matcher.allowed()[None]
            masks.append(time.perf_counter() - t)
            t = time.perf_counter()
            engine.choose(state, [i], s)
            free.append(time.perf_counter() - t)
            t = time.perf_counter()
            engine.choose(state, [i], s, allowed)
            masked.append(time.perf_counter() - t)
            matcher.advance([tok])
    med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    print(f"engine ({engine.precision}): median us per token: mask {med(masks):.1f}, head choice unmasked "
          f"{med(free):.1f}, masked {med(masked):.1f}; a constrained token costs {med(masks) + med(masked) - med(free):.1f} us "
          "more than a free one (a one-token pass of the model itself: several milliseconds)")


if __name__ == "__main__":
    main()
