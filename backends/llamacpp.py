"""llama.cpp (llama-cpp-python) backend: GGUF files, target-only, behind the streaming interface."""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from pathlib import Path
from typing import Iterator, Sequence

from .base import Backend, BackendError, Constraint, Event, Request, Sampling, decode_stream
from .cpu import thread_count
from .gbnf import check_gbnf, gbnf_of
from .llamacpp_grammar import GrammarAfterChoice, constrained_tokens


_PROBE = r"""
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
llm.eval(llm.tokenize(b"probe the batch path", add_bos=False))
"""


def extra_buffers_work(gguf_path: Path, cache_dir: Path | None = None) -> bool:
    """Whether llama.cpp's extra CPU buffer types (AMX, repacked weights) survive a batched eval.

    Built by pip with GCC, the binding's AMX kernel loads a tile configuration whose stores the
    compiler dropped (llamaserver/build.py fixes its own build) and segfaults on any multi-token
    batch on a CPU with AMX. We probe once per llama.cpp version in a child process and remember
    the answer (in `cache_dir` across processes, when given); without them llama.cpp stays
    correct, just without those kernels."""
    import importlib.metadata

    if cache_dir is None:
        return _probe(str(gguf_path)) is not False
    # The installed version, read without importing llama_cpp (which takes seconds).
    marker = Path(cache_dir) / f"llamacpp-{importlib.metadata.version('llama-cpp-python')}-extra-buffers"
    ok_file, broken_file = Path(f"{marker}.ok"), Path(f"{marker}.broken")
    if ok_file.exists() or broken_file.exists():
        return ok_file.exists()
    ok = _probe(str(gguf_path))
    if ok is None:  # a file llama.cpp refuses: its load says why; nothing remembered of the CPU
        return True
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    (ok_file if ok else broken_file).touch()
    return ok


@functools.cache
def _probe(gguf_path: str) -> bool | None:
    """True: the batch ran; False: the child died by a signal (the fault); None: it exited with an
    error, llama.cpp refusing the file itself, which says nothing of this CPU."""
    import subprocess
    import sys

    code = subprocess.run([sys.executable, "-c", _PROBE, gguf_path], capture_output=True, timeout=300).returncode
    return True if code == 0 else False if code < 0 else None


def load_refusal(gguf_path: Path | str) -> str | None:
    """None when llama.cpp reads this GGUF's architecture, hyperparameters and vocabulary (a
    vocab-only load: milliseconds, no weights), else its own reason ("unknown model architecture:
    'foo'"). Asked before a file goes to llama.cpp, so that one it cannot load is one line up front
    (and never reaches `extra_buffers_work`'s probe)."""
    import ctypes

    try:
        import llama_cpp
        from llama_cpp import _logger
    except ImportError:
        return "llama-cpp-python is not installed (`pip install llama-cpp-python`)"
    said: list[str] = []

    @llama_cpp.llama_log_callback
    def keep(level, text, user_data):  # llama.cpp's log, kept rather than printed
        said.append(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))
    try:
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), params)
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    if model:
        llama_cpp.llama_model_free(model)
        return None
    why = [line.rpartition("error loading model:")[2].strip() for line in "".join(said).splitlines()
           if "error loading model:" in line]
    return why[0] if why else "llama.cpp could not load it"


@contextlib.contextmanager
def without_extra_buffers():
    """llama-cpp-python has no argument for `use_extra_bufts`; switch the default off while loading."""
    import llama_cpp.llama as module

    original = module.llama_cpp.llama_model_default_params

    def params():
        p = original()
        p.use_extra_bufts = False
        return p

    module.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        module.llama_cpp.llama_model_default_params = original


@contextlib.contextmanager
def _quiet_stderr():
    """llama.cpp prints its load log straight to fd 2; keep the terminal clean."""
    fd = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


class LlamaCppBackend(Backend):
    name = "llamacpp"

    def __init__(self, gguf_path: str | Path, context: int = 2048, threads: int = 0, seed: int = 0,
                 cache_dir: Path | None = None):
        try:
            from llama_cpp import Llama, llama_chat_format
        except ImportError:
            raise BackendError("llama-cpp-python is not installed: `pip install llama-cpp-python`") from None
        path = Path(gguf_path)
        if not path.is_file():
            raise BackendError(f"{path}: no such GGUF file; fix `model:` in the profile")
        from .native.gguf_loader import read_index

        # checked first: the probe below would take a broken file's failure for a CPU path that
        # faults and remember that, and llama.cpp would only say it failed to load
        read_index(path, cache_dir)
        self.threads = thread_count(threads)
        safe = extra_buffers_work(path, cache_dir)
        if not safe:
            self.caveat = ("llama.cpp's extra CPU buffers (AMX, repacked weights) are off: llama-cpp-python's "
                           "build faults with them on this CPU; llama-server, built here, runs them")
        try:
            with _quiet_stderr(), (contextlib.nullcontext() if safe else without_extra_buffers()):
                self.llm = Llama(model_path=str(path), n_ctx=context, n_threads=self.threads,
                                 n_threads_batch=self.threads, seed=seed, verbose=False)
        except ValueError as e:
            raise BackendError(f"{path}: llama.cpp could not load it ({e}); is it a valid GGUF?") from None
        meta = self.llm.metadata
        template = meta.get("tokenizer.chat_template")
        if not template:
            raise BackendError(f"{path}: the GGUF has no chat template (tokenizer.chat_template); "
                               "use a chat/instruct model")
        model = self.llm._model
        eos, bos = self.llm.token_eos(), self.llm.token_bos()
        self._formatter = llama_chat_format.Jinja2ChatFormatter(
            template=template,
            eos_token=model.token_get_text(eos) if eos != -1 else "",
            bos_token=model.token_get_text(bos) if bos != -1 else "",
        )
        self._vocab = model.vocab
        self._checked_grammars: set[str] = set()
        self.path = path

    @property
    def context_length(self) -> int:
        # llama.cpp pads n_ctx up (to 256) but llama-cpp-python sizes its token buffer by the request.
        return min(self.llm.n_ctx(), len(self.llm.input_ids))

    def tokenize_chat(self, messages: Sequence[dict]) -> list[int]:
        prompt = self._formatter(messages=list(messages)).prompt
        # The template writes any BOS itself (added_special), as llama-cpp-python's chat path assumes.
        return self.llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.llm.detokenize(list(token_ids)).decode("utf-8", errors="replace")

    def _is_eog(self, token: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def stream(self, request: Request, sampling: Sampling,
               cancel: threading.Event | None = None) -> Iterator[Event]:
        prompt = self.checked_prompt(request)
        reused = self._reusable(prompt)
        self.llm.set_seed(sampling.seed)
        temp = sampling.temperature
        grammar = self._grammar(request.constraint) if request.constraint is not None else None
        tokens = self.llm.generate(prompt, temp=temp, top_k=sampling.top_k if temp > 0 else 1,
                                   top_p=sampling.top_p, min_p=0.0, repeat_penalty=1.0)
        if grammar is not None:
            # every token of the reply chosen under a fresh grammar state (llamacpp_grammar.py); this
            # backend runs target-only: it has no draft or prompt-lookup path that could skip it
            tokens = constrained_tokens(self.llm, tokens, grammar)
        return decode_stream(tokens, prompt_tokens=len(prompt), sampling=sampling,
                             context_length=self.context_length, is_eos=self._is_eog, detokenize=self.detokenize,
                             cancel=cancel, prefill_start=lambda: reused)

    def _grammar(self, constraint: Constraint) -> GrammarAfterChoice:
        """The constraint as llama.cpp's grammar, checked against this model's vocabulary first: an
        invalid one would otherwise reach the sampler as a null sampler."""
        text = gbnf_of(constraint)
        if text not in self._checked_grammars:
            check_gbnf(text, constraint, self._vocab)
            self._checked_grammars.add(text)
        return GrammarAfterChoice(self.llm, self._vocab, text)

    def _reusable(self, prompt: Sequence[int]) -> int:
        """How many prompt tokens `Llama.generate` keeps from its cache: the longest common prefix
        with what it evaluated before, less one when that covers the whole prompt (it re-runs the
        last token for fresh logits), as llama-cpp-python's generate decides."""
        held = self.llm.input_ids[:self.llm.n_tokens].tolist()
        common = len(os.path.commonprefix([held, list(prompt)]))
        return common - 1 if common == len(prompt) else common

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.close()
            self.llm = None
