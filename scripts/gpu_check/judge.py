"""Judging a speculative reply against its target-only reference, with the engine API only.

`specchat verify` does this in specchat/verify.py, which the device cannot import (it pulls in
the app's prompt and profile modules, and with them pydantic). The rules are the shared ones
(specchat/compare.py, which needs nothing but the engine): a difference where both runs had
single-token arithmetic (strict verification) is a mismatch; elsewhere the speculative run's own
verify row is recomputed (backends/speculative/replay.py): a near-tie if it chose the emitted
token, a mismatch if not.
"""
from __future__ import annotations

from typing import Sequence

from specchat.backends.base import Request, Sampling, Summary, run_to_summary
from specchat.backends.speculative.replay import reference_scores, verify_row_choice
from specchat.compare import Verdict, judge_tokens, near_tie_margin


def fresh(backend):
    """Empty the target's (and a draft model's) KV cache, so that both runs prefill alike."""
    target = getattr(backend, "target", backend)
    target.truncate(0)
    engine = getattr(getattr(backend, "drafter", None), "engine", None)
    if engine is not None:
        engine.truncate(0)
    return backend


def _scores(target, prompt: Sequence[int], ref: Summary, sampling: Sampling):
    def scores_at(i: int, a: int, b: int) -> tuple[float, float]:
        scores = reference_scores(target, prompt, ref.token_ids[:i], sampling)
        return float(scores[a]), float(scores[b])

    return scores_at


def _margin(engine) -> float:
    return near_tie_margin("bfloat16" if engine.precision == "int4" else engine.precision)


def judge(target, spec, request: Request, sampling: Sampling, ref: Summary, out: Summary) -> Verdict:
    """`ref` from `target` alone, `out` from the speculative backend `spec` (exact acceptance)."""
    prompt = target.prompt_ids(request)
    whole_prefill = ref.prefill_start == 0 and out.prefill_start == 0
    strict_until = min(ref.exact_tokens or 0, out.exact_tokens or 0) if whole_prefill else 0

    def row_choice(i: int):
        if not whole_prefill:
            return None
        return verify_row_choice(target, prompt, out.token_ids, out.pass_log, i, sampling, spec.strict)

    return judge_tokens(ref.token_ids, out.token_ids, target.detokenize, tie_margin=_margin(target),
                        stops=(ref.stop_reason, out.stop_reason), scores_at=_scores(target, prompt, ref, sampling),
                        strict_until=strict_until,
                        not_strict=f"{target.precision} verify rows on {target.device.type} (not strict)",
                        row_choice=row_choice)


def judge_engines(reference, request: Request, sampling: Sampling, ref: Summary, out: Summary) -> Verdict:
    """`out` from another engine of the same weights (compiled graphs): no verify row to recompute,
    so a difference within the near-tie margin of `reference`'s own scores is a near-tie."""
    prompt = reference.prompt_ids(request)
    return judge_tokens(ref.token_ids, out.token_ids, reference.detokenize, tie_margin=_margin(reference),
                        stops=(ref.stop_reason, out.stop_reason), scores_at=_scores(reference, prompt, ref, sampling),
                        not_strict="another engine's graphs")


def compare(target, spec, request: Request, sampling: Sampling) -> tuple[Summary, Summary, Verdict]:
    ref = run_to_summary(fresh(target).stream(request, sampling))
    out = run_to_summary(fresh(spec).stream(request, sampling))
    return ref, out, judge(target, spec, request, sampling, ref, out)
