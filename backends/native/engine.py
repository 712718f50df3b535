"""`TorchBackend`: the native engine behind the streaming interface, target-only decoding.

Besides `stream`, it exposes what a speculative loop needs: `forward` (K tokens at absolute
positions, optional hidden states), `cache_len` / `truncate` (rollback without copies),
`sample` (position-keyed, so verification picks what target-only decoding would), `eos_ids`.
The engine tracks which token ids are in the KV cache, so a new turn only prefills what
differs from the previous one.
"""
from __future__ import annotations

import threading
import time
import weakref
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from ..base import Backend, BackendError, Event, Request, Sampling
from ..cpu import thread_count
from . import sampling as sampler
from .background_graphs import BackgroundGraphs, compile_unavailable, is_compiler_error, threads_beside
from .exact_rows import model_matmuls_keep_row_bits
from .graph_store import GraphStore, Variant
from .built_models import load_checkpoint, load_or_build  # noqa: F401 - load_checkpoint: the trainers' entry
from .tokenizer import ChatTokenizer
from .recurrent_state import ROLLBACK_MODES

# A hybrid model's rollback when a profile says auto, per device type: the one that measures
# cheaper there (scripts/bench_recurrent.py; docs/results.md, "recurrent-state rollback"). CUDA is
# not measured yet; it runs the same torch ops, where replay redoes the kept rows' recurrence too.
# Replay is the one to choose when memory is tight (a verify block keeps a fraction of snapshot's).
DEFAULT_ROLLBACK = {"cpu": "snapshot", "cuda": "snapshot"}

# What the torch engine computes with: a torch dtype for everything, or "int4": layer matrices on the 4-bit or
# GGUF-type kernels (memory_plan.py), CPU only, with bfloat16 activations (F16 / BF16 files: kquant.activation_dtype).
PRECISIONS = ("float32", "bfloat16", "float16", "int4")
# Precisions whose CPU matmul kernels are row-invariant, so that a row-exact pass over K tokens
# equals K single-token passes bit for bit (exact_rows.py).
ROW_INVARIANT_PRECISIONS = ("bfloat16", "int4")


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, model_path: str | Path, kind: str = "auto", *, precision: str = "auto",
                 device: str = "auto", threads: int = 0, context: int = 2048, compile: bool = False,
                 cache_dir: Path | None = None, rollback: str = "auto", compile_in_background: bool = False):
        """`kind`: gguf, hf_dir or auto (by the path); `precision`: one of PRECISIONS or auto;
        `threads`: 0 for every physical core; `context`: the KV cache's positions (at most the
        model's own limit); `compile`: torch.compile the decode passes; `cache_dir`: where files
        derived from a GGUF (its tokenizer, its tensor index) are kept between loads; `rollback`: how a
        hybrid model's recurrent state returns to an earlier position (snapshot, replay, or auto:
        DEFAULT_ROLLBACK for the device); `compile_in_background`: where compiled graphs are not
        stored yet, answer on eager passes and prepare them in a background process, to be
        switched to between replies (`switch_if_ready`; background_graphs.py)."""
        path = self.model_path = Path(model_path)
        # what a drafter model loaded beside this target is loaded with (speculative/backend.py)
        self.settings = dict(precision=precision, device=device, threads=threads, context=context,
                             compile=compile, cache_dir=cache_dir, rollback=rollback)
        if rollback not in ROLLBACK_MODES + ("auto",):
            raise BackendError(f"unknown rollback '{rollback}' (expected auto, {', '.join(ROLLBACK_MODES)})")
        if kind == "auto":
            kind = "gguf" if path.suffix.lower() == ".gguf" else "hf_dir"
        self.kind = kind
        if precision not in PRECISIONS + ("auto",):
            raise BackendError(f"unknown precision '{precision}' (expected auto, {', '.join(PRECISIONS)})")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise BackendError("device 'cuda' requested but this torch has no CUDA device; set device: cpu")
        self.device = torch.device(device)
        self.threads = thread_count(threads)
        torch.set_num_threads(threads_beside(self.threads))
        started = time.perf_counter()
        self.rollback = DEFAULT_ROLLBACK[self.device.type] if rollback == "auto" else rollback
        refusals: list[str] = []  # why compile: true cannot be had, found before the build (minutes for a MoE)

        def check(cfg, chosen: str) -> None:
            if compile and (why := self._no_graphs(path.name, cfg, chosen, rollback)):
                if not compile_in_background:
                    raise BackendError(why)
                refusals.append(why)

        # kept by an earlier start (built_models.py), else built; `keeping` stores it for the next one
        self.model, self.precision, self.keeping = load_or_build(path, kind, precision, self.device, context,
                                                                 self.rollback, cache_dir, check)
        self._context, cfg = self.model.max_len, self.model.cfg
        no_graphs = refusals[0] if refusals else None
        compile = compile and not no_graphs  # a chat answers on eager passes and says why, as without a compiler
        # a hybrid's layer layout (L: linear attention, A: attention), which shapes its graphs' inputs
        ck_layout = "".join("LA"[not cfg.is_linear(i)] for i in range(cfg.n_layers)) if cfg.hybrid else ""
        self.tokenizer = ChatTokenizer(path, cache_dir)
        self.eos_ids: frozenset[int] = self.tokenizer.eos_ids
        self.cached: list[int] = []  # token ids whose keys/values are in the cache, in order
        # cached positions computed by multi-row passes that were not row-exact: see prefill_with_hidden
        self.pass_spans: list[tuple[int, int]] = []
        # held by every pass: a reference run on these weights (shared_weights.py) takes turns with it
        self.turn = threading.RLock()
        # CPU compiled row graphs: now, or (compile_in_background) once a background process stored them
        self.compile_planned = self.device.type == "cpu" and compile and self.precision in ROW_INVARIANT_PRECISIONS
        self.graph_store = None if cache_dir is None or not self.compile_planned else GraphStore(
            cache_dir, path, dict(precision=self.precision, context=self._context, rollback=self.rollback,
                                  attention=self.model.attention_mode, kernel=self.model.kernel,
                                  **({"layers": ck_layout} if ck_layout else {})))
        self.in_background = compile_in_background and self.graph_store is not None
        self.wanted: list[Variant] = []  # the graphs asked for so far (warm_up)
        self.background_planned = False  # graphs to prepare in the background (prepare_in_background)
        self.background: Optional[BackgroundGraphs] = None  # the process preparing them, if any
        self.background_failure: Optional[str] = no_graphs  # why there are no compiled graphs (said once)
        self.failure_said = False
        self.sharers = weakref.WeakSet()  # references on these weights (shared_weights.py)
        if self.compile_planned:
            if not self.in_background:
                self.model.use_compiled_rows(self.graph_store)
            self.warm_up()
        elif (self.device.type == "cuda" or compile) and not self.model.cfg.hybrid:
            self.model.use_static_shapes(compile=compile)
        self.load_s = time.perf_counter() - started  # with the first start's compilation, if any

    def _no_graphs(self, name: str, cfg, precision: str, rollback: str) -> Optional[str]:
        """Why compiled decode graphs cannot be had for this model, or None."""
        if cfg.moe:
            return (f"{name} is a mixture-of-experts model, whose compiled decode graphs specchat does not build "
                    "yet; set compile: false")
        if cfg.sliding_window:
            return (f"{name} has sliding-window attention layers, for which specchat does not build compiled "
                    "decode graphs yet; set compile: false")
        if cfg.hybrid and (rollback == "replay" or self.device.type != "cpu"  # graph_state.py
                           or precision not in ROW_INVARIANT_PRECISIONS):
            return (f"{name} is a hybrid (linear-attention) model, whose compiled decode graphs run on CPU in "
                    "bfloat16 or int4 and roll back with snapshots; set dtype: bfloat16 and rollback: snapshot "
                    "(or auto), or compile: false")
        return None

    def graph_variants(self, hidden: bool = False) -> list[Variant]:
        """The compiled graphs decoding needs: the one-row graph and, where verify blocks can be
        compiled, the K-row graph; with every layer's output too when `hidden` (DFlash's and
        EAGLE-3's taps)."""
        from .exact_rows import key_span

        variants = [Variant(True, hidden)]
        # row-exact verify blocks, where they can be compiled (a hybrid's run on the one-row graph: graph_state.py)
        if (self.row_exact_supported and not self.model.cfg.hybrid
                and key_span(7, self.model.max_len) == key_span(9, self.model.max_len)):
            variants.append(Variant(False, hidden))
        return variants

    def warm_up(self, hidden: bool = False) -> None:
        """Make the compiled graphs (`graph_variants`) ready now, not in the middle of the first
        reply: loaded from the graph store or compiled and saved there (graph_store.py). With
        `compile_in_background`, graphs not stored yet are left to a background process and the
        engine decodes eagerly until `switch_if_ready`; the process starts at
        `prepare_in_background`. Leaves the cache empty."""
        if not self.compile_planned:
            return
        self.wanted += [v for v in self.graph_variants(hidden) if v not in self.wanted]
        if self.in_background and not all(self.graph_store.path(v).exists() for v in self.wanted):
            if self.model.compiled is not None:  # loaded before a drafter asked for more: eager until all are
                self.model.compiled = None
                self.truncate(0)
            self.background_planned = True
            if self.background is not None:  # already preparing: the rest too
                self.prepare_in_background()
            return
        if self.model.compiled is None:
            self.model.use_compiled_rows(self.graph_store)
        self._prepare_graphs(self.wanted)

    def prepare_in_background(self) -> None:
        """Start the background process `warm_up` planned, if it did and none prepares all the wanted
        graphs yet. From here until the switch, passes leave it a core. Called by the app once it
        has answered what it was started for or waits for its user (a `run` after its reply, a chat
        at load), so that the process never slows a reply the command's start was waiting on."""
        if not self.background_planned or (self.background is not None
                                           and set(self.wanted) <= set(self.background.variants)):
            return
        self.background_failure = compile_unavailable(self.graph_store)
        if self.background_failure is None:
            with self.turn:
                self.background = BackgroundGraphs(self.graph_store, self.wanted, self.background_settings())
                torch.set_num_threads(threads_beside(self.threads))
                self._restart_caches()  # eager bits depend on the thread count

    def _restart_caches(self) -> None:
        """Every cache on these weights (this engine's and its references') starts again: the
        passes that filled them ran on other arithmetic than the next ones will."""
        for reference in list(self.sharers):
            reference.truncate(0)
        self.truncate(0)

    def background_settings(self) -> dict:
        """This engine's arguments, for the process that prepares its graphs."""
        s = self.settings
        return dict(model_path=str(self.model_path), kind=self.kind, precision=s["precision"], device="cpu",
                    threads=s["threads"], context=s["context"], cache_dir=str(s["cache_dir"]),
                    rollback=s["rollback"])

    def _prepare_graphs(self, variants: list[Variant]) -> None:
        from .weights import progress

        label = "preparing decode graphs (minutes on a first start, then seconds)"
        try:
            with progress(label, len(variants)) as advance:
                for variant in variants:
                    self.model.compiled.prepare(variant)
                    advance(1)
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            fix = ("torch.compile on CPU needs a C++ compiler (g++); install one or set compile: false"
                   if is_compiler_error(e) else "set compile: false to decode without compiled graphs")
            raise BackendError(f"compile: true failed ({type(e).__name__}: {first}); {fix}") from None
        finally:
            self.truncate(0)

    def background_status(self) -> Optional[str]:
        """A short line on graphs being prepared in the background (None: nothing is)."""
        progress = self.background.progress() if self.background is not None else None
        if self.background_failure or (progress and progress.failed):
            return "eager passes (compiled graphs unavailable)"
        if progress is None:
            return None
        if progress.ready:
            return "compiled graphs ready: used from the next reply"
        return f"eager passes; compiling decode graphs in the background ({progress.done}/{progress.total})"

    def switch_if_ready(self) -> Optional[str]:
        """Between replies: move to the compiled graphs if the background process has stored them
        all. They compute other bits than the eager passes, so every cache computed on these
        weights (this engine's and its references') starts again, and the next reply recomputes
        the conversation once. Returns a line saying what changed, or None."""
        if self.background is None:
            if self.background_failure and not self.failure_said:
                return self._stay_eager(self.background_failure)
            return None
        progress = self.background.progress()
        if not progress.ready and not progress.failed:
            return None
        with self.turn:
            # every thread back, and every cache on these weights started again: the passes so far
            # ran on fewer threads, and from here on they run on other arithmetic (or may)
            self.background, self.background_planned = None, False
            torch.set_num_threads(threads_beside(self.threads))
            self._restart_caches()
            if progress.failed:
                return self._stay_eager(progress.failed)
            started = time.perf_counter()
            self.model.use_compiled_rows(self.graph_store)
            try:
                self._prepare_graphs(self.wanted)
            except BackendError as e:
                self.model.compiled = None
                return self._stay_eager(str(e))
        return f"switched to compiled decode graphs (loaded in {time.perf_counter() - started:.1f} s)"

    def _stay_eager(self, why: str) -> str:
        """Keep why there are no compiled graphs (background_status shows it) and say it, once."""
        self.background_failure, self.failure_said = why, True
        return f"compiled decode graphs unavailable, staying on eager passes: {why}"

    # ---- the pieces a speculative loop uses ----

    @property
    def context_length(self) -> int:
        return self._context

    @property
    def row_exact_supported(self) -> bool:
        """Whether forward(..., row_exact=True) gives single-token passes' bits here (exact_rows.py's terms)."""
        m = self.model
        return (self.device.type == "cpu" and self.precision in ROW_INVARIANT_PRECISIONS and not m.static
                and (m.attention_calls_shared or not self.compile_planned or m.cfg.hybrid)
                and model_matmuls_keep_row_bits(m))

    @property
    def cache_len(self) -> int:
        return self.model.cache.length

    def forward(self, tokens: Sequence[int] | Tensor, start_pos: int, hidden_layers: tuple[int, ...] = (),
                all_logits: bool = True, row_exact: bool = False, head: bool = True
                ) -> tuple[Tensor, dict[int, Tensor]]:
        """Run tokens at absolute positions start_pos.. (cache beyond start_pos is dropped first).

        logits[i] is the distribution of the token at position start_pos + i + 1. hidden_layers:
        layer indices (output of decoder layer i) and/or FINAL (-1, after the final norm).
        row_exact: a row-exact pass (exact_rows.py), bitwise equal to single-token passes where
        `row_exact_supported`. head=False: final hidden states instead of logits (see
        `head_logits` and `choose`).
        """
        with self.turn:
            if start_pos < self.cache_len:
                self.truncate(start_pos)
            ids = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
            t = torch.tensor([ids], dtype=torch.long, device=self.device)
            logits, hidden = self.model(t, start_pos, hidden_layers, all_logits, row_exact, head)
            self.cached[start_pos:] = ids
            if len(ids) > 1 and not (row_exact and self.row_exact_supported):
                self.pass_spans.append((start_pos, start_pos + len(ids)))
            return logits, hidden

    def head_logits(self, states: Tensor) -> Tensor:
        """Logits for rows of final hidden states from forward(..., head=False)."""
        return self.model.logits(states)

    def choose(self, states: Tensor, positions: Sequence[int], sampling: Sampling,
               allowed: Optional[Tensor] = None) -> Tensor:
        """The tokens `sample(head_logits(states), positions, sampling)` picks, computed more cheaply
        where the model can (greedy and plain temperature sampling on CPU; see argmax_head.py).
        `allowed`: bool [rows, vocab], a constraint's mask (every other token's logit -inf)."""
        return self.model.choose(states, positions, sampling, allowed)

    def verify_chunk(self, sampling: Sampling) -> int | None:
        """How many verify rows `choose` should take per call (None: all); see Transformer.verify_chunk."""
        return self.model.verify_chunk(sampling)

    def truncate(self, n: int) -> None:
        """Forget positions n.. (n <= cache_len; on a hybrid, a position `restart_point` allows)."""
        with self.turn:
            self.model.cache.truncate(n)
            del self.cached[n:]
            spans = self.pass_spans  # in order and apart (a pass truncates to its start first)
            while spans and spans[-1][0] >= n:
                spans.pop()
            spans[-1:] = [(lo, min(hi, n)) for lo, hi in spans[-1:]]

    def hold_positions(self, n: int) -> None:
        """A caller that rolls back over several of its own passes (a draft model's proposals) asks
        for up to n positions of them to stay returnable to (hybrid models; free for the others)."""
        with self.turn:
            self.model.hold_positions(max(n, self.model.rollback_span))

    def restart_point(self, n: int) -> int:
        """The longest prefix of at most n cached positions a pass can start after: n, except on a
        hybrid model, whose recurrent state returns to its last pass's positions, its turn
        checkpoints (where recent prefills started and ended) or 0 (recurrent_state.py)."""
        with self.turn:
            return self.model.cache.restart_point(min(n, self.cache_len))

    @property
    def shares_weights(self) -> bool:
        """Whether this backend runs on another engine's weights (shared_weights.py)."""
        return False

    def sample(self, logits: Tensor, positions: Sequence[int] | Tensor, sampling: Sampling) -> Tensor:
        return sampler.sample(logits, positions, sampling)

    def probs(self, logits: Tensor, sampling: Sampling) -> Tensor:
        """The distribution `sample` draws from (for rejection sampling)."""
        return sampler.probs(logits, sampling)

    def prefill(self, prompt: Sequence[int], head: bool = True) -> Tensor:
        """Bring the cache to `prompt`, reusing the longest common prefix with what is cached.
        Returns the logits [1, vocab] for the token after the prompt (head=False: the final
        hidden state [1, dim] instead, for `choose`)."""
        return self.prefill_with_hidden(prompt, head=head)[0]

    def prefill_with_hidden(self, prompt: Sequence[int], hidden_layers: tuple[int, ...] = (),
                            head: bool = True, reuse_at_most: int | None = None
                            ) -> tuple[Tensor, dict[int, Tensor], int]:
        """prefill, also returning the hidden states of the positions it computed and where they
        start: (logits [1, vocab], {layer: [len(prompt) - start, dim]}, start). Positions before
        `start` were reused from the cache (at most `reuse_at_most` of them).

        A prompt the cache holds whole (sent again: regenerate, the same question twice) runs again the
        pass of several rows (`pass_spans`) its last token was computed in, from that pass's start:
        its rows' bits depend on the pass, and otherwise the last token would run alone, choosing the
        first token from a single-token pass where the first send chose from the prefill's last row:
        other arithmetic, and at a near-tie another reply."""
        self.check_fits(len(prompt))
        start = 0
        limit = min(len(prompt) - 1, len(self.cached))  # at least one token is run to get logits
        if reuse_at_most is not None:
            limit = min(limit, reuse_at_most)
        while start < limit and self.cached[start] == prompt[start]:
            start += 1
        last = len(prompt) - 1
        if start == last and len(self.cached) > last and self.cached[last] == prompt[last]:
            start = next((lo for lo, hi in reversed(self.pass_spans) if lo <= last < hi), start)
        start = self.restart_point(start)
        logits, hidden = self.forward(prompt[start:], start, hidden_layers, all_logits=False, head=head)
        return logits, hidden, start

    # ---- the Backend interface ----

    def tokenize_chat(self, messages) -> list[int]:
        return self.tokenizer.encode_chat(messages)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def stream(self, request: Request, sampling: Sampling,
               cancel: threading.Event | None = None) -> Iterator[Event]:
        from ..constrained import target_only_stream

        return target_only_stream(self, self.checked_prompt(request), sampling, cancel, request.constraint)

    def close(self) -> None:
        self.model = None
        self.cached = []
