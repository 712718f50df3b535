"""The torch engine with a drafter: a Backend whose stream is the speculative loop."""
from __future__ import annotations

import threading
from typing import Iterator, Sequence

from backends.base import Backend, BackendError, Event, Request, Sampling
from backends.native.engine import TorchBackend
from backends.speculative.drafters import DraftModelDrafter, NgramDrafter, check_same_tokenizer
from backends.speculative.loop import Drafter, speculative_stream


class SpeculativeBackend(Backend):
    name = "torch"

    def __init__(self, target: TorchBackend, drafter: Drafter, depth: int, acceptance: str = "exact",
                 strict: bool | None = False):
        if strict is None:  # auto
            strict = target.rows_bitwise
        if strict and not target.rows_bitwise:
            raise BackendError(f"strict verification needs row-invariant kernels (int4 or bfloat16 on CPU), "
                               f"but the target runs {target.precision} on {target.device.type}; "
                               "set dtype: bfloat16 (or auto for a Q4 GGUF) or strict: false")
        self.target, self.drafter = target, drafter
        self.depth, self.acceptance, self.strict = depth, acceptance, strict

    @classmethod
    def from_profile(cls, profile) -> "SpeculativeBackend":
        spec = profile.speculative
        target = TorchBackend.from_profile(profile)
        try:
            drafter = make_drafter(profile, target)
        except BaseException:
            target.close()
            raise
        try:
            return cls(target, drafter, spec.depth, spec.acceptance, spec.strict)
        except BackendError:
            drafter.close()
            target.close()
            raise

    @property
    def context_length(self) -> int:
        return self.target.context_length

    def tokenize_chat(self, messages: Sequence[dict]) -> list[int]:
        return self.target.tokenize_chat(messages)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.target.detokenize(token_ids)

    def stream(self, request: Request, sampling: Sampling,
               cancel: threading.Event | None = None) -> Iterator[Event]:
        prompt = self.checked_prompt(request)
        return speculative_stream(self.target, self.drafter, prompt, sampling, self.depth, self.acceptance, cancel,
                                  self.strict)

    def close(self) -> None:
        self.drafter.close()
        self.target.close()


def make_drafter(profile, target: TorchBackend) -> Drafter:
    spec = profile.speculative
    if spec.method == "ngram":
        return NgramDrafter(spec.ngram_min, spec.ngram_max)
    if spec.method == "draft":
        from specchat.models import fetch_hub, resolve_model

        ref = resolve_model(spec.drafter, profile.base_dir)
        path = fetch_hub(ref.location) if ref.kind == "hub" else ref.location
        engine = TorchBackend(path, "hf_dir" if ref.kind == "hub" else ref.kind, precision=profile.dtype,
                              device=profile.device, threads=profile.threads, context=target.context_length)
        try:
            check_same_tokenizer(target, engine, spec.drafter)
        except BackendError:
            engine.close()
            raise
        return DraftModelDrafter(engine, want_q=spec.acceptance == "rejection")
    if spec.method == "dflash":
        return make_dflash_drafter(profile, target)
    raise BackendError(f"profile '{profile.name}': speculative method '{spec.method}' is not available yet "
                       "in this version; use none, ngram, draft or dflash")


def make_dflash_drafter(profile, target: TorchBackend) -> Drafter:
    from backends.speculative.dflash import DFlashDrafter, load_dflash
    from specchat.models import fetch_hub, resolve_model

    spec = profile.speculative
    ref = resolve_model(spec.drafter, profile.base_dir)
    if ref.kind == "gguf":
        raise BackendError(f"profile '{profile.name}': drafter {ref.location} is a GGUF file; a DFlash drafter "
                           "is a directory with config.json and safetensors")
    model = load_dflash(fetch_hub(ref.location) if ref.kind == "hub" else ref.location, target.model.cfg)
    most = model.cfg.block_size - 1
    if spec.depth > most:
        raise BackendError(f"profile '{profile.name}': depth {spec.depth} is more than this DFlash drafter "
                           f"proposes per pass (block_size {model.cfg.block_size}); set speculative.depth <= {most}")
    return DFlashDrafter(model, target, want_q=spec.acceptance == "rejection")
