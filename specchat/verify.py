"""`specchat verify`: run each prompt target-only and speculatively with the same seed and say,
per prompt, identical or where they first differ, and whether that was a floating-point near-tie
(possible only where verification was not strict) or a real mismatch (see compare.py). With
`repeat` > 1 the target-only reference runs that many times, each from a fresh cache: a prompt
whose runs disagree is "target not reproducible", so that no drafter is blamed for the target's
own noise, and the summary gives the target's run-to-run agreement."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

from specchat.backends.base import Backend, Request, Sampling, Summary, run_to_summary
from specchat.backends.speculative.replay import reference_scores
from specchat.compare import (ENGINES_DIFFER, IDENTICAL, MISMATCH, NEAR_TIE, NOT_REPRODUCIBLE, Verdict, judge_runs,
                              judge_text, judge_tokens, near_tie_margin)
from specchat.prompts import PromptItem


def torch_engine_of(backend: Backend):
    """The TorchBackend behind a backend (itself, or the target of a speculative one), if any."""
    from specchat.backends.native.engine import TorchBackend

    if isinstance(backend, TorchBackend):
        return backend
    target = getattr(backend, "target", None)
    return target if isinstance(target, TorchBackend) else None


def scores_function(reference: Backend, prompt: Sequence[int], ref_ids: Sequence[int],
                    sampling: Sampling) -> Optional[Callable[[int, int, int], tuple[float, float]]]:
    engine = torch_engine_of(reference)
    if engine is None:
        return None

    def scores_at(i: int, a: int, b: int) -> tuple[float, float]:
        scores = reference_scores(engine, prompt, ref_ids[:i], sampling)
        return float(scores[a]), float(scores[b])

    return scores_at


def margin_function(reference: Backend, prompt: Sequence[int], ref_ids: Sequence[int],
                    sampling: Sampling) -> Optional[Callable[[int, int, int], float]]:
    """The reference's score gap between two tokens at a position (for margin-only judgements)."""
    scores_at = scores_function(reference, prompt, ref_ids, sampling)
    if scores_at is None:
        return None
    return lambda i, a, b: (lambda s: s[0] - s[1])(scores_at(i, a, b))


def reported_margin_function(ref: Summary, sampling: Sampling,
                             tie_margin: float) -> Optional[Callable[[int, int, int], float]]:
    """The reference's logprob gap between two tokens from the alternatives its server reported
    (greedy only: there the gap of logprobs is the gap of logits). For a token not among them the
    gap is at least the one to the last reported: given where that is already past `tie_margin`,
    else None (unknown: no near-tie is assumed). None too where nothing was reported."""
    if not sampling.greedy or not any(ref.alternatives):
        return None

    def margin_at(i: int, a: int, b: int) -> Optional[float]:
        top = dict(ref.alternatives[i]) if i < len(ref.alternatives) and ref.alternatives[i] else {}
        if a not in top:
            return None
        if b in top:
            return top[a] - top[b]
        at_least = top[a] - min(top.values())
        return at_least if at_least > tie_margin else None

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
    return near_tie_margin(precision)


@dataclass
class Arithmetic:
    """How far two runs' arithmetic is the same by construction, and what it was beyond."""

    exact_until: int  # leading reply tokens both computed with single-token arithmetic
    beyond: str | Callable[[int], str]  # in words, or a function of the token index: why the rest is not strict


def verify_block_of(out: Summary, index: int) -> int:
    """Rows of the verify pass that emitted reply token `index` (1: a single-token pass or the prefill)."""
    emitted = 0
    for draft, count in out.pass_log:
        emitted += count
        if index < emitted:
            return len(draft) + 1
    return 1


def arithmetic_key(engine) -> tuple:
    """What decides an engine's arithmetic: its weights and settings (not where it caches files)."""
    return engine.model_path.resolve(), {k: v for k, v in engine.settings.items() if k != "cache_dir"}


def shared_arithmetic(reference: Backend, other: Backend, ref: Summary, out: Summary) -> Arithmetic:
    """Both runs compute token i with the same arithmetic when both ran the same engine settings,
    both prefilled the whole prompt, and every pass up to token i computed each of its rows as
    a single-token pass does (Summary.exact_tokens)."""
    ref_engine, other_engine = torch_engine_of(reference), torch_engine_of(other)
    if ref_engine is None or other_engine is None:
        return Arithmetic(0, "a backend that does not say how it computed its tokens")
    if ref_engine is not other_engine and arithmetic_key(ref_engine) != arithmetic_key(other_engine):
        return Arithmetic(0, "the reference runs another engine or other settings")
    if ref.prefill_start != 0 or out.prefill_start != 0:
        return Arithmetic(0, f"a prefill reused {max(ref.prefill_start or 0, out.prefill_start or 0)} cached tokens")
    until = min(ref.exact_tokens or 0, out.exact_tokens or 0)

    def beyond(i: int) -> str:
        rows = verify_block_of(out, i)
        where = f"a {rows}-row verify block" if rows > 1 else "a single-token pass after multi-row ones"
        return f"{other_engine.precision} rows, token {i} from {where} (strict: false)"

    return Arithmetic(until, beyond)


def row_choice_function(backend: Backend, prompt: Sequence[int], out: Summary, sampling: Sampling,
                        constraint=None) -> Optional[Callable[[int], Optional[int]]]:
    """The speculative run's own verify row at a token, recomputed, where that can be done: a
    torch speculative backend with exact acceptance whose run prefilled the whole prompt (under
    the request's `constraint`, with the mask of the row's prefix)."""
    from specchat.backends.speculative.backend import SpeculativeBackend
    from specchat.backends.speculative.replay import verify_row_choice

    if not isinstance(backend, SpeculativeBackend) or out.prefill_start != 0 or not out.token_ids:
        return None
    if backend.acceptance == "rejection" and not sampling.greedy:
        return None  # rejection sampling is lossless in distribution, not seed-identical: no row decides alone

    def choice(i: int) -> Optional[int]:
        return verify_row_choice(backend.target, prompt, out.token_ids, out.pass_log, i, sampling, backend.strict,
                                 constraint)

    return choice


@dataclass
class PromptCheck:
    prompt: PromptItem
    reference: Summary
    speculative: Summary
    verdict: Verdict
    turn: int = 1  # which user turn of the prompt's conversation
    reference_runs: int = 1  # how many times the reference ran (verify --repeat)
    request: Optional[Request] = None  # what both runs were sent
    under_load: Optional[dict] = None  # where the replies changed with others in flight (verify --concurrency)

    @property
    def label(self) -> str:
        return self.prompt.id if self.turn == 1 else f"{self.prompt.id}.{self.turn}"

    def as_dict(self) -> dict:
        return {"id": self.prompt.id, "turn": self.turn, "category": self.prompt.category, **self.verdict.as_dict(),
                "reference_tokens": self.reference.tokens, "speculative_tokens": self.speculative.tokens,
                "tokens_per_pass": self.speculative.tokens_per_pass if self.speculative.spec_reported else None,
                "mean_accepted": self.speculative.mean_accepted if self.speculative.spec_reported else None,
                "reference_runs": self.reference_runs,
                "reference_reproducible": self.verdict.kind != NOT_REPRODUCIBLE, "under_load": self.under_load}


def judge_replies(reference: Backend, request: Request, ref: Summary, other: Summary, sampling: Sampling,
                  tie_margin: Optional[float] = None, other_backend: Optional[Backend] = None) -> Verdict:
    """Align by token ids where both replies carry them, by text otherwise (a remote server that
    returns no ids). `other_backend`: the backend that produced `other`, which lets its verify
    rows be recomputed and tells whether both runs shared their arithmetic."""
    if not (ref.token_ids and other.token_ids):
        return judge_text(ref.text, other.text)
    prompt = reference.prompt_ids(request) if torch_engine_of(reference) is not None else []
    scores_at = scores_function(reference, prompt, ref.token_ids, sampling) if prompt else None
    arithmetic = Arithmetic(0, "")
    row_choice = None
    if other_backend is not None:
        arithmetic = shared_arithmetic(reference, other_backend, ref, other)
        if prompt:
            row_choice = row_choice_function(other_backend, prompt, other, sampling, request.constraint)
    tie_margin = tie_margin if tie_margin is not None else tie_margin_of(reference)
    return judge_tokens(ref.token_ids, other.token_ids, reference.detokenize,
                        margin_at=None if scores_at else reported_margin_function(ref, sampling, tie_margin),
                        tie_margin=tie_margin,
                        stops=(ref.stop_reason, other.stop_reason), scores_at=scores_at,
                        strict_until=arithmetic.exact_until, not_strict=arithmetic.beyond, row_choice=row_choice)


def check_prompt(spec: Backend, reference: Backend, request: Request, sampling: Sampling,
                 repeat: int = 1, own: Optional[Backend] = None) -> tuple[Summary, Summary, Verdict]:
    """The reference's reply (its first run of `repeat`, each from a fresh cache), the speculative
    reply and the verdict: the two replies judged, or NOT_REPRODUCIBLE where the reference's runs
    disagree (then the speculative reply is only said to equal one of them, or none).

    `own`: the speculative profile's own target-only, where the reference is another engine,
    backend, dtype or quantization: the speculative reply is judged against it (the drafter's
    part), and where that is no mismatch, its reply against the reference (ENGINES_DIFFER: the
    engines' part)."""
    refs = [run_to_summary(fresh(reference).stream(request, sampling)) for _ in range(repeat)]
    out = run_to_summary(fresh(spec).stream(request, sampling))
    unsteady = reference_disagrees(reference, refs, out) if repeat > 1 else None
    if unsteady is not None:
        return refs[0], out, unsteady
    if own is None:
        return refs[0], out, judge_replies(reference, request, refs[0], out, sampling, other_backend=spec)
    own_reply = run_to_summary(fresh(own).stream(request, sampling))
    return refs[0], out, attribute(own, request, own_reply, out, refs[0], sampling, spec)


def attribute(own: Backend, request: Request, own_reply: Summary, out: Summary, ref: Summary, sampling: Sampling,
              spec: Optional[Backend] = None) -> Verdict:
    """The verdict on a speculative reply `out` whose reference `ref` came from another engine,
    backend, dtype or quantization, told apart with `own_reply`, the speculative profile's own
    target-only reply (from `own`, to `request`): judged against it first (a mismatch there is the
    drafter's), and where that is no mismatch, its reply against the reference (ENGINES_DIFFER:
    the engines' part, both tokens scored by our target where it can). `spec`: the backend that
    produced `out` (its verify rows recomputed where they can be)."""
    drafter = judge_replies(own, request, own_reply, out, sampling, other_backend=spec)
    if drafter.kind == MISMATCH:
        drafter.why = f"against its own target-only reply, so the drafter's: {drafter.why}".rstrip(": ")
        return drafter
    engines = judge_replies(own, request, own_reply, ref, sampling)
    if engines.kind == IDENTICAL:
        return drafter
    # the reference's token first, as in every verdict; both scored by our target where it can
    v = Verdict(ENGINES_DIFFER, engines.index, engines.other_text, engines.ref_text, None, engines.compared,
                engines.by, ref_score=engines.other_score, other_score=engines.ref_score, complete=engines.complete)
    if v.ref_score is not None and v.other_score is not None:
        v.margin = v.ref_score - v.other_score
    v.why = ("the speculative reply is its own target-only reply" if drafter.kind == IDENTICAL else
             f"the speculative reply against its own target-only: {drafter.line()}")
    return v


def reference_disagrees(reference: Backend, refs: list[Summary], out: Summary) -> Optional[Verdict]:
    """NOT_REPRODUCIBLE where the reference's runs `refs` gave more than one reply, else None."""
    by_ids = all(r.token_ids for r in refs) and bool(out.token_ids)
    reply = (lambda r: list(r.token_ids)) if by_ids else (lambda r: r.text)
    verdict = judge_target_runs(reference, refs, by_ids)
    if verdict is not None:
        same = [k for k, r in enumerate(refs, 1) if reply(r) == reply(out) and r.stop_reason == out.stop_reason]
        verdict.why += (f"; the speculative reply equals run {', '.join(map(str, same))}" if same
                        else "; the speculative reply equals none of them")
    return verdict


def judge_target_runs(reference: Backend, refs: list[Summary], by_ids: Optional[bool] = None) -> Optional[Verdict]:
    """NOT_REPRODUCIBLE where target-only runs `refs` of one request (the same settings, each from
    a fresh cache) gave more than one reply, else None. Aligned by token ids where every run
    carries them (or as `by_ids` says), by text otherwise."""
    by_ids = all(r.token_ids for r in refs) if by_ids is None else by_ids
    reply = (lambda r: list(r.token_ids)) if by_ids else (lambda r: r.text)
    return judge_runs([(reply(r), r.stop_reason) for r in refs], reference.detokenize, "tokens" if by_ids else "text")


def check_conversation(spec: Backend, reference: Backend, profile, item: PromptItem, sampling: Sampling,
                       turns: int = 1, repeat: int = 1, own: Optional[Backend] = None
                       ) -> Iterator[tuple[PromptCheck, Optional[str]]]:
    """The prompt's first `turns` user turns as one conversation, each checked as `check_prompt`
    does and continued with the reference's reply; the oldest turns are left out when the next one
    would not fit, as in the chat (context_window.py). Yields each turn's check and the note saying
    what was left out (None: nothing). A suffix drafter's memory learns each speculative reply, as
    in the chat, so that later prompts are checked with drafts from earlier replies too."""
    from specchat import suffix_memory
    from specchat.constraints import constraint_for
    from specchat.context_window import fit_window
    from specchat.loading import messages_for

    system = messages_for(profile, [], None)
    constraint = constraint_for(profile, item)
    context = min(spec.context_length, reference.context_length)
    history: list[dict] = []
    start = 0
    for turn, text in enumerate(item.turns[:turns], 1):
        history.append({"role": "user", "content": text})
        window = fit_window(lambda msgs: len(spec.tokenize_chat(msgs)), system, history, start, context,
                            sampling.max_tokens, profile.context_policy)
        start = window.start
        request = Request(messages=system + history[start:], constraint=constraint)
        ref, out, verdict = check_prompt(spec, reference, request, sampling, repeat, own)
        suffix_memory.remember(spec, None, None, out.token_ids)
        yield PromptCheck(item, ref, out, verdict, turn, repeat, request), window.note(context)
        history.append({"role": "assistant", "content": ref.text})


def summarize(checks: list[PromptCheck]) -> dict:
    n = len(checks)
    kinds = [c.verdict.kind for c in checks]
    unsteady, engines = kinds.count(NOT_REPRODUCIBLE), kinds.count(ENGINES_DIFFER)
    return {"prompts": n, "identical": n - kinds.count(NEAR_TIE) - kinds.count(MISMATCH) - unsteady - engines,
            "near_ties": kinds.count(NEAR_TIE), "mismatches": kinds.count(MISMATCH), "engines_differ": engines,
            "near_tie_rate": kinds.count(NEAR_TIE) / n if n else 0.0,
            "reference_runs": max((c.reference_runs for c in checks), default=1),
            "target_not_reproducible": unsteady,
            "target_reproducible_rate": (n - unsteady) / n if n else 1.0}
