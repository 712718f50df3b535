"""llama.cpp's grammar applied as llama-server applies it: after the choice, not before.

llama-cpp-python puts the grammar first in its sampler chain, so every token costs a grammar check
of the whole vocabulary (49k pieces for SmolLM2, about as long as the model's own pass on a small
model). llama-server (common/sampling.cpp) lets the chain choose first and checks only that one
token; only when the grammar rejects it is the choice made again over the tokens the grammar
allows. Greedy, that is the same token (the best allowed one is the best one whenever it is
allowed); sampled, the same distribution (a rejected draw is drawn again from the allowed tokens,
renormalised), with llama-server's use of the random stream.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
from typing import Iterator

import numpy as np


class GrammarAfterChoice:
    """One reply's grammar state over a `llama_cpp.Llama` whose own sampler chain has no grammar."""

    def __init__(self, llm, vocab, text: str):
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llm
        self.grammar = llama_cpp.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
        if not self.grammar:  # checked before (gbnf.check_gbnf); a null sampler must never be used
            raise ValueError("llama.cpp could not parse the grammar")
        self.n_vocab = llm.n_vocab()
        self.one = (llama_cpp.llama_token_data * 1)()
        self.all = (llama_cpp.llama_token_data * self.n_vocab)()
        self.table = np.ctypeslib.as_array(self.all)  # the same memory, as fields id / logit / p
        self.rechosen = 0  # tokens the grammar rejected and the chain chose again

    def allows(self, token: int) -> bool:
        self.one[0].id, self.one[0].logit, self.one[0].p = token, 0.0, 0.0
        candidates = self.lib.llama_token_data_array(data=self.one, size=1, selected=-1, sorted=False)
        self.lib.llama_sampler_apply(self.grammar, ctypes.byref(candidates))
        return self.one[0].logit != -math.inf

    def sample(self, idx: int) -> int:
        """The token at the model's output row `idx` (negative: from the end), as llama-server picks it."""
        llm, lib = self.llm, self.lib
        token = llm._sampler.sample(llm._ctx, idx)  # the chain's own choice (greedy, or top-k/p and a draw)
        if not self.allows(token):
            logits = lib.llama_get_logits_ith(llm._ctx.ctx, idx)
            self.table["id"] = np.arange(self.n_vocab, dtype=np.int32)
            self.table["logit"] = np.ctypeslib.as_array(logits, shape=(self.n_vocab,))
            self.table["p"] = 0.0
            candidates = lib.llama_token_data_array(data=self.all, size=self.n_vocab, selected=-1, sorted=False)
            lib.llama_sampler_apply(self.grammar, ctypes.byref(candidates))
            lib.llama_sampler_apply(llm._sampler.sampler, ctypes.byref(candidates))
            token = int(self.all[candidates.selected].id)
            self.rechosen += 1
        lib.llama_sampler_accept(self.grammar, token)
        return token

    def close(self) -> None:
        if self.grammar:
            self.lib.llama_sampler_free(self.grammar)
            self.grammar = None


def constrained_tokens(llm, tokens: Iterator[int], grammar: GrammarAfterChoice) -> Iterator[int]:
    """`llm.generate`'s tokens (started without a grammar) with every choice made through `grammar`:
    `generate` asks `llm.sample(..., idx=...)` for each token, which this points at the grammar for
    as long as the reply streams."""
    def sample(*args, idx=None, **kwargs):
        return grammar.sample(idx - llm.n_tokens if idx is not None else -1)

    llm.sample = sample  # an instance attribute over the class's method, removed below
    try:
        yield from tokens
    finally:
        with contextlib.suppress(AttributeError):
            del llm.sample
        close = getattr(tokens, "close", None)
        if close is not None:
            close()
        grammar.close()
