"""The `llamaserver` backend: specchat starts its own llama-server and streams from it.

The server runs the model with llama.cpp's own speculation (or none: the reference), on a free
loopback port, for as long as the backend is open. Being the server's only client, the backend
uses llama-server's native `/completion` endpoint, which names every streamed token by id
(`return_tokens`; the OpenAI-compatible endpoint gives ids only through logprobs, which llama-server
leaves out for accepted drafts). The prompt is the server's own rendering of the chat
(`/apply-template`, then `/tokenize`), sent as ids.

Speculative figures come from the server itself: `timings` on every chunk (`timings_per_token`)
carry the drafted and accepted counts so far, which group the streamed tokens into the server's
verify passes as they arrive (live accepted tokens per pass), and the `/metrics` counters give the
exact number of verify passes and the acceptance per draft position of each reply (their growth
across it: nobody else uses this server).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

from ..base import (STOP_CANCELLED, STOP_CONTEXT_FULL, STOP_EOS, STOP_MAX_TOKENS, BackendError, Constraint, Event,
                    Request, Sampling, Step, StreamStats)
from ..gbnf import schema_object
from ..openai import OpenAIBackend
from ..openai.metrics import prometheus_samples
from .flags import server_args, spec_label
from .process import ServerProcess

LLAMACPP_SPEC = "llamacpp:spec_decode_"
STOP_TYPES = {"eos": STOP_EOS, "limit": STOP_MAX_TOKENS, "word": STOP_EOS}
# Alternatives reported per sampled token: how close the server's choice was to the token another
# run chose instead (a near-tie, or not), as far down as a flip of rounding can reach.
TOP_ALTERNATIVES = 8


@dataclass(frozen=True)
class LlamaServerSettings:
    model: Path  # a GGUF file
    alias: str  # the name the server answers to (the profile's `model:`)
    context: int = 4096
    threads: int = 0
    spec: tuple[str, ...] = ()  # the speculative arguments (none: target-only)
    extra: tuple[str, ...] = ()  # any other llama-server arguments, for both
    port: Optional[int] = None
    startup_timeout_s: float = 120.0
    timeout_s: float = 60.0
    repack: bool = True
    slots: int = 1  # requests served at once (-np), each with the whole context


@dataclass(frozen=True)
class SpecCounters:
    """llama-server's speculative counters (Prometheus, `--metrics`)."""

    drafts: int = 0  # verify passes
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: tuple[int, ...] = ()

    def since(self, before: "SpecCounters") -> "SpecCounters":
        per = [a - (before.accepted_per_position[i] if i < len(before.accepted_per_position) else 0)
               for i, a in enumerate(self.accepted_per_position)]
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, tuple(per))


def spec_counters(text: str) -> SpecCounters:
    totals: dict[str, int] = {}
    per_position: dict[int, int] = {}
    for name, labels, value in prometheus_samples(text):
        if not name.startswith(LLAMACPP_SPEC):
            continue
        key = name[len(LLAMACPP_SPEC):].removesuffix("_total")
        if key == "num_accepted_tokens_per_pos" and labels.get("position", "").isdigit():
            per_position[int(labels["position"])] = round(value)
        else:
            totals[key] = round(value)
    per = tuple(per_position.get(i, 0) for i in range(max(per_position) + 1)) if per_position else ()
    return SpecCounters(totals.get("num_drafts", 0), totals.get("num_draft_tokens", 0),
                        totals.get("num_accepted_tokens", 0), per)


@dataclass
class Piece:
    """One streamed chunk of the native endpoint."""

    token_ids: list[int]
    text: str
    drafted: Optional[int]  # cumulative over the reply, None until the first draft
    accepted: Optional[int]
    alternatives: list[Optional[list[tuple[int, float]]]]
    stop_type: Optional[str]  # set on the final chunk
    predicted: Optional[int] = None  # tokens the reply holds with this chunk's (`tokens_predicted`)
    withheld: int = 0  # tokens before this chunk whose ids the server did not send (`_withheld`)

    @property
    def count(self) -> int:
        """The tokens this chunk stands for."""
        return len(self.token_ids) + self.withheld

    @classmethod
    def of(cls, data: dict) -> "Piece":
        timings = data.get("timings") if isinstance(data.get("timings"), dict) else {}
        ids = data.get("tokens") if isinstance(data.get("tokens"), list) else []
        probs = {p.get("id"): p for p in data.get("completion_probabilities") or [] if isinstance(p, dict)}
        alternatives = []
        for i in ids:
            top = probs.get(i, {}).get("top_logprobs")
            alternatives.append([(int(t["id"]), float(t["logprob"])) for t in top] if top else None)
        return cls([int(i) for i in ids], str(data.get("content") or ""), _int(timings.get("draft_n")),
                   _int(timings.get("draft_n_accepted")), alternatives,
                   str(data.get("stop_type") or "none") if data.get("stop") else None,
                   _int(data.get("tokens_predicted")))


def _withheld(piece: Piece, received: int) -> Piece:
    """`piece` counting the tokens before it whose ids never came: llama-server sends no chunk for a
    token whose text ends inside a UTF-8 character, and the chunk that completes the character names
    only its own token, though its text holds theirs (`tokens_predicted` counts them all)."""
    if piece.predicted is not None and piece.predicted > received + len(piece.token_ids):
        piece.withheld = piece.predicted - received - len(piece.token_ids)
    return piece


def _int(value) -> Optional[int]:
    return value if isinstance(value, int) else None


class PassGrouper:
    """Streamed tokens into the server's verify passes. A chunk whose cumulative draft counts grew
    opens a pass of (accepted drafts + 1) tokens; a chunk whose counts did not is a plain pass of
    its own (nothing was drafted for it)."""

    def __init__(self):
        self.drafted = self.accepted = 0
        self.open: Optional[Step] = None
        self.need = 0

    def add(self, piece: Piece) -> Iterator[Step]:
        if not piece.token_ids and not piece.text and not piece.withheld:  # (the last chunk's may end inside
            return  # a character: its tokens come with no chunk of their own, only the final count)
        drafted = piece.drafted if piece.drafted is not None else self.drafted
        accepted = piece.accepted if piece.accepted is not None else self.accepted
        if drafted != self.drafted or accepted != self.accepted:
            yield from self.flush()
            self.open = Step([], "", drafted=drafted - self.drafted, accepted=accepted - self.accepted)
            self.need = self.open.accepted + 1
            self.drafted, self.accepted = drafted, accepted
        if self.open is None:
            yield Step(list(piece.token_ids), piece.text, token_count=piece.count if piece.withheld else None)
            return
        if piece.withheld or self.open.token_count is not None:  # count what its ids no longer do
            self.open.token_count = self.open.n_tokens + piece.count
        self.open.token_ids.extend(piece.token_ids)
        self.open.text += piece.text
        if self.open.n_tokens >= self.need:
            yield from self.flush()

    def flush(self) -> Iterator[Step]:
        """The open pass as far as it streamed (its last token may be the end-of-sequence one,
        which is never streamed)."""
        if self.open is not None and (self.open.token_ids or self.open.text):
            yield self.open
        self.open = None


@dataclass
class Reply:
    """One reply as it streams: its passes, the alternatives of its tokens, how it ended."""

    stats: StreamStats
    passes: PassGrouper = field(default_factory=PassGrouper)
    alternatives: list = field(default_factory=list)
    reason: str = STOP_MAX_TOKENS
    finished: bool = False
    received: int = 0  # tokens streamed so far, with or without their ids
    withheld: bool = False  # some came without (`_withheld`)

    def add(self, piece: Piece) -> Iterator[Step]:
        self.alternatives.extend(piece.alternatives)
        for step in self.passes.add(piece):
            yield self.stats.add(step)

    def flush(self) -> Iterator[Step]:
        for step in self.passes.flush():
            yield self.stats.add(step)


class LlamaServerBackend(OpenAIBackend):
    name = "llamaserver"

    def __init__(self, binary: Path, settings: LlamaServerSettings, *, log: Path, where: str = "llama-server"):
        self.settings = settings
        if not settings.repack:
            self.caveat = ("llama-server runs with --no-repack: llama.cpp's extra CPU buffers (AMX, repacked "
                           "weights) are off")
        self.spec_label = spec_label(settings.spec)
        args = server_args(settings.model, settings.alias, settings.context, settings.threads, spec=settings.spec,
                           extra=settings.extra, repack=settings.repack, slots=settings.slots)
        self.process = ServerProcess(binary, args, log=log, port=settings.port,
                                     startup_timeout_s=settings.startup_timeout_s, where=where).start()
        try:
            super().__init__(self.process.base_url + "/v1", settings.alias, timeout_s=settings.timeout_s,
                             metrics="llama-server", context=settings.context, where=where)
            self.check_server()
        except BaseException:
            self.process.stop()
            raise

    def __repr__(self) -> str:
        return f"LlamaServerBackend({self.settings.alias!r}, {self.spec_label}, port={self.process.port})"

    def close(self) -> None:
        super().close()
        self.process.stop()

    def server_peak_rss_bytes(self) -> Optional[int]:
        return self.process.peak_rss_bytes()

    def completion_body(self, prompt: Sequence[int], sampling: Sampling) -> dict:
        # Every sampler llama.cpp applies by default set neutral, so only the profile's settings act.
        return {"prompt": list(prompt), "stream": True, "n_predict": sampling.max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "dry_multiplier": 0.0,
                "xtc_probability": 0.0, "seed": sampling.seed, "n_probs": TOP_ALTERNATIVES,
                "return_tokens": True, "timings_per_token": True, "cache_prompt": True}

    def constraint_fields(self, constraint: Constraint) -> dict:
        # /completion takes a schema in its own field (llama-server converts it to GBNF itself);
        # a grammar goes in `grammar` as on the OpenAI endpoint. Its sampler applies either to the
        # target's choice at every position, the speculative passes' verified ones included.
        if constraint.kind == "json_schema":
            return {"json_schema": schema_object(constraint)}
        return super().constraint_fields(constraint)

    def stream(self, request: Request, sampling: Sampling,
               cancel: threading.Event | None = None) -> Iterator[Event]:
        try:
            prompt = self.checked_prompt(request)
        except BackendError:
            self._raise_if_stopped()
            raise
        body = self.completion_body(prompt, sampling)
        if request.constraint is not None:
            body.update(self.constraint_fields(request.constraint))
        return self._native_events(prompt, body, sampling, cancel, request.constraint)

    def _native_events(self, prompt: list[int], body: dict, sampling: Sampling, cancel: Optional[threading.Event],
                       constraint: Optional[Constraint] = None) -> Iterator[Event]:
        before = self._counters()
        reply = Reply(StreamStats(prompt_tokens=len(prompt)))
        if cancel is None or not cancel.is_set():
            try:
                with self._refused_as(constraint):
                    yield from self._stream_reply(body, sampling, cancel, reply)
            except BackendError:
                self._raise_if_stopped()  # a server that died says so, not just that the connection broke
                raise
        if cancel is not None and cancel.is_set():
            reply.reason = STOP_CANCELLED
        elif reply.reason == STOP_MAX_TOKENS and reply.stats.summary.tokens < sampling.max_tokens:
            reply.reason = STOP_CONTEXT_FULL  # the server stops at its context ("limit" too)
        summary = reply.stats.finish(reply.reason)
        summary.alternatives = reply.alternatives[:summary.tokens]
        if reply.withheld:  # ids with gaps would misalign a comparison: compare by text instead
            summary.token_ids, summary.alternatives = [], []
        self._apply_counters(summary, before)
        yield summary

    def _stream_reply(self, body: dict, sampling: Sampling, cancel: Optional[threading.Event],
                      reply: "Reply") -> Iterator[Step]:
        with self.conn.events("/completion", body, cancel, model=self.model, root=True) as payloads:
            held: Optional[Piece] = None  # a token without text: the end-of-sequence one, if the reply ends next
            for data in payloads:
                if "error" in data:
                    error = data["error"]
                    raise BackendError(f"{self.where}: the server stopped the reply: "
                                       f"{error.get('message', error) if isinstance(error, dict) else error}")
                piece = _withheld(Piece.of(data), reply.received)
                reply.received += piece.count
                reply.withheld = reply.withheld or piece.withheld > 0
                if piece.stop_type == "eos":
                    held = None  # other backends leave the end-of-sequence token out of the reply too
                if held is not None:
                    yield from reply.add(held)
                    held = None
                if piece.stop_type is None and piece.token_ids and not piece.text:
                    held = piece
                else:
                    yield from reply.add(piece)
                if piece.stop_type is not None:
                    reply.reason = STOP_TYPES.get(piece.stop_type, STOP_MAX_TOKENS)
                    reply.finished = True
                    break
                if cancel is not None and cancel.is_set():
                    break
        yield from reply.flush()
        if not reply.finished and not (cancel is not None and cancel.is_set()):
            self.conn.reset()
            self._raise_if_stopped()
            raise BackendError(f"{self.where}: the server ended the reply without finishing it "
                               f"(after {reply.stats.summary.tokens} tokens); its log: {self.process.log}")

    def _raise_if_stopped(self) -> None:
        if not self.process.alive(settle_s=1.0):
            raise BackendError(f"{self.where}: its llama-server has stopped (choose the profile again to restart "
                               f"it); its log: {self.process.log}")

    def _counters(self) -> Optional[SpecCounters]:
        if not self.settings.spec:
            return None
        try:
            response = self.conn.request("GET", "/metrics", root=True, ok_404=True)
        except BackendError:
            self._raise_if_stopped()
            raise
        return spec_counters(response.text) if response is not None else None

    def _apply_counters(self, summary, before: Optional[SpecCounters]) -> None:
        """The reply's speculation, as the server counted it (target-only: none to count)."""
        if before is None:
            summary.spec_source = "llama-server (target-only)"
            return
        after = self._counters()
        if after is None:
            summary.spec_reported = False
            return
        got = after.since(before)
        # The grouped passes already counted drafts per position as they streamed; the server's own
        # totals are the authority (they include a last pass cut short by the end-of-sequence token).
        summary.spec_source = "llama-server /metrics"
        summary.drafts, summary.draft_tokens, summary.accepted_tokens = got.drafts, got.draft_tokens, got.accepted
