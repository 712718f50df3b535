"""llama.cpp (llama-cpp-python) backend: GGUF files, target-only, behind the streaming interface."""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Iterator, Sequence

from backends.base import (STOP_CANCELLED, STOP_CONTEXT_FULL, STOP_EOS, STOP_MAX_TOKENS, Backend, BackendError,
                           Event, Request, Sampling, Step, StreamStats)
from backends.detok import IncrementalDetokenizer


def default_threads() -> int:
    """Physical cores where we can tell (hyperthreads slow decoding down), else all CPUs."""
    try:
        import psutil  # optional

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1


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

    def __init__(self, gguf_path: str | Path, context: int = 2048, threads: int = 0, seed: int = 0):
        try:
            from llama_cpp import Llama, llama_chat_format
        except ImportError:
            raise BackendError("llama-cpp-python is not installed: `pip install llama-cpp-python`") from None
        path = Path(gguf_path)
        if not path.is_file():
            raise BackendError(f"{path}: no such GGUF file; fix `model:` in the profile")
        self.threads = threads or default_threads()
        try:
            with _quiet_stderr():
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
        self.path = path

    @classmethod
    def from_profile(cls, profile) -> "LlamaCppBackend":
        from specchat.models import resolve_model

        ref = resolve_model(profile.model, profile.base_dir)
        if ref.kind != "gguf":
            raise BackendError(f"profile '{profile.name}': backend llamacpp needs a GGUF file, "
                               f"but model '{profile.model}' is a {ref.kind}; use backend: torch")
        return cls(ref.location, context=profile.context, threads=profile.threads, seed=profile.sampling.seed)

    @property
    def context_length(self) -> int:
        return self.llm.n_ctx()

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
        prompt = self.prompt_ids(request)
        self.check_fits(len(prompt))
        stats = StreamStats(prompt_tokens=len(prompt))
        detok = IncrementalDetokenizer(self.detokenize)
        self.llm.set_seed(sampling.seed)
        temp = sampling.temperature
        gen = self.llm.generate(prompt, temp=temp, top_k=sampling.top_k if temp > 0 else 1,
                                top_p=sampling.top_p, min_p=0.0, repeat_penalty=1.0)
        reason = STOP_MAX_TOKENS
        produced = 0
        try:
            for token in gen:
                if cancel is not None and cancel.is_set():
                    reason = STOP_CANCELLED
                    break
                if self._is_eog(token):
                    reason = STOP_EOS
                    break
                produced += 1
                yield stats.add(Step([token], detok.add([token])))
                if produced >= sampling.max_tokens:
                    reason = STOP_MAX_TOKENS
                    break
                if len(prompt) + produced >= self.context_length:
                    reason = STOP_CONTEXT_FULL
                    break
                if cancel is not None and cancel.is_set():
                    reason = STOP_CANCELLED
                    break
        finally:
            gen.close()
        yield stats.finish(reason, detok.flush())

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.close()
            self.llm = None
