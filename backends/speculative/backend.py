"""The torch engine with a drafter: a Backend whose stream is the speculative loop."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

from ..base import Backend, BackendError, Event, Request, Sampling
from ..native.engine import TorchBackend
from ..native.int4 import Int4Rows, int4_linear
from .drafters import DraftModelDrafter, LookupFirst, NgramDrafter, SuffixDrafter, SuffixFirst, check_same_tokenizer
from .gate import DraftGate
from .loop import Drafter, speculative_stream
from .suffix import SuffixIndex, SuffixSettings


METHODS = ("ngram", "suffix", "draft", "mtp", "dflash", "dspark", "replayssm", "eagle3")


@dataclass(frozen=True)
class SpeculativeSettings:
    """How to speculate on a loaded target: the method and its drafter's weights (paths resolved
    by the caller), the draft depth and how drafts are accepted (see the profile reference)."""

    method: str  # one of METHODS
    drafter: Path | None = None  # draft model (GGUF file or directory), MTP / EAGLE-3 head or DFlash directory
    drafter_kind: str = "auto"  # gguf | hf_dir | auto (by the path), for a draft model
    depth: int = 4
    acceptance: str = "exact"  # exact | rejection (acceptance.py)
    ngram_min: int = 1
    ngram_max: int = 3
    lookup: int = 0  # prompt lookup in front of a model drafter: up to this many tokens (0: off)
    copy_depth: int = 0  # prompt lookup in a copying run (ngram.py)
    strict: bool | None = None  # row-exact verify passes: required (True), off (False), where possible (None)
    adaptive: bool = True  # draft from a source only while it pays (gate.py)
    mtp_hidden: str | None = None  # which target state feeds an MTP head (None: the head's config, else post_norm)
    suffix_first: int = 0  # suffix decoding in front of a model drafter: up to this many tokens (0: off)
    suffix: SuffixSettings = SuffixSettings()  # for method suffix or suffix_first


class SpeculativeBackend(Backend):
    name = "torch"

    @classmethod
    def load(cls, target: TorchBackend, settings: SpeculativeSettings) -> "SpeculativeBackend":
        """`target` with the drafter `settings` describe; the target is closed if that fails."""
        try:
            drafter = make_drafter(settings, target)
        except BaseException:
            target.close()
            raise
        try:
            return cls(target, drafter, settings.depth, settings.acceptance, settings.strict, settings.adaptive)
        except BackendError:
            drafter.close()
            target.close()
            raise

    def __init__(self, target: TorchBackend, drafter: Drafter, depth: int, acceptance: str = "exact",
                 strict: bool | None = False, adaptive: bool = False):
        if strict is None:  # auto
            strict = target.row_exact_supported
        if strict and not target.row_exact_supported:
            if target.compile_planned and not target.model.attention_calls_shared:
                raise BackendError("strict verification with compile: true needs an attention kernel that keeps a "
                                   "row's bits in shared calls, which this CPU's does not; set compile: false "
                                   "(strict, eager) or strict: false")
            if target.device.type == "cpu" and target.precision in ("bfloat16", "int4"):
                raise BackendError(f"strict verification needs row-invariant kernels, but this CPU's "
                                   f"{target.precision} matmul gives a row other bits beside other rows (no native "
                                   "bfloat16?); set strict: false (or auto)")
            raise BackendError(f"strict verification needs row-invariant kernels (int4 or bfloat16 on CPU), "
                               f"but the target runs {target.precision} on {target.device.type}; "
                               "set dtype: bfloat16 (or auto for a Q4 GGUF) or strict: false")
        self.target, self.drafter = target, drafter
        self.depth, self.acceptance, self.strict = depth, acceptance, strict
        self.adaptive = adaptive  # draft only from sources whose passes pay (gate.py)
        # one gate for every reply of this backend: what it learned of a source's passes carries into the
        # next reply, which otherwise paid its eight drafted warm-up passes again (a chat's replies are
        # short; the chat-prompt runs in docs/results.md, 2026-12-08)
        self.gate: DraftGate | None = None

    @property
    def context_length(self) -> int:
        return self.target.context_length

    @property
    def memory(self) -> SuffixIndex | None:
        """The suffix drafter's memory of earlier replies, which the caller fills and keeps
        (`SuffixIndex.add` / `remove`, between replies); None without one."""
        return getattr(self.drafter, "memory", None)

    def tokenize_chat(self, messages: Sequence[dict]) -> list[int]:
        return self.target.tokenize_chat(messages)

    def tokenize_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Plain texts in the target's tokens (no chat template), in one batch: how earlier replies
        enter the memory."""
        return self.target.tokenizer.encode_many(texts)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.target.detokenize(token_ids)

    def stream(self, request: Request, sampling: Sampling,
               cancel: threading.Event | None = None) -> Iterator[Event]:
        prompt = self.checked_prompt(request)
        if self.adaptive and self.gate is None:
            self.gate = DraftGate()
        return speculative_stream(self.target, self.drafter, prompt, sampling, self.depth, self.acceptance, cancel,
                                  self.strict, self.gate if self.adaptive else None, request.constraint)

    def prepare_in_background(self) -> None:
        self.target.prepare_in_background()

    def background_status(self) -> Optional[str]:
        return self.target.background_status()

    def switch_if_ready(self) -> Optional[str]:
        """The target's switch (between replies); the next reply's prefill starts from position 0, and
        with it every drafter's state (speculative_stream). Passes of the other kind take other times:
        the gate measures them afresh."""
        switched = self.target.switch_if_ready()
        if switched is not None:
            self.gate = None
        return switched

    def close(self) -> None:
        self.drafter.close()
        self.target.close()


def make_drafter(settings: SpeculativeSettings, target: TorchBackend) -> Drafter:
    """The drafter `settings` describe, for `target` (prompt lookup in front of it with `lookup`,
    suffix decoding with `suffix_first`)."""
    model = make_model_drafter(settings, target)
    if settings.suffix_first:
        return SuffixFirst(model, make_suffix_drafter(settings.suffix), settings.suffix_first, settings.depth)
    if settings.lookup:
        return LookupFirst(model, settings.lookup, settings.ngram_min, settings.ngram_max, settings.depth,
                           settings.copy_depth)
    return model


def make_model_drafter(s: SpeculativeSettings, target: TorchBackend) -> Drafter:
    if s.method == "ngram":
        return NgramDrafter(s.ngram_min, s.ngram_max, s.copy_depth)
    if s.method == "suffix":
        return make_suffix_drafter(s.suffix)
    if s.method in ("draft", "replayssm"):
        return make_draft_model_drafter(s, target)
    if s.method == "mtp":
        return make_mtp_drafter(s, target)
    if s.method in ("dflash", "dspark"):
        return make_dflash_drafter(s, target)
    if s.method == "eagle3":
        return make_eagle3_drafter(s, target)
    raise BackendError(f"speculative method '{s.method}' is not available in this version; "
                       f"use one of {', '.join(METHODS)}")


def make_suffix_drafter(s: SuffixSettings) -> SuffixDrafter:
    """Suffix decoding, with an empty memory of earlier replies unless `s.memory` is off."""
    memory = (SuffixIndex(max_match=s.max_match, max_sequences=s.memory_replies, max_tokens=s.memory_tokens)
              if s.memory else None)
    return SuffixDrafter(s, memory)


def make_draft_model_drafter(s: SpeculativeSettings, target: TorchBackend) -> Drafter:
    """A small model with the target's tokenizer, loaded with the target's own engine settings;
    for `replayssm`, a recurrent one (every layer Gated DeltaNet), its state rolled back by replay."""
    changes = {"context": target.context_length}
    if s.method == "replayssm":
        changes |= {"rollback": "replay", "compile": False}  # its one-token steps are eager (no graphs yet)
    engine = TorchBackend(s.drafter, s.drafter_kind, **(target.settings | changes))
    try:
        check_same_tokenizer(target, engine, str(s.drafter))
        cfg = engine.model.cfg
        attention = sum(not cfg.is_linear(i) for i in range(cfg.n_layers))
        if s.method == "replayssm" and attention:
            raise BackendError(f"{s.drafter}: method replayssm drafts with a recurrent model (every layer "
                               f"linear_attention), but this one has {attention} attention layer(s) of "
                               f"{cfg.n_layers}; use method: draft for it, or train one with `specchat train replayssm`")
    except BackendError:
        engine.close()
        raise
    head = engine.model.head.weight
    if target.model.runs_int4 and head is not None and Int4Rows.fits(head):
        engine.model.set_head(int4_linear(head))  # its full-vocabulary head is most of a small drafter's cost
    drafter = DraftModelDrafter(engine, want_q=s.acceptance == "rejection")
    drafter.name = s.method
    return drafter


def make_mtp_drafter(s: SpeculativeSettings, target: TorchBackend) -> Drafter:
    """The MTP head in `s.drafter`: a head directory, or the target's own checkpoint or GGUF."""
    from ..native.gguf_mtp import read_any_mtp
    from ..native.mtp import MtpHead
    from .mtp import MtpDrafter

    weights = read_any_mtp(s.drafter, target.model.cfg, target.settings.get("cache_dir"))
    head = MtpHead(weights, target.model, target.context_length)
    source = s.mtp_hidden or weights.hidden_source or "post_norm"
    return MtpDrafter(head, target.eos_ids, source, want_q=s.acceptance == "rejection")


def make_eagle3_drafter(s: SpeculativeSettings, target: TorchBackend) -> Drafter:
    """The EAGLE-3 head in `s.drafter` (any of the public formats: native/eagle3.py)."""
    from ..native.eagle3 import Eagle3Head, read_eagle3
    from .eagle3 import Eagle3Drafter

    head = Eagle3Head(read_eagle3(s.drafter, target.model.cfg), target.model, target.context_length)
    target.warm_up(hidden=True)  # its taps need the compiled graphs that return layer outputs
    return Eagle3Drafter(head, target.eos_ids, want_q=s.acceptance == "rejection")


def check_builtin_mtp(path: Path, cache_dir: Path | None = None) -> None:
    """Before loading a big target for its built-in MTP head: that the GGUF at `path` carries MTP
    (nextn) layers, or read and validate the head in the checkpoint directory `path`, and say
    plainly if the main model is one the engine cannot run."""
    import json

    from ..native.config import ModelConfig
    from ..native.gguf_mtp import no_mtp_reason
    from ..native.gguf_support import native_refusal
    from ..native.mtp import read_mtp, unsupported_main_model

    path = Path(path)
    if path.is_file():
        why = native_refusal(path, cache_dir)
        if why:
            raise BackendError(f"{path}: {why}, so it cannot draft from its MTP layers here; run it with backend: "
                               "llamaserver and method: mtp (llama.cpp's draft-mtp)")
        why = no_mtp_reason(path, cache_dir)
        if why:
            raise BackendError(why)
        return
    config = json.loads((path / "config.json").read_text())
    why = unsupported_main_model(config)
    weights = read_mtp(path, ModelConfig.from_hf(config))
    if why:
        raise BackendError(f"{path}: MTP head read and valid ({weights.layout.models} layout, "
                           f"{len(weights.layers)} layer(s)), but {why}; serve it with vLLM or SGLang "
                           "(backend: openai)")


def make_dflash_drafter(s: SpeculativeSettings, target: TorchBackend) -> Drafter:
    """A DFlash drafter, or (method dspark) DFlash's block drafter with DSpark's Markov head."""
    from .dflash import DFlashDrafter, load_dflash
    from .dspark import DSparkDrafter, load_dspark

    what = "DSpark" if s.method == "dspark" else "DFlash"
    path = Path(s.drafter)
    if path.is_file():
        raise BackendError(f"drafter {path} is a file; a {what} drafter is a directory with config.json and "
                           "safetensors")
    want_q = s.acceptance == "rejection"
    if s.method == "dspark":
        drafter = DSparkDrafter(load_dspark(path, target.model.cfg), target, want_q)
    else:
        drafter = DFlashDrafter(load_dflash(path, target.model.cfg), target, want_q)
    if s.depth > drafter.max_depth:
        drafter.close()
        raise BackendError(f"depth {s.depth} is more than this {what} drafter proposes per pass "
                           f"(block_size {drafter.block_size}); set speculative.depth <= {drafter.max_depth}")
    target.warm_up(hidden=True)  # its taps need the compiled graphs that return layer outputs
    return drafter
