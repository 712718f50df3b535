"""Drafters: who guesses. Each only proposes tokens; the loop in `loop.py` decides what is kept."""
from __future__ import annotations

from typing import Sequence

import torch

from ..base import BackendError, Sampling
from ..native.sampling import probs
from .loop import Draft, Drafter, common_prefix
from .ngram import NgramIndex
from .suffix import SuffixIndex, SuffixSettings


class NgramDrafter(Drafter):
    """Prompt lookup over the conversation so far; no weights. Proposes up to the profile's depth,
    or up to `copy_depth` in a copying run (see ngram.py)."""

    name = "ngram"

    def __init__(self, n_min: int = 1, n_max: int = 3, copy_depth: int = 0):
        self.index = NgramIndex(n_min, n_max, copy_depth)
        self.depth: int | None = None  # the profile's, from plan_depth

    def plan_depth(self, depth: int) -> int:
        self.depth = depth
        return max(depth, self.index.copy_depth)

    def propose(self, tokens: Sequence[int], depth: int) -> Draft:
        return Draft(self.index.propose(tokens, min(depth, self.depth or depth), depth))


class ModelBehind(Drafter):
    """A drafter in front of a model drafter (`model`), which guesses only when the front one has
    nothing: what the two kinds share. The model drafter still sees every commit, so it stays in
    step on the passes it sits out."""

    model: Drafter
    model_depth: int

    def model_draft(self, tokens: Sequence[int], depth: int) -> Draft:
        if self.model.name in self.paused:
            return Draft([])
        draft = self.model.propose(tokens, min(depth, self.model_depth))
        draft.source = draft.source or self.model.name
        return draft

    def reusable(self, prompt_ids) -> int:
        return self.model.reusable(prompt_ids)

    def commit(self, tokens, hidden) -> None:
        self.model.commit(tokens, hidden)

    def close(self) -> None:
        self.model.close()


class LookupFirst(ModelBehind):
    """Prompt lookup first, a model drafter otherwise: when the last `n_max`..`n_min` tokens
    appeared earlier in the conversation, propose up to `lookup_depth` tokens that followed them
    (copying runs are long and usually right; in one, up to `copy_depth`, see ngram.py); else ask
    `model` for up to `model_depth` guesses (the profile's depth, from plan_depth).
    Lookup drafts carry no distribution: under `rejection` acceptance those passes use `exact`."""

    def __init__(self, model: Drafter, lookup_depth: int, n_min: int = 2, n_max: int = 3, model_depth: int = 1,
                 copy_depth: int = 0):
        self.model, self.index = model, NgramIndex(n_min, n_max, copy_depth)
        self.lookup_depth, self.model_depth = lookup_depth, model_depth
        self.name = f"{model.name}+lookup"
        self.hidden_layers = model.hidden_layers
        self.max_depth = model.max_depth  # what `depth` may ask of the model drafter

    def plan_depth(self, depth: int) -> int:
        self.model_depth = depth
        return max(depth, self.lookup_depth, self.index.copy_depth)

    def start(self, prompt_ids, hidden, sampling: Sampling, reused: int = 0) -> None:
        self.index.reset()
        self.model.start(prompt_ids, hidden, sampling, reused)

    @property
    def sources(self) -> tuple[str, ...]:
        return ("lookup", self.model.name)

    def propose(self, tokens: Sequence[int], depth: int) -> Draft:
        if "lookup" not in self.paused:
            found = self.index.propose(tokens, min(depth, self.lookup_depth), depth)
            if found:
                return Draft(found, source="lookup")
        return self.model_draft(tokens, depth)


class SuffixDrafter(Drafter):
    """Suffix decoding (suffix.py): drafts from the conversation so far (source `suffix`) and from
    `memory`, an index of earlier replies that the caller fills and keeps (source `history`);
    of the two drafts the one with the higher expected acceptance goes (a tie: the conversation's).
    How far it drafts follows the counts, up to the loop's depth."""

    name = "suffix"

    def __init__(self, settings: SuffixSettings = SuffixSettings(), memory: SuffixIndex | None = None):
        self.settings, self.memory = settings, memory
        self.local = SuffixIndex(max_match=settings.max_match)

    @property
    def sources(self) -> tuple[str, ...]:
        return ("suffix", "history") if self.memory is not None else ("suffix",)

    def start(self, prompt_ids, hidden, sampling: Sampling, reused: int = 0) -> None:
        self.local.reset()

    def find(self, tokens: Sequence[int], depth: int) -> Draft:
        """The better draft of the two pools the gate has not paused, or none. Its drafts carry no
        distribution: under `rejection` acceptance their passes use `exact`, as prompt lookup's do."""
        best, source = None, ""
        if "suffix" not in self.paused:
            self.local.sync(tokens)
            best, source = self.local.find(tokens, depth, self.settings, loop=True), "suffix"
        if self.memory is not None and "history" not in self.paused and self.memory.sequences:
            other = self.memory.find(tokens, depth, self.settings)
            if best is None or other.score > best.score:
                best, source = other, "history"
        return Draft(best.tokens, source=source) if best is not None and best.tokens else Draft([])

    def propose(self, tokens: Sequence[int], depth: int) -> Draft:
        return self.find(tokens, depth)


class SuffixFirst(ModelBehind):
    """Suffix decoding first, a model drafter otherwise (as LookupFirst, with suffix decoding's
    drafts of up to `suffix_depth` tokens in place of prompt lookup's): the model guesses only
    when neither the conversation nor the memory has a confident continuation."""

    def __init__(self, model: Drafter, suffix: SuffixDrafter, suffix_depth: int, model_depth: int = 1):
        self.model, self.suffix = model, suffix
        self.suffix_depth, self.model_depth = suffix_depth, model_depth
        self.name = f"{model.name}+suffix"
        self.hidden_layers = model.hidden_layers
        self.max_depth = model.max_depth

    @property
    def memory(self) -> SuffixIndex | None:
        return self.suffix.memory

    def plan_depth(self, depth: int) -> int:
        self.model_depth = depth
        return max(depth, self.suffix_depth)

    def start(self, prompt_ids, hidden, sampling: Sampling, reused: int = 0) -> None:
        self.suffix.start(prompt_ids, hidden, sampling, reused)
        self.model.start(prompt_ids, hidden, sampling, reused)

    @property
    def sources(self) -> tuple[str, ...]:
        return (*self.suffix.sources, self.model.name)

    def propose(self, tokens: Sequence[int], depth: int) -> Draft:
        self.suffix.paused = self.paused
        found = self.suffix.find(tokens, min(depth, self.suffix_depth))
        if found.tokens:
            return found
        return self.model_draft(tokens, depth)


class DraftModelDrafter(Drafter):
    """A separate small model with the target's tokenizer, decoding ahead autoregressively.

    It samples with the same position-keyed noise as the target, so at temperature > 0 its
    guesses agree with the target's own choices as often as the two distributions allow.
    Its KV cache follows the committed sequence: before drafting, it is cut back to the longest
    prefix it shares with the committed tokens and the rest is fed in one pass."""

    name = "draft"

    def __init__(self, engine, want_q: bool = False):
        self.engine = engine  # a TorchBackend of the small model
        self.want_q = want_q
        self.sampling = Sampling()

    def start(self, prompt_ids, hidden, sampling: Sampling, reused: int = 0) -> None:
        self.sampling = sampling

    def propose(self, tokens: Sequence[int], depth: int) -> Draft:
        e, n = self.engine, len(tokens)
        if n + depth > e.context_length:
            depth = max(0, e.context_length - n)
        if depth == 0:
            return Draft([])
        # a hybrid draft model's state must return into this proposal's passes at the next one
        e.hold_positions(2 * depth + 2)
        reuse = e.restart_point(min(common_prefix(e.cached, tokens), n - 1))
        state, _ = e.forward(tokens[reuse:], reuse, all_logits=False, head=False)
        out, qs = [], []
        for i in range(depth):
            token = self._pick(state, n + i, qs)
            out.append(token)
            if i + 1 == depth or token in e.eos_ids:
                break
            state, _ = e.forward([token], n + i, all_logits=False, head=False)
        return Draft(out, torch.stack(qs) if qs else None)

    def _pick(self, state: torch.Tensor, position: int, qs: list) -> int:
        """The guess for `position` from the small model's final state (adding its distribution to
        `qs` when rejection sampling needs it)."""
        if not self.want_q:
            return int(self.engine.choose(state, [position], self.sampling)[0])
        logits = self.engine.head_logits(state)
        qs.append(probs(logits, self.sampling)[0])
        return int(self.engine.sample(logits, [position], self.sampling)[0])

    def close(self) -> None:
        self.engine.close()


def check_same_tokenizer(target, drafter, drafter_name: str) -> None:
    """Refuse a drafter whose vocabulary or special tokens differ from the target's."""
    t, d = target.tokenizer, drafter.tokenizer
    tv, dv = t.vocab(), d.vocab()
    if tv != dv:
        diff = len(set(tv.items()) ^ set(dv.items()))
        raise BackendError(f"drafter '{drafter_name}' does not match the target: vocabularies differ "
                           f"({len(dv)} vs {len(tv)} tokens, {diff} entries differ); a draft model must use "
                           "the target's tokenizer")
    if target.eos_ids != drafter.eos_ids or not t.same_special_tokens(d):
        raise BackendError(f"drafter '{drafter_name}' does not match the target: special tokens differ "
                           f"(eos {sorted(drafter.eos_ids)} vs {sorted(target.eos_ids)})")
    if drafter.model.cfg.vocab_size < len(tv):
        raise BackendError(f"drafter '{drafter_name}' has {drafter.model.cfg.vocab_size} output rows "
                           f"but the tokenizer has {len(tv)} tokens")
