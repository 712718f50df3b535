"""`specchat verify`: run each prompt target-only and speculatively with the same seed and say,
per prompt, identical or where they first differ and whether that was a floating-point
near-tie or a real mismatch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from specchat.backends.base import Backend, Request, Sampling, Summary, run_to_summary
from specchat.compare import MISMATCH, NEAR_TIE, Verdict, judge_text, judge_tokens, near_tie_margin
from specchat.prompts import PromptItem


def torch_engine_of(backend: Backend):
    """The TorchBackend behind a backend (itself, or the target of a speculative one), if any."""
    from specchat.backends.native.engine import TorchBackend

    if isinstance(backend, TorchBackend):
        return backend
    target = getattr(backend, "target", None)
    return target if isinstance(target, TorchBackend) else None


def reference_scores(engine, prompt: Sequence[int], reply: Sequence[int], sampling: Sampling):
    """What target-only decoding maximised when it chose the token after prompt + reply: the
    logits (greedy), or tempered, filtered logits plus that position's Gumbel noise. Recomputed
    with exactly the arithmetic of target-only decoding: the prompt in one pass from an empty
    cache, then one token per pass."""
    from specchat.backends.native import sampling as sampler

    engine.truncate(0)
    logits = engine.prefill(list(prompt))
    for pos, token in enumerate(reply, start=len(prompt)):
        logits, _ = engine.forward([token], pos, all_logits=False)
    position = len(prompt) + len(reply)
    if sampling.greedy:
        return logits[-1]
    noise = sampler.gumbel_noise(sampling.seed, [position], logits.shape[-1], logits.device)
    return (sampler.filtered_logits(logits[-1:], sampling) + noise)[0]


def margin_function(reference: Backend, prompt: Sequence[int], ref_ids: Sequence[int],
                    sampling: Sampling) -> Optional[Callable[[int, int, int], float]]:
    engine = torch_engine_of(reference)
    if engine is None:
        return None

    def margin_at(i: int, a: int, b: int) -> float:
        scores = reference_scores(engine, prompt, ref_ids[:i], sampling)
        return float(scores[a] - scores[b])

    return margin_at


def fresh(backend: Backend) -> Backend:
    """Empty the torch engine's KV cache so that both runs prefill the prompt identically."""
    for engine in (torch_engine_of(backend), getattr(getattr(backend, "drafter", None), "engine", None)):
        if engine is not None:
            engine.truncate(0)
    return backend


def tie_margin_of(backend: Backend) -> float:
    engine = torch_engine_of(backend)
    precision = getattr(engine, "precision", None)
    return near_tie_margin("bfloat16" if precision == "int4" else precision)


@dataclass
class PromptCheck:
    prompt: PromptItem
    reference: Summary
    speculative: Summary
    verdict: Verdict

    def as_dict(self) -> dict:
        return {"id": self.prompt.id, "category": self.prompt.category, **self.verdict.as_dict(),
                "reference_tokens": self.reference.tokens, "speculative_tokens": self.speculative.tokens,
                "mean_accepted": self.speculative.mean_accepted if self.speculative.spec_reported else None}


def judge_replies(reference: Backend, request: Request, ref: Summary, other: Summary, sampling: Sampling,
                  tie_margin: Optional[float] = None) -> Verdict:
    """Align by token ids where both replies carry them, by text otherwise (a remote server that
    returns no ids). Only a torch reference can score a divergence, so only it is asked for the
    prompt's ids."""
    if not (ref.token_ids and other.token_ids):
        return judge_text(ref.text, other.text)
    margin_at = None
    if torch_engine_of(reference) is not None:
        margin_at = margin_function(reference, reference.prompt_ids(request), ref.token_ids, sampling)
    return judge_tokens(ref.token_ids, other.token_ids, reference.detokenize, margin_at,
                        tie_margin if tie_margin is not None else tie_margin_of(reference),
                        stops=(ref.stop_reason, other.stop_reason))


def check_prompt(spec: Backend, reference: Backend, request: Request, sampling: Sampling) -> tuple[Summary, Summary, Verdict]:
    ref = run_to_summary(fresh(reference).stream(request, sampling))
    out = run_to_summary(fresh(spec).stream(request, sampling))
    return ref, out, judge_replies(reference, request, ref, out, sampling)


def summarize(checks: list[PromptCheck]) -> dict:
    n = len(checks)
    kinds = [c.verdict.kind for c in checks]
    return {"prompts": n, "identical": n - kinds.count(NEAR_TIE) - kinds.count(MISMATCH),
            "near_ties": kinds.count(NEAR_TIE), "mismatches": kinds.count(MISMATCH),
            "near_tie_rate": kinds.count(NEAR_TIE) / n if n else 0.0}
