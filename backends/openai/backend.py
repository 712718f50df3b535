"""The `openai` backend: chat completions streamed from any OpenAI-compatible server (vLLM, SGLang,
llama-server, llama-cpp-python's server, ...) behind the same streaming interface as a local engine.

The server applies the chat template, tokenizes and speculates on its own. One `Step` is one
streamed chunk (a server-side speculative pass may arrive as one chunk of several tokens). Token ids
come from the logprobs where the server writes them (llama-server; vLLM when asked); otherwise tokens
are counted per logprobs entry (or per chunk, when there are no logprobs) and replies are compared
by text.
Speculative figures come from what the server reports (see `backends.openai.metrics`); when it
reports none, the summary says so instead of showing zeros.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Iterator, Optional, Sequence

from ..base import (STOP_CANCELLED, STOP_EOS, STOP_MAX_TOKENS, Backend, BackendError, Event, Request,
                    Sampling, Step, StreamStats)
from .chunks import parse_chunk
from .constraints import LLAMA_CPP_PYTHON, LLAMA_SERVER, OPENAI, SGLANG, VLLM, constraint_fields, refusal
from .http import ServerConnection
from .metrics import (SpecFigures, VllmCounters, llama_server_figures, sglang_figures, vllm_counters,
                      vllm_figures, vllm_request_figures)

METRICS = ("auto", "vllm", "sglang", "llama-server", "none")
# vLLM updates its counters just after it sends a step's tokens: give the last step time to count.
VLLM_SETTLE_S = 0.05
TOP_LOGPROBS = 2
FINISH = {"stop": STOP_EOS, "eos": STOP_EOS, "length": STOP_MAX_TOKENS}


def api_key_from_env(var: Optional[str], where: str) -> Optional[str]:
    if not var:
        return None
    key = os.environ.get(var)
    if not key:
        raise BackendError(f"{where}: server.api_key_env names ${var}, which is not set: "
                           f"export {var}=<your key> (the key itself never goes in a profile)")
    return key


class OpenAIBackend(Backend):
    name = "openai"

    def __init__(self, base_url: str, model: str, *, api_key: Optional[str] = None,
                 api_key_env: Optional[str] = None, timeout_s: float = 60.0, metrics: str = "auto",
                 logprobs: bool = True, stream: bool = True, context: int = 4096, where: Optional[str] = None):
        if metrics not in METRICS:
            raise BackendError(f"server.metrics must be one of {', '.join(METRICS)}, got {metrics!r}")
        self.model = model
        self.metrics = metrics
        self.logprobs = logprobs
        self.streamed = stream  # False: whole replies (SGLang's per-request meta_info comes only then)
        self.where = where or f"server {base_url}"
        self.conn = ServerConnection(base_url, api_key=api_key, api_key_env=api_key_env, timeout_s=timeout_s,
                                     where=self.where)
        self._context = context
        self._prometheus: Optional[bool] = None if metrics in ("auto", "vllm") else False
        self._detokenize_path: Optional[str] = None
        self._server: Optional[tuple[str, Optional[str]]] = None  # (kind, version), once a constraint asked

    def __repr__(self) -> str:
        return f"OpenAIBackend(model={self.model!r}, {self.conn!r})"

    # ---------------------------------------------------------------- the server
    def check_server(self) -> None:
        """Reach the server once at load: a wrong port, key or model name shows up now, as one line."""
        response = self.conn.request("GET", "/models", model=self.model)  # every such server lists its models
        try:
            listed = [m for m in response.json().get("data", []) if isinstance(m, dict)]
        except (ValueError, AttributeError):
            return
        names = [str(m.get("id")) for m in listed]
        if names and self.model not in names:
            raise BackendError(f"{self.where}: the server serves {', '.join(repr(n) for n in names[:5])}, "
                               f"not {self.model!r}: fix `model:`")
        for m in listed:
            if m.get("id") == self.model and isinstance(m.get("max_model_len"), int):
                self._context = m["max_model_len"]  # vLLM says how long its context is

    @property
    def context_length(self) -> int:
        return self._context

    def server_kind(self) -> tuple[str, Optional[str]]:
        """Which server this is (and its version where it says), for the fields a constraint goes
        in: the profile's `server.metrics` when it names one, else asked once of the server itself."""
        if self._server is None:
            named = {"vllm": VLLM, "sglang": SGLANG, "llama-server": LLAMA_SERVER}.get(self.metrics)
            self._server = (named, self._probe("/version", "version")) if named == VLLM else (named, None)
            if named is None:
                self._server = self._identify()
        return self._server

    def _identify(self) -> tuple[str, Optional[str]]:
        if self._probe("/props", "default_generation_settings") is not None:
            return LLAMA_SERVER, None
        if self._probe("/get_server_info", "version") or self._probe("/server_info", "version"):
            return SGLANG, None
        version = self._probe("/version", "version")
        if version is not None:
            return VLLM, version
        title = self._probe("/openapi.json", "info")
        if isinstance(title, dict) and "llama.cpp" in str(title.get("title")):
            return LLAMA_CPP_PYTHON, None
        return OPENAI, None

    def _probe(self, path: str, key: str):
        """`key` of the JSON at `path` on the server's root; None where there is no such answer."""
        try:
            response = self.conn.request("GET", path, root=True, ok_404=True)
            data = response.json() if response is not None else None
        except (BackendError, ValueError):
            return None
        return data.get(key) if isinstance(data, dict) else None

    def constraint_fields(self, constraint) -> dict:
        kind, version = self.server_kind()
        return constraint_fields(constraint, kind, version=version, where=self.where)

    def tokenize_chat(self, messages: Sequence[dict]) -> list[int]:
        """The server's own rendering of the chat, where it offers one (llama-server's
        /apply-template + /tokenize, vLLM's /tokenize with messages); refused otherwise rather
        than guessed."""
        rendered = self.conn.post_json("/apply-template", {"messages": list(messages)}, root=True, ok_404=True)
        if rendered is not None and isinstance(rendered.get("prompt"), str):
            out = self.conn.post_json("/tokenize", {"content": rendered["prompt"], "add_special": False}, root=True)
            if out and isinstance(out.get("tokens"), list):
                return [t if isinstance(t, int) else t["id"] for t in out["tokens"]]
        out = self.conn.post_json("/tokenize", {"model": self.model, "messages": list(messages),
                                                "add_generation_prompt": True}, root=True, ok_404=True)
        if out is not None and isinstance(out.get("tokens"), list) and "count" in out:
            return list(out["tokens"])
        raise BackendError(f"{self.where}: the server has no endpoint that tokenizes a chat (vLLM's /tokenize, "
                           "llama-server's /apply-template), so its prompt token count is unknown here")

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, by the server's detokenize endpoint; ids the server can't spell are
        shown as ⟨id⟩ labels (display only: comparison never goes through this)."""
        ids = list(token_ids)
        if not ids:
            return ""
        paths = [self._detokenize_path] if self._detokenize_path else ["/detokenize", "/extras/detokenize"]
        for path in paths:
            try:
                out = self.conn.post_json(path, {"model": self.model, "tokens": ids}, root=True, ok_404=True)
            except BackendError:
                continue
            if out is None:
                continue
            for key in ("prompt", "content", "text"):
                if isinstance(out.get(key), str):
                    self._detokenize_path = path
                    return out[key]
        return "".join(f"⟨{i}⟩" for i in ids)

    def close(self) -> None:
        self.conn.close()

    # ---------------------------------------------------------------- streaming
    def request_body(self, messages: Sequence[dict], sampling: Sampling) -> dict:
        body = {
            "model": self.model, "messages": list(messages), "stream": self.streamed,
            "max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "seed": sampling.seed,
            # Neutral values for knobs some servers default otherwise (llama-cpp-python: min_p 0.05,
            # repeat_penalty 1.1), so a reply matches a local engine with the same settings.
            "min_p": 0.0, "repeat_penalty": 1.0, "repetition_penalty": 1.0,
        }
        if self.streamed:
            body["stream_options"] = {"include_usage": True}
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k
        if self.logprobs:
            # Token ids: llama-server puts them in the logprobs; vLLM does when asked (other servers
            # ignore fields they don't know). llama-server sends no logprobs at all for top_logprobs 0
            # (and 20 alternatives when it is left out); the top two say how close a choice was.
            body.update(logprobs=True, top_logprobs=TOP_LOGPROBS, return_tokens_as_token_ids=True, return_token_ids=True)
        if self.metrics in ("auto", "sglang"):
            body["return_meta_info"] = True
        return body

    def stream(self, request: Request, sampling: Sampling,
               cancel: threading.Event | None = None) -> Iterator[Event]:
        if request.messages is None:
            raise BackendError(f"{self.where}: a remote server takes chat messages, not prompt token ids")
        if not any(str(m.get("content") or "").strip() for m in request.messages):
            raise BackendError("the prompt is empty; send some text")
        body = self.request_body(request.messages, sampling)
        if request.constraint is not None:
            body.update(self.constraint_fields(request.constraint))
        return self._events(body, cancel, request.constraint)

    def _events(self, body: dict, cancel: Optional[threading.Event], constraint=None) -> Iterator[Event]:
        before = self._vllm_counters()
        stats = StreamStats()
        reason, every_id, finished = STOP_MAX_TOKENS, True, False
        usage = timings = meta_info = spec_decoding = None
        counted = 0  # tokens that came with a count from logprobs or ids
        if cancel is not None and cancel.is_set():
            reason = STOP_CANCELLED
        else:
            with self._refused_as(constraint), self._replies(body, cancel) as payloads:
                for data in payloads:
                    chunk = parse_chunk(data)
                    if chunk.error:
                        raise BackendError(f"{self.where}: the server stopped the reply: {chunk.error}")
                    usage = chunk.usage or usage
                    timings = chunk.timings or timings
                    meta_info = chunk.meta_info or meta_info
                    spec_decoding = chunk.spec_decoding or spec_decoding
                    if chunk.finish_reason:
                        finished = True
                        reason = FINISH.get(chunk.finish_reason, STOP_MAX_TOKENS)
                    if chunk.token_ids is None and (chunk.text or chunk.token_count):
                        every_id = False
                    n = chunk.token_count if chunk.token_count is not None else (1 if chunk.text else 0)
                    counted += chunk.token_count or 0
                    if n or chunk.text:
                        yield stats.add(Step(chunk.token_ids or [], chunk.text,
                                             token_count=None if chunk.token_ids is not None else n))
                    if cancel is not None and cancel.is_set():
                        break
                cancelled = cancel is not None and cancel.is_set()
                if not (cancelled or finished or getattr(payloads, "done", True)):
                    self.conn.reset()
                    raise BackendError(
                        f"{self.where}: the server ended the reply without finishing it (after {stats.summary.tokens} "
                        "tokens): its log says why (a prompt longer than its context, for one)")
            if cancel is not None and cancel.is_set():
                reason = STOP_CANCELLED
        summary = stats.finish(reason)
        if not every_id:
            summary.token_ids = []  # partial ids would misalign a comparison: compare by text instead
        if usage:
            summary.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            completion = usage.get("completion_tokens")
            if completion is not None and (not counted or int(completion) > summary.tokens):
                # better than one per chunk; and more than the chunks named where a server sent no chunk
                # for some tokens (llama-server: one whose text ends inside a UTF-8 character)
                if counted:
                    summary.token_ids = []  # ids with gaps: compare by text
                summary.tokens = int(completion)
        figures = self._figures(before, timings, meta_info, spec_decoding)
        if figures is not None:
            figures.apply(summary)
        else:
            summary.spec_reported = False
        yield summary

    @contextlib.contextmanager
    def _refused_as(self, constraint):
        """A constrained request the server answers 400 or 422 is its refusal of the constraint: said so."""
        try:
            yield
        except BackendError as e:
            if constraint is None or getattr(e, "status", None) not in (400, 422):
                raise
            raise refusal(constraint, self.where, self.server_kind()[0], getattr(e, "said", str(e))) from None

    @contextlib.contextmanager
    def _replies(self, body: dict, cancel: Optional[threading.Event]) -> Iterator[Iterator[dict]]:
        """The server's answer as a sequence of chunks: the streamed events, or the one whole reply."""
        if self.streamed:
            with self.conn.events("/chat/completions", body, cancel, model=self.model) as payloads:
                yield payloads
        else:
            yield iter([self.conn.post_json("/chat/completions", body, model=self.model)])

    # ------------------------------------------------------------------ metrics
    def _vllm_counters(self) -> Optional[VllmCounters]:
        if self._prometheus is False:
            return None
        try:
            response = self.conn.request("GET", "/metrics", root=True, ok_404=True)
        except BackendError:
            return None  # no figures is better than no reply; ask again next time
        counters = vllm_counters(response.text, self.model) if response is not None else None
        if counters is None and self.metrics == "auto":
            self._prometheus = False  # no vLLM speculative counters here: stop asking
        return counters

    def _figures(self, before: Optional[VllmCounters], timings, meta_info, spec_decoding) -> Optional[SpecFigures]:
        if self.metrics in ("auto", "vllm") and spec_decoding:
            figures = vllm_request_figures(spec_decoding)
            if figures is not None:
                self._prometheus = False  # the reply says it all: no need to read /metrics around the next ones
                return figures
        if self.metrics in ("auto", "llama-server") and timings:
            figures = llama_server_figures(timings)
            if figures is not None:
                return figures
        if self.metrics in ("auto", "sglang") and meta_info:
            figures = sglang_figures(meta_info)
            if figures is not None:
                return figures
        if before is not None:
            time.sleep(VLLM_SETTLE_S)
            after = self._vllm_counters()
            if after is not None:
                return vllm_figures(before, after)
        return None
