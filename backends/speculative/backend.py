"""The torch engine with a drafter: a Backend whose stream is the speculative loop."""
from __future__ import annotations

import threading
from typing import Iterator, Sequence

from backends.base import Backend, BackendError, Event, Request, Sampling
from backends.native.engine import TorchBackend
from backends.native.weights import Int4Rows, int4_linear
from backends.speculative.drafters import DraftModelDrafter, LookupFirst, NgramDrafter, check_same_tokenizer
from backends.speculative.gate import DraftGate
from backends.speculative.loop import Drafter, speculative_stream


class SpeculativeBackend(Backend):
    name = "torch"

    def __init__(self, target: TorchBackend, drafter: Drafter, depth: int, acceptance: str = "exact",
                 strict: bool | None = False, adaptive: bool = False):
        if strict is None:  # auto
            strict = target.rows_bitwise
        if strict and not target.rows_bitwise:
            if target.model.compiled_rows and not target.model.rows_share_attention:
                raise BackendError("strict verification with compile: true needs an attention kernel that keeps a "
                                   "row's bits in shared calls, which this CPU's does not; set compile: false "
                                   "(strict, eager) or strict: false")
            raise BackendError(f"strict verification needs row-invariant kernels (int4 or bfloat16 on CPU), "
                               f"but the target runs {target.precision} on {target.device.type}; "
                               "set dtype: bfloat16 (or auto for a Q4 GGUF) or strict: false")
        self.target, self.drafter = target, drafter
        self.depth, self.acceptance, self.strict = depth, acceptance, strict
        self.adaptive = adaptive  # draft only from sources whose passes pay (gate.py)

    @classmethod
    def from_profile(cls, profile) -> "SpeculativeBackend":
        spec = profile.speculative
        if spec.method == "mtp" and not spec.drafter:
            check_builtin_mtp(profile)
        target = TorchBackend.from_profile(profile)
        try:
            drafter = make_drafter(profile, target)
        except BaseException:
            target.close()
            raise
        try:
            return cls(target, drafter, spec.depth, spec.acceptance, spec.strict, spec.adaptive)
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
                                  self.strict, DraftGate() if self.adaptive else None)

    def close(self) -> None:
        self.drafter.close()
        self.target.close()


def make_drafter(profile, target: TorchBackend) -> Drafter:
    spec = profile.speculative
    model = make_model_drafter(profile, target)
    if spec.lookup:
        return LookupFirst(model, spec.lookup, spec.ngram_min, spec.ngram_max, spec.depth, spec.copy_depth)
    return model


def make_model_drafter(profile, target: TorchBackend) -> Drafter:
    spec = profile.speculative
    if spec.method == "ngram":
        return NgramDrafter(spec.ngram_min, spec.ngram_max, spec.copy_depth)
    if spec.method == "draft":
        from specchat.models import fetch_hub, resolve_model

        ref = resolve_model(spec.drafter, profile.base_dir)
        path = fetch_hub(ref.location) if ref.kind == "hub" else ref.location
        engine = TorchBackend(path, "hf_dir" if ref.kind == "hub" else ref.kind, precision=profile.dtype,
                              device=profile.device, threads=profile.threads, context=target.context_length,
                              compile=profile.compile)
        try:
            check_same_tokenizer(target, engine, spec.drafter)
        except BackendError:
            engine.close()
            raise
        head = engine.model.head.weight
        if target.model.runs_int4 and head is not None and Int4Rows.fits(head):
            engine.model.set_head(int4_linear(head))  # its full-vocabulary head is most of a small drafter's cost
        return DraftModelDrafter(engine, want_q=spec.acceptance == "rejection")
    if spec.method == "mtp":
        return make_mtp_drafter(profile, target)
    if spec.method == "dflash":
        return make_dflash_drafter(profile, target)
    raise BackendError(f"profile '{profile.name}': speculative method '{spec.method}' is not available yet "
                       "in this version; use none, ngram, draft, mtp or dflash")


def make_mtp_drafter(profile, target: TorchBackend) -> Drafter:
    """The MTP head in `drafter:` (a head directory), or in the target's own checkpoint."""
    from backends.native.mtp import MtpHead, read_mtp
    from backends.speculative.mtp import MtpDrafter
    from specchat.models import fetch_hub, resolve_model

    spec = profile.speculative
    ref = resolve_model(spec.drafter or profile.model, profile.base_dir)
    path = fetch_hub(ref.location) if ref.kind == "hub" else ref.location
    weights = read_mtp(path, target.model.cfg)
    head = MtpHead(weights, target.model, target.context_length)
    source = spec.mtp_hidden or weights.hidden_source or "post_norm"
    return MtpDrafter(head, target.eos_ids, source, want_q=spec.acceptance == "rejection")


def check_builtin_mtp(profile) -> None:
    """Before loading a big target for its built-in MTP head: read and validate the head, and say
    plainly if the main model is one the engine cannot run."""
    import json
    from pathlib import Path

    from backends.native.model import ModelConfig
    from backends.native.mtp import read_mtp, unsupported_main_model
    from specchat.models import fetch_hub, resolve_model

    ref = resolve_model(profile.model, profile.base_dir)
    if ref.kind == "gguf":
        raise BackendError(f"profile '{profile.name}': the target is a GGUF file, whose MTP (nextn) tensors the "
                           "torch engine does not read; set `speculative.drafter` to an MTP head directory "
                           "(e.g. made by `specchat train mtp`)")
    path = fetch_hub(ref.location) if ref.kind == "hub" else Path(ref.location)
    config = json.loads((path / "config.json").read_text())
    why = unsupported_main_model(config)
    weights = read_mtp(path, ModelConfig.from_hf(config))
    if why:
        raise BackendError(f"{path}: MTP head read and valid ({weights.layout.models} layout, "
                           f"{len(weights.layers)} layer(s)), but {why}; serve it with vLLM or SGLang "
                           "(backend: openai)")


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
    target.warm_up(hidden=True)  # its taps need the compiled graphs that return layer outputs
    return DFlashDrafter(model, target, want_q=spec.acceptance == "rejection")
