"""Measured results built from fixed figures (no model runs): for the table and chart tests."""
from __future__ import annotations

from specchat.backends.base import Summary
from specchat.bench import ProfileResult, Run
from specchat.ladder import Ladder
from specchat.profiles import Profile, load_profiles
from specchat.prompts import PromptItem

SPEC_BENCH_TASKS = ["writing", "translation", "summarization", "qa", "math_reasoning", "rag"]  # writing: mt_bench


def prompts(tasks=SPEC_BENCH_TASKS) -> list[PromptItem]:
    return [PromptItem(str(i), ["hi"], category=t) for i, t in enumerate(tasks)]


def summary(tok_s: float, depth: int = 0, accepted: float = 0.9, tokens: int = 128) -> Summary:
    """One reply at `tok_s` decode tokens per second; with a depth, every pass drafts `depth` tokens
    and position i accepts accepted**i of them."""
    drafts = round(tokens / (1 + sum(accepted ** (i + 1) for i in range(depth)))) if depth else 0
    per_position = [round(drafts * accepted ** (i + 1)) for i in range(depth)]
    tokens = drafts + sum(per_position) if depth else tokens
    return Summary("length", tokens=tokens, passes=drafts or tokens, decode_s=(tokens - 1) / tok_s, ttft_s=0.0123,
                   drafts=drafts, accepted_tokens=sum(per_position), accepted_per_position=per_position,
                   drafts_per_position=[drafts] * depth)


def result(label: str, profile: Profile, items: list[PromptItem], tok_s: float, reference: str | None = None,
           depth: int = 0) -> ProfileResult:
    res = ProfileResult(label, profile, reference=reference)
    res.runs = [Run(it, summary(tok_s * (1 + 0.05 * n), depth)) for n, it in enumerate(items)]
    return res


def ladder(name: str = "smollm2-mtp-lookup", depths=range(1, 7), tasks=SPEC_BENCH_TASKS) -> Ladder:
    p = load_profiles().get(name)
    items = prompts(tasks)
    ref = result(p.target_only().name, p.target_only(), items, 102.9)
    rungs = []
    for d in depths:
        q = p.model_copy(update={"name": f"{p.name}@{d}", "speculative": p.speculative.model_copy(update={"depth": d})})
        rungs.append((d, result(q.name, q, items, 102.9 * (1 + 0.3 * d) / (1 + 0.02 * d * d), ref.label, depth=d)))
    return Ladder(ref, rungs)
