"""A real `Backend` that streams scripted replies: for front-end tests, never shipped."""
from __future__ import annotations

import re
import threading
import time
from typing import Iterator, Sequence

from specchat.backends.base import (STOP_CANCELLED, STOP_EOS, STOP_MAX_TOKENS, Backend, BackendError, Event, Request,
                                    Sampling, Step, StreamStats)

_VOCAB: dict[str, int] = {}
_PIECES: dict[int, str] = {}


def piece_id(piece: str) -> int:
    if piece not in _VOCAB:
        _VOCAB[piece] = len(_VOCAB) + 1
        _PIECES[_VOCAB[piece]] = piece
    return _VOCAB[piece]


def pieces_of(text: str) -> list[str]:
    """Word-ish tokens: each keeps its leading whitespace (like BPE's 'Ġword')."""
    return re.findall(r"\s*\S+|\s+", text)


class ScriptedBackend(Backend):
    """Streams the given replies in turn (the last one repeats).

    `accept` is a cycle of accepted-draft counts per pass; with it each pass commits
    accepted + 1 tokens and reports `drafted=depth` (None in the cycle: a pass that drafted nothing). `delay` sleeps per pass. Cancel is
    honoured between passes."""

    name = "scripted"

    def __init__(self, replies: Sequence[str], accept: Sequence[int] | None = None, depth: int = 4,
                 delay: float = 0.0, first_delay: float = 0.0, fail_with: str | None = None, ids: bool = True,
                 context: int = 4096):
        self.replies = list(replies)
        self.context = context
        self.accept = list(accept) if accept else None
        self.depth = depth
        self.delay = delay
        self.first_delay = first_delay
        self.fail_with = fail_with
        self.ids = ids
        self.requests: list[Request] = []
        self.closed = False

    @property
    def context_length(self) -> int:
        return self.context

    def tokenize_chat(self, messages) -> list[int]:
        return [piece_id(p) for m in messages for p in pieces_of(f"{m['role']}: {m['content']}\n")]

    def detokenize(self, token_ids) -> str:
        return "".join(_PIECES[i] for i in token_ids)

    def stream(self, request: Request, sampling: Sampling, cancel: threading.Event | None = None) -> Iterator[Event]:
        self.requests.append(request)
        if self.fail_with:
            raise BackendError(self.fail_with)
        reply = self.replies[min(len(self.requests) - 1, len(self.replies) - 1)]
        stats = StreamStats(prompt_tokens=len(self.checked_prompt(request)))  # refused past the context
        toks = [piece_id(p) for p in pieces_of(reply)][:sampling.max_tokens]
        i, n = 0, 0
        if self.first_delay:
            time.sleep(self.first_delay)
        while i < len(toks):
            if cancel is not None and cancel.is_set():
                yield stats.finish(STOP_CANCELLED)
                return
            planned = self.accept[n % len(self.accept)] if self.accept else None  # None: a pass with no draft
            acc = min(planned, len(toks) - i - 1) if planned is not None else 0
            chunk = toks[i:i + acc + 1]
            i += len(chunk)
            n += 1
            step = Step(chunk if self.ids else [], self.detokenize(chunk),
                        drafted=self.depth if planned is not None else 0, accepted=acc)
            if not self.ids:  # a backend without ids still counts its tokens
                stats.add(Step(chunk, step.text, step.drafted, step.accepted))
                stats.summary.token_ids = []
                yield step
            else:
                yield stats.add(step)
            if self.delay:
                time.sleep(self.delay)
        stop = STOP_MAX_TOKENS if len(toks) < len(pieces_of(reply)) else STOP_EOS
        yield stats.finish(stop)

    def close(self) -> None:
        self.closed = True
