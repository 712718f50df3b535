"""Replies under load (`specchat verify --concurrency C`): the same requests with C of them in
flight at once, each reply compared with the same request sent alone. A server that batches
requests (vLLM, SGLang, llama-server with several slots) may compute a request differently with
others beside it; this says how often and where, so that such a change is not read as a
drafter's."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

from specchat.backends.base import Backend, BackendError, Request, Sampling, Summary, run_to_summary
from specchat.compare import judge_runs


SERVER_BACKENDS = ("openai", "llamaserver")


def profile_for_load(profile, what: str, concurrency: int):
    """`profile` ready to take `concurrency` requests at once: a server profile (else a
    BackendError, one line: the torch engine and llama.cpp in process decode one request at a
    time), a llama-server that specchat starts given that many slots."""
    if profile.backend not in SERVER_BACKENDS:
        raise BackendError(f"{what} '{profile.name}' runs on the {profile.backend} backend, which decodes one request "
                           "at a time: --concurrency needs server profiles (backend openai or llamaserver)")
    if profile.backend == "llamaserver":
        return profile.model_copy(update={"llama_server": profile.server_config.model_copy(
            update={"slots": concurrency})})
    return profile


@dataclass
class LoadRun:
    concurrency: int
    changed_at: list[Optional[int]]  # per request: where its reply under load parts from its reply alone
    replies: list[Summary]  # every reply under load (a request sent several times: each of them)
    wall_s: float  # from the first request sent to the last reply done

    @property
    def changed(self) -> int:
        return sum(i is not None for i in self.changed_at)

    @property
    def tok_s(self) -> float:
        return sum(r.tokens for r in self.replies) / self.wall_s if self.wall_s > 0 else 0.0


def parts_at(alone: Summary, loaded: Summary) -> Optional[int]:
    """The first token (or character, for a server that returns no ids) where `loaded` parts from
    `alone`, a reply ending elsewhere or otherwise included; None where they are the same reply."""
    by_ids = bool(alone.token_ids) and bool(loaded.token_ids)
    reply = (lambda s: list(s.token_ids)) if by_ids else (lambda s: s.text)
    verdict = judge_runs([(reply(alone), alone.stop_reason), (reply(loaded), loaded.stop_reason)], lambda ids: "",
                         "tokens" if by_ids else "text")
    return None if verdict is None else verdict.index


def run_under_load(backend: Backend, requests: Sequence[Request], alone: Sequence[Summary], sampling: Sampling,
                   concurrency: int) -> LoadRun:
    """Every request again with `concurrency` of them in flight at all times (fewer requests than
    that are sent several times over, to keep the load), each reply compared with `alone[i]`, the
    same request's reply sent alone."""
    order = [i % len(requests) for i in range(max(len(requests), concurrency))]

    def send(i: int) -> Summary:  # a reply that fails names its request and the server's last words
        where = f"under load ({concurrency} in flight), request {i + 1} of {len(requests)} failed"
        try:
            reply = run_to_summary(backend.stream(requests[i], sampling))
        except BackendError as e:
            raise BackendError(f"{where}: {e}") from None
        if reply.error:
            raise BackendError(f"{where}: {reply.error}")
        return reply

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(send, order))
    wall = time.perf_counter() - t0
    changed: list[Optional[int]] = [None] * len(requests)
    for i, reply in zip(order, replies):
        at = parts_at(alone[i], reply)
        if at is not None and (changed[i] is None or at < changed[i]):
            changed[i] = at
    return LoadRun(concurrency, changed, replies, wall)


def check_under_load(spec: Backend, reference: Backend, checks: list, sampling: Sampling, concurrency: int) -> dict:
    """The checked prompts (verify.PromptCheck, each with its request and both replies sent alone)
    again under load, target-only and speculative: each check's `under_load` says where its replies
    changed (None: unchanged); returns the totals, throughput alone and under load included."""
    requests = [c.request for c in checks]
    sides = {"reference": (reference, [c.reference for c in checks]),
             "speculative": (spec, [c.speculative for c in checks])}
    totals: dict = {"concurrency": concurrency, "replies": len(checks)}
    for side, (backend, alone) in sides.items():
        run = run_under_load(backend, requests, alone, sampling, concurrency)
        for check, at in zip(checks, run.changed_at):
            check.under_load = {**(check.under_load or {}), f"{side}_changed_at": at}
        alone_s = sum(r.wall_s for r in alone)
        alone_tok_s = sum(r.tokens for r in alone) / alone_s if alone_s else 0.0
        totals[side] = {"changed": run.changed, "alone_tok_s": alone_tok_s, "loaded_tok_s": run.tok_s}
    return totals


def report(totals: dict, checks: list) -> list[str]:
    """The lines `verify` prints about the run under load."""
    c, n = totals["concurrency"], totals["replies"]
    lines = []
    for side, name in (("reference", "target-only"), ("speculative", "speculative")):
        t = totals[side]
        where = [f"{k.label} at {k.under_load[side + '_changed_at']}" for k in checks
                 if k.under_load and k.under_load.get(side + "_changed_at") is not None]
        shown = ", ".join(where[:6]) + (", …" if len(where) > 6 else "")
        lines.append(f"under load (C={c}): {t['changed']} of {n} {name} replies changed"
                     + (f" ({shown})" if where else "")
                     + f" · {t['alone_tok_s']:.1f} tok/s alone, {t['loaded_tok_s']:.1f} tok/s at C={c}")
    return lines
