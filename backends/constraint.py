"""Constraints (JSON schema, regular expression, grammar) compiled by llguidance, for engines that
choose tokens themselves.

llguidance (not xgrammar) does the grammar work: its masks cost ~13 us a token for SmolLM2's 49,152
tokens on this project's CPU (xgrammar's ~3 us; both far below a decode pass's milliseconds,
scripts/grammar_mask_bench.py), it compiles a grammar lazily in about a millisecond (xgrammar
precomputes per grammar, 5 ms for a small schema and more for large ones, paid per request when every
prompt has its own schema), its matcher rolls back any number of tokens with no window to size up
front, and it is one wheel with no dependencies (xgrammar pulls triton and apache-tvm-ffi). Grammars
are Lark as llguidance reads it, or llama.cpp's GBNF (converted), so one grammar file serves the
llama.cpp backend too.

`compile_grammar` turns a `Constraint` into llguidance's grammar (BackendError naming its origin when
the schema, expression or grammar is bad); `matcher_for` gives a `TokenMatcher` over a model's
vocabulary; `text_problem` checks a finished text against a regex or grammar, byte by byte, with
no model at all.
"""
from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import BackendError, Constraint

# JSON replies on one line with ", " and ": " between items: a model cannot spend its tokens on
# whitespace (flexible whitespace lets a small model indent forever), and every reply stays
# readable. A schema may still choose otherwise through llguidance's "x-guidance" key.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _one_line(message: str, limit: int = 300) -> str:
    """llguidance's messages span lines (the grammar echoed, a caret under the spot): one line."""
    parts = [line.strip() for line in message.splitlines()]
    text = " ".join(p for p in parts if p and set(p) != {"^"} and not p[:1].isdigit())
    return text[:limit] + ("..." if len(text) > limit else "")


def where(constraint: Constraint) -> str:
    return constraint.origin or {"json_schema": "the JSON schema", "regex": "the regex",
                                 "grammar": "the grammar"}[constraint.kind]


@lru_cache(maxsize=64)
def compile_grammar(constraint: Constraint) -> str:
    """llguidance's grammar for the constraint, checked (BackendError: one line naming its origin)."""
    import llguidance

    what = {"json_schema": "invalid JSON schema", "regex": "invalid regular expression",
            "grammar": "invalid grammar"}[constraint.kind]
    try:
        if constraint.kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(constraint.text, defaults=JSON_LAYOUT)
        elif constraint.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(constraint.text)
        else:  # Lark, or GBNF / EBNF (llguidance converts those to Lark)
            grammar = llguidance.grammar_from("grammar", constraint.text)
    except (ValueError, TypeError) as e:
        raise BackendError(f"{where(constraint)}: {what}: {_one_line(str(e))}") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise BackendError(f"{where(constraint)}: {what}: {_one_line(messages[0])}")
    return grammar


class TokenMatcher:
    """Where a reply stands in its constraint, token by token: the mask of tokens that may come
    next, advancing by tokens, rolling back. End-of-sequence ids are allowed only where the
    reply may end; once the constraint is complete they are the only ones allowed."""

    def __init__(self, matcher, vocab: int, origin: str):
        self.ll, self.vocab, self.origin = matcher, vocab, origin
        self.consumed = 0  # tokens advanced through, since the start of the reply
        self._bits = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def allowed(self) -> Tensor | None:
        """bool [vocab]: the tokens that may come next; None where none may (a dead end)."""
        self.ll.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        self._check()
        bits = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")[:self.vocab]
        mask = torch.from_numpy(bits.view(np.bool_))
        return mask if bool(mask.any()) else None

    def advance(self, tokens: Sequence[int]) -> int:
        """Advance through the leading tokens the constraint allows; returns how many (the first
        forbidden token and what follows it are left out, and the state stays usable)."""
        n = self.ll.try_consume_tokens(list(tokens)) if tokens else 0
        self._check()
        self.consumed += n
        return n

    def rollback(self, n: int) -> None:
        """Forget the last n tokens advanced through."""
        if n:
            if n > self.consumed or not self.ll.rollback(n):
                raise RuntimeError(f"cannot roll the constraint back {n} of {self.consumed} tokens")
            self.consumed -= n

    @property
    def finished(self) -> bool:
        """The reply is complete: only end-of-sequence may follow."""
        return self.ll.is_stopped()

    @property
    def accepting(self) -> bool:
        """The reply may end here."""
        return self.ll.is_accepting()

    def _check(self) -> None:
        if self.ll.is_error():
            raise BackendError(f"{self.origin}: the constraint failed mid-reply: {_one_line(self.ll.get_error())}")


_TOKENIZERS: OrderedDict = OrderedDict()  # (id of the HF tokenizer, vocab, eos) -> (tokenizer, LLTokenizer)
_MATCHERS: OrderedDict = OrderedDict()  # (tokenizer key, constraint) -> a fresh matcher to copy


def _ll_tokenizer(hf, vocab: int, eos_ids: Sequence[int]):
    """llguidance's view of a HF tokenizer (about a quarter of a second to build, so kept)."""
    import llguidance.hf

    key = (id(hf), vocab, tuple(sorted(eos_ids)))
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = (hf, llguidance.hf.from_tokenizer(hf, n_vocab=max(vocab, len(hf)),
                                                             eos_token=sorted(eos_ids)))
        while len(_TOKENIZERS) > 4:
            _TOKENIZERS.popitem(last=False)
    _TOKENIZERS.move_to_end(key)
    return key, _TOKENIZERS[key][1]


def matcher_for(constraint: Constraint, hf_tokenizer, vocab: int, eos_ids: Sequence[int]) -> TokenMatcher:
    """A matcher at the start of a reply, for a model whose logits have `vocab` entries. Compiled
    grammars are kept per (tokenizer, constraint). BackendError where the constraint is bad or no
    token of this vocabulary can start a reply that keeps it."""
    import llguidance

    grammar = compile_grammar(constraint)
    tok_key, lltok = _ll_tokenizer(hf_tokenizer, vocab, eos_ids)
    key = (tok_key, constraint)
    if key not in _MATCHERS:
        template = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if template.is_error():
            raise BackendError(f"{where(constraint)}: this model's vocabulary cannot follow it: "
                               f"{_one_line(template.get_error())}")
        first = TokenMatcher(template.deep_copy(), vocab, where(constraint))
        if first.allowed() is None:
            raise BackendError(f"{where(constraint)}: no token of this model's vocabulary can start a reply "
                               "that keeps it; check the schema, expression or grammar")
        _MATCHERS[key] = template
        while len(_MATCHERS) > 64:
            _MATCHERS.popitem(last=False)
    _MATCHERS.move_to_end(key)
    return TokenMatcher(_MATCHERS[key].deep_copy(), vocab, where(constraint))


class _ByteVocabulary:
    """One token per byte (and an end token): for checking a text with no model's tokenizer."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@lru_cache(maxsize=1)
def _byte_tokenizer():
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    return llguidance.LLTokenizer(TokenizerWrapper(_ByteVocabulary()))


def text_problem(constraint: Constraint, text: str) -> str | None:
    """What keeps `text` from matching the constraint as a whole (None: it matches), judged by
    the same library that constrains decoding, byte by byte."""
    import llguidance

    matcher = llguidance.LLMatcher(_byte_tokenizer(), compile_grammar(constraint), log_level=0)
    data = text.encode("utf-8")
    fits = matcher.try_consume_tokens(list(data))
    if fits < len(data):
        before = data[:fits].decode("utf-8", "replace")[-40:]
        return f"does not match after {before!r} (at byte {fits} of {len(data)})"
    if not matcher.is_accepting():
        return f"ends before the {'expression' if constraint.kind == 'regex' else 'grammar'} is complete"
    return None
