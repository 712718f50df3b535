"""The one streaming interface every backend speaks.

A backend turns a request (chat messages or prompt token ids) plus sampling settings into a
stream of `Step` events, one per forward pass of the target model, and ends the stream with
exactly one `Summary`. Speculative engines fill in how many tokens a pass drafted and accepted.
Metric names follow vLLM's (draft tokens, accepted tokens, accepted per position, mean
acceptance length = 1 + accepted / drafts) so figures compare across tools.
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Optional, Sequence, Union

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}

STOP_EOS = "eos"
STOP_MAX_TOKENS = "max_tokens"
STOP_CANCELLED = "cancelled"
STOP_CONTEXT_FULL = "context_full"
# A constraint (JSON schema, regex, grammar) left no token the reply may continue with.
STOP_CONSTRAINT = "constraint_dead_end"

# What front ends show for a remote server that says nothing about its speculation: the figures
# are unknown, which is not the same as zero drafts or 1.0 tokens per pass.
NO_SPEC_METRICS = "server reports no speculative metrics"


class BackendError(Exception):
    """A problem the user can fix (missing file, mismatched drafter, prompt too long).

    Its message is one line saying what is wrong and how to fix it; front ends print it as is.
    """


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 256

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


CONSTRAINT_KINDS = ("json_schema", "regex", "grammar")


@dataclass(frozen=True)
class Constraint:
    """The shape a reply must take: a JSON schema (its JSON text), a regular expression, or a
    grammar (Lark syntax, or GBNF / EBNF as the grammar library reads them). `origin` names where
    it came from (a file path, `--regex`, a profile) for one-line messages."""

    kind: str
    text: str
    origin: str = ""

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {CONSTRAINT_KINDS}, not {self.kind!r}")


@dataclass
class Request:
    """What to generate from: chat messages (rendered with the model's own chat template)
    or prompt token ids used as they are; `constraint`, if set, is the shape every reply token
    must keep (every backend applies it to the target's own choice)."""

    messages: Sequence[Message] | None = None
    prompt_ids: Sequence[int] | None = None
    constraint: Constraint | None = None

    def __post_init__(self):
        if (self.messages is None) == (self.prompt_ids is None):
            raise ValueError("Request needs exactly one of messages or prompt_ids")


@dataclass
class Step:
    """One target forward pass worth of output.

    `token_ids` are the tokens this pass committed. For a speculative pass the first
    `accepted` of them are drafts the target confirmed and the last one is the target's own
    (correction or bonus) token; `drafted` is how many tokens the drafter proposed, `draft`
    which (accepted or not).
    """

    token_ids: list[int]
    text: str
    drafted: int = 0
    accepted: int = 0
    # Tokens this step stands for when their ids are unknown (a remote server without logprobs ids).
    token_count: int | None = None
    draft: list[int] = field(default_factory=list)
    # Whether the pass computed each row exactly as a single-token pass does (native/exact_rows.py),
    # so its tokens are the ones target-only decoding computes; None where the backend cannot say.
    row_exact: bool | None = None
    # Who guessed the drafts (a drafter's source name: "lookup", "suffix", "history", "mtp", ...); "" for none
    source: str = ""
    # Why sources sat this pass out ("drafting paused: ..." from the gate, speculative/gate.py); "" when none did
    paused: str = ""

    @property
    def n_tokens(self) -> int:
        return self.token_count if self.token_count is not None else len(self.token_ids)


@dataclass
class Summary:
    """The closing event of every stream."""

    stop_reason: str
    tokens: int = 0
    passes: int = 0
    prompt_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    drafts: int = 0  # passes that verified at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    error: str | None = None
    # Remote servers count speculation themselves: where the figures came from (e.g. "vLLM /metrics"),
    # and False when the server reported none (then drafts and acceptance are unknown, not zero).
    spec_source: str | None = None
    spec_reported: bool = True
    # How the reply was computed, for telling a floating-point flip from a bug (specchat verify):
    # prompt tokens reused from the cache instead of computed by this run's prefill; leading reply
    # tokens chosen by passes that all had single-token arithmetic (None: the backend cannot say);
    # and per pass, the tokens it verified as drafts and how many tokens it emitted.
    prefill_start: int | None = None
    exact_tokens: int | None = None
    pass_log: list[tuple[list[int], int]] = field(default_factory=list)
    # Per reply token, the most likely tokens there as (id, logprob) pairs, best first, where a
    # server reports them (None: not reported for that token, e.g. llama-server's accepted drafts).
    alternatives: list[list[tuple[int, float]] | None] = field(default_factory=list)
    # Passes on which the gate held a drafter back because its drafts did not pay, and the latest reason
    paused_passes: int = 0
    paused_note: str | None = None

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first one, per second after the first one arrived."""
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens over all target passes, drafted or not: the figure that decides speed."""
        return self.tokens / self.passes if self.passes else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens per drafted pass: over the passes that verified a draft only (vLLM's mean
        acceptance length), so it reads higher than `tokens_per_pass` when some passes drafted nothing."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Share of passes that drafted position i whose draft at i was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafts_per_position)]

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(decode_tok_s=self.decode_tok_s, tokens_per_pass=self.tokens_per_pass if self.spec_reported else None,
                 mean_accepted=self.mean_accepted,
                 acceptance_rate=self.acceptance_rate, acceptance_by_position=self.acceptance_by_position)
        return d


Event = Union[Step, Summary]


def tally_positions(drafted: list[int], accepted: list[int], step: Step) -> None:
    """Per draft position: how many passes drafted a token there, and how many kept it."""
    while len(drafted) < step.drafted:
        drafted.append(0)
        accepted.append(0)
    for i in range(step.drafted):
        drafted[i] += 1
    for i in range(step.accepted):
        accepted[i] += 1


class StreamStats:
    """Accumulates `Step`s into a `Summary`; every backend uses it so metrics mean one thing."""

    def __init__(self, prompt_tokens: int = 0, prefill_start: int | None = None):
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.summary = Summary(stop_reason="", prompt_tokens=prompt_tokens, prefill_start=prefill_start, exact_tokens=0)
        self._exact = True  # every pass so far had single-token arithmetic

    def add(self, step: Step) -> Step:
        s = self.summary
        if self.first_token_at is None and step.n_tokens:
            self.first_token_at = time.perf_counter()
        s.passes += 1
        if step.row_exact is None:
            s.exact_tokens, self._exact = None, False
        elif self._exact and step.row_exact:
            s.exact_tokens += step.n_tokens
        else:
            self._exact = False
        s.tokens += step.n_tokens
        s.token_ids.extend(step.token_ids)
        s.text += step.text
        s.pass_log.append((list(step.draft), step.n_tokens))
        if step.paused:
            s.paused_passes += 1
            s.paused_note = step.paused
        if step.drafted:
            s.drafts += 1
            s.draft_tokens += step.drafted
            s.accepted_tokens += step.accepted
            tally_positions(s.drafts_per_position, s.accepted_per_position, step)
        return step

    def finish(self, stop_reason: str, tail_text: str = "", error: str | None = None) -> Summary:
        now = time.perf_counter()
        s = self.summary
        s.text += tail_text
        s.stop_reason = stop_reason
        s.error = error
        s.wall_s = now - self.start
        if self.first_token_at is not None:
            s.ttft_s = self.first_token_at - self.start
            s.decode_s = now - self.first_token_at
        return s


class Backend(ABC):
    """A loaded model behind the streaming interface.

    `stream` yields `Step`s and ends with one `Summary`. Setting `cancel` (or closing the
    generator) stops generation after the current pass; the backend is then ready for the
    next request.
    """

    name: str = "backend"
    # How this backend runs below its best on this machine, in a line its numbers are never read
    # without (None: nothing to say); the bench prints it under its table.
    caveat: Optional[str] = None

    @property
    @abstractmethod
    def context_length(self) -> int: ...

    @abstractmethod
    def tokenize_chat(self, messages: Sequence[Message]) -> list[int]:
        """Render messages with the model's own chat template (with the generation prompt)."""

    @abstractmethod
    def detokenize(self, token_ids: Sequence[int]) -> str: ...

    @abstractmethod
    def stream(self, request: Request, sampling: Sampling,
               cancel: threading.Event | None = None) -> Iterator[Event]: ...

    def prompt_ids(self, request: Request) -> list[int]:
        if request.prompt_ids is not None:
            return list(request.prompt_ids)
        return self.tokenize_chat(request.messages)

    def checked_prompt(self, request: Request) -> list[int]:
        """The request's prompt ids, refused with one clear line if empty or past the context."""
        prompt = self.prompt_ids(request)
        if not prompt:
            raise BackendError("the prompt is empty; send some text")
        self.check_fits(len(prompt))
        return prompt

    def check_fits(self, n_prompt: int) -> None:
        if n_prompt >= self.context_length:
            raise BackendError(
                f"prompt is {n_prompt} tokens but the context holds {self.context_length}: "
                f"shorten the conversation (new chat) or raise `context` in the profile")

    def prepare_in_background(self) -> None:
        """Start preparing faster passes in the background, where loading planned some (a torch
        engine's compiled graphs not stored yet). The app calls it when that would slow no reply
        its user waits on: a chat at load, a one-shot `run` after its reply."""

    def background_status(self) -> Optional[str]:
        """A short line on faster passes being prepared in the background (None: none are)."""
        return None

    def switch_if_ready(self) -> Optional[str]:
        """Between replies only: move to what was prepared in the background if it is ready.
        Returns a line saying what changed (None: nothing did)."""
        return None

    def close(self) -> None:
        """Release model memory."""


def decode_stream(tokens: Iterator[int], *, prompt_tokens: int, sampling: Sampling, context_length: int,
                  is_eos: Callable[[int], bool], detokenize: Callable[[Sequence[int]], str],
                  cancel: threading.Event | None = None, row_exact: bool | None = None,
                  prefill_start: Callable[[], int | None] = lambda: None) -> Iterator[Event]:
    """Target-only streaming around a lazy iterator of sampled tokens (one model pass each),
    with the stop rules every backend shares: end of sequence, max tokens, a full context,
    cancellation. The iterator is only advanced when another token is wanted. `row_exact`: what
    the backend knows of its passes' arithmetic (Step.row_exact); `prefill_start`: how many
    prompt tokens its prefill reused, known once the first token is out."""
    from .detok import IncrementalDetokenizer

    stats = StreamStats(prompt_tokens=prompt_tokens)
    detok = IncrementalDetokenizer(detokenize)
    reason, generated = STOP_MAX_TOKENS, 0
    try:
        if cancel is not None and cancel.is_set():
            reason = STOP_CANCELLED
        else:
            for token in tokens:
                if is_eos(token):
                    reason = STOP_EOS
                    break
                generated += 1
                if generated == 1:
                    stats.summary.prefill_start = prefill_start()
                yield stats.add(Step([token], detok.add([token]), row_exact=row_exact))
                if generated >= sampling.max_tokens:
                    break
                if prompt_tokens + generated >= context_length:
                    reason = STOP_CONTEXT_FULL
                    break
                if cancel is not None and cancel.is_set():
                    reason = STOP_CANCELLED
                    break
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()
    yield stats.finish(reason, detok.flush())


def run_to_summary(events: Iterator[Event]) -> Summary:
    """Drain a stream and return its summary."""
    summary = None
    for ev in events:
        if isinstance(ev, Summary):
            summary = ev
    if summary is None:
        raise RuntimeError("stream ended without a Summary")
    return summary
