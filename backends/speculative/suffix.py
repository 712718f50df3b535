"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): drafts from every earlier occurrence of the
text's tail, scored by how often each continuation followed it, with the draft length chosen per
pass from that confidence.

Our own compact index rather than Snowflake's arctic-inference suffix tree: its package (the one
vLLM's `method: suffix` runs) ships as a source distribution whose build imports torch >= 2.10 in
an isolated build environment (pulling the registry's full torch), pins protobuf and grpcio-tools
and builds its CUDA/vLLM extensions with CMake, which `pip install -e .` cannot do here in
reasonable time on a CPU-only machine. This index answers the same question in pure Python at a
few tens of microseconds per pass (scripts/suffix_cost.py).

What it proposes, precisely (tests/speculative/test_suffix_index.py holds a brute-force
reference of exactly this):

- The index holds sequences of token ids. An *occurrence* of a pattern is a place where the
  pattern stands inside one sequence and at least one token of that sequence follows it.
- The *anchor* is the longest size in `sizes` whose last tokens of the context occur; of its
  occurrences the `recent` latest are kept (counting over thousands of places of a common
  two-token pattern would cost more than the pass it saves). Among those, the *match* is as long
  as the longest that the context's tail has (at most `max_match` tokens), and the draft is read
  from the occurrences that match that far.
- At each draft position the token that follows most of the remaining occurrences is proposed
  (a tie: the one that followed most recently); its probability is that share times the
  probability of the tokens before it, and an occurrence whose sequence ends there counts against
  it. Drafting stops where the probability falls under `min_prob`, or at
  `factor * match + offset` tokens, or at the loop's depth: long, unanimous matches draft far,
  short or disputed ones little or nothing.
- With `loop`, an occurrence that runs into the end of the last sequence (the context itself, for
  the index of the current conversation) reads on into the draft, so that a loop continues.

`SuffixIndex` is one pool: the current conversation (one sequence that grows as tokens commit)
or the memory of earlier replies (many sequences, bounded by count and tokens, the oldest
evicted first, any removable by its key).
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

import numpy as np

SEP = -1  # between sequences, and over removed ones: never equal to a token


@dataclass(frozen=True)
class SuffixSettings:
    """How suffix drafts are chosen (see the module docstring) and how much the memory of earlier
    replies holds (`memory`: off keeps only the current conversation; 0 bounds: no bound)."""

    min_prob: float = 0.1  # vLLM's suffix_decoding_min_token_prob
    factor: float = 1.0  # vLLM's suffix_decoding_max_spec_factor: tokens per matched token
    offset: float = 0.0
    max_match: int = 24  # vLLM's suffix_decoding_max_tree_depth
    memory: bool = True
    memory_replies: int = 1000
    memory_tokens: int = 200_000


@dataclass
class Found:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match: int = 0  # how many context tokens the draft's occurrences matched

    @property
    def score(self) -> float:
        """The expected number of accepted tokens, as the counts tell it."""
        return sum(self.probs)


SIZES = (2, 4, 8)
RECENT = 256
BULK = 64  # `extend` with at least this many tokens hashes them with numpy (scripts/suffix_memory_cost.py)

# CPython's tuple hash (Objects/tupleobject.c, xxHash's lanes) over non-negative ints, whose hash is
# the int itself: the memory's bulk path must file every n-gram under the key that a lookup's
# hash(tuple) gives. tuple_hashes checks itself against hash() once and falls back if they differ.
_XX1, _XX2, _XX5 = np.uint64(11400714785074694791), np.uint64(14029467366897019727), np.uint64(2870177450012600261)


def _numpy_tuple_hashes(seq: np.ndarray, size: int) -> np.ndarray:
    n = len(seq) - size + 1
    acc = np.full(n, _XX5, dtype=np.uint64)
    for j in range(size):
        acc += seq[j:j + n].astype(np.uint64) * _XX2
        acc = (acc << np.uint64(31)) | (acc >> np.uint64(33))
        acc *= _XX1
    acc += np.uint64(size ^ (2870177450012600261 ^ 3527539))
    out = acc.view(np.int64)
    out[out == -1] = 1546275796
    return out


def _python_tuple_hashes(seq: np.ndarray, size: int) -> np.ndarray:
    values = seq.tolist()
    return np.array([hash(tuple(values[i:i + size])) for i in range(len(values) - size + 1)], dtype=np.int64)


def tuple_hashes(seq: np.ndarray, size: int) -> np.ndarray:
    """hash(tuple(seq[i:i + size])) for every window of `seq` (non-negative int64 ids)."""
    return _TUPLE_HASHES(seq, size)


_PROBE = np.array([0, 1, 2**31 - 1, 49152, 151_000, 7, 3, 2**40], dtype=np.int64)
_TUPLE_HASHES = (_numpy_tuple_hashes if all(np.array_equal(_numpy_tuple_hashes(_PROBE, k), _python_tuple_hashes(_PROBE, k))
                                            for k in (1, 2, 4, 8)) else _python_tuple_hashes)


def _checked(tokens: Sequence[int]) -> np.ndarray:
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if ids.size and ids.min() < 0:
        raise ValueError(f"token ids are >= 0, not {int(ids.min())}")
    return ids


def _file(table: dict, key: int, end: int) -> None:
    """Position `end` under the n-gram `key`: an int for one place, a list (oldest first) for more."""
    held = table.get(key)
    if held is None:
        table[key] = end
    elif type(held) is int:
        table[key] = [held, end]
    else:
        held.append(end)


class SuffixIndex:
    """Sequences of token ids in one flat array (SEP between them), and for each anchor size the
    positions that followed every n-gram of that size, oldest first."""

    def __init__(self, sizes: Sequence[int] = SIZES, max_match: int = 24, recent: int = RECENT,
                 max_sequences: int = 0, max_tokens: int = 0):
        if not sizes or min(sizes) < 1 or max_match < max(sizes):
            raise ValueError(f"anchor sizes {tuple(sizes)} must be >= 1 and at most max_match {max_match}")
        self.sizes = tuple(sorted(set(sizes)))
        self.max_match, self.recent = max_match, recent
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self.reset()

    def reset(self) -> None:
        self.flat = array("i")
        self.spans: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()  # key -> (start, end), oldest first
        self.tables: list[dict[int, int | list[int]]] = [{} for _ in self.sizes]
        self.live_tokens = 0
        self._last: Optional[Hashable] = None  # the sequence `extend` grows
        self._synced: Optional[Sequence[int]] = None  # the list `sync` last held

    # ----------------------------------------------------------------------- contents
    @property
    def sequences(self) -> int:
        return len(self.spans)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.spans

    def sequence(self, key: Hashable) -> list[int]:
        start, end = self.spans[key]
        return self.flat[start:end].tolist()

    def add(self, key: Hashable, tokens: Sequence[int]) -> None:
        """A new sequence (replacing one of the same key), then the oldest ones evicted while the
        pool is over its bounds (never the new one)."""
        if key in self.spans:
            self.remove(key)
        if self.flat:
            self.flat.append(SEP)
        start = len(self.flat)
        self.spans[key] = (start, start)
        self._last = key
        self.extend(tokens)
        while len(self.spans) > 1 and ((self.max_sequences and len(self.spans) > self.max_sequences)
                                       or (self.max_tokens and self.live_tokens > self.max_tokens)):
            self.remove(next(iter(self.spans)))

    def extend(self, tokens: Sequence[int]) -> None:
        """More tokens of the sequence added last."""
        if self._last is None:
            raise ValueError("no sequence to extend: add one first")
        if len(tokens) >= BULK:
            self._extend_bulk(tokens)
            return
        start, _ = self.spans[self._last]
        flat = self.flat
        for token in tokens:
            if token < 0:
                raise ValueError(f"token ids are >= 0, not {token}")
            end = len(flat)  # the position of the token that now follows every n-gram ending before it
            for size, table in zip(self.sizes, self.tables):
                if end - size < start:
                    break
                _file(table, hash(tuple(flat[end - size:end])), end)
            flat.append(token)
        self.spans[self._last] = (start, len(flat))
        self.live_tokens += len(tokens)

    def _extend_bulk(self, tokens: Sequence[int]) -> None:
        """`extend` for many tokens at once: the same tables, filed by `_file_span`."""
        new = _checked(tokens)
        start, _ = self.spans[self._last]
        follow = len(self.flat)
        self.flat.extend(new.tolist())
        self._file_span(start, follow)
        self.spans[self._last] = (start, len(self.flat))
        self.live_tokens += len(new)

    def add_many(self, items: Sequence[tuple[Hashable, Sequence[int]]]) -> None:
        """`add` of each (key, tokens), oldest first, in one pass over the tables (a thousand
        earlier replies read into the memory at load: scripts/suffix_memory_cost.py)."""
        items = [(key, _checked(tokens)) for key, tokens in items]
        for key, _ in items:
            if key in self.spans:
                self.remove(key)
        if not items:
            return
        flat = self.flat
        first = None
        for key, tokens in items:
            if flat:  # as `add` lays them out
                flat.append(SEP)
            first = len(flat) if first is None else first
            self.spans[key] = (len(flat), len(flat) + len(tokens))
            flat.extend(tokens.tolist())
            self.live_tokens += len(tokens)
        self._last = items[-1][0]
        self._file_span(first, first)
        while len(self.spans) > 1 and ((self.max_sequences and len(self.spans) > self.max_sequences)
                                       or (self.max_tokens and self.live_tokens > self.max_tokens)):
            self.remove(next(iter(self.spans)))

    def _file_span(self, base: int, follow: int) -> None:
        """File every n-gram of flat[base:] whose following token stands at `follow` or later (and
        within the same sequence), as `extend` files them one at a time: each n-gram's hash
        computed by numpy, the positions grouped per n-gram, oldest first."""
        seq = np.asarray(self.flat[base:], dtype=np.int64)
        seps = np.concatenate([[0], np.cumsum(seq == SEP)])  # SEPs before each index
        ends = np.arange(max(follow - base, 1), len(seq))  # following positions, relative to base
        for size, table in zip(self.sizes, self.tables):
            at = ends[ends >= size]
            at = at[seps[at + 1] == seps[at - size]]  # no SEP in the n-gram nor in what follows it
            if not at.size:
                continue
            keys = tuple_hashes(seq, size)[at - size]
            order = np.argsort(keys, kind="stable")  # stable: each n-gram's positions stay oldest first
            keys, positions = keys[order], (at[order] + base).tolist()
            cuts = (np.flatnonzero(keys[1:] != keys[:-1]) + 1).tolist()
            spans = zip(keys[[0] + cuts].tolist(), [0] + cuts, cuts + [len(positions)])
            if not table:  # a fresh memory: nothing to merge with
                table.update((key, positions[a] if b - a == 1 else positions[a:b]) for key, a, b in spans)
                continue
            get = table.get
            for key, a, b in spans:
                held = get(key)
                if held is None:
                    table[key] = positions[a] if b - a == 1 else positions[a:b]
                elif type(held) is int:
                    table[key] = [held] + positions[a:b]
                else:
                    held.extend(positions[a:b])

    def remove(self, key: Hashable) -> None:
        """Forget a sequence: its tokens become separators (no pattern matches them), and once
        removed tokens outnumber the live ones the pool is rebuilt without them."""
        start, end = self.spans.pop(key)
        self.flat[start:end] = array("i", [SEP]) * (end - start)
        self.live_tokens -= end - start
        if self._last == key:
            self._last = None
        if len(self.flat) - self.live_tokens > max(self.live_tokens, 1024):
            self._rebuild()

    def _rebuild(self) -> None:
        kept = [(key, self.sequence(key)) for key in self.spans]
        last = self._last
        self.reset()
        for key, tokens in kept:
            if self.flat:
                self.flat.append(SEP)
            self.spans[key] = (len(self.flat), len(self.flat))
            self._last = key
            self.extend(tokens)
        self._last = last

    def sync(self, tokens: Sequence[int]) -> None:
        """Hold exactly `tokens` as the one sequence (growing it in place while they extend it; a
        rollback or another text rebuilds it). The loop hands over the same list every pass, only
        ever extended: that one is not compared again."""
        held = len(self.flat)
        same = tokens is self._synced and len(tokens) >= held
        if not same and (self.sequences != 1 or self._last is None or held > len(tokens)
                         or self.flat.tolist() != list(tokens[:held])):
            self.reset()
            self.add(0, tokens)
        elif len(tokens) > held:
            self.extend(tokens[held:])
        self._synced = tokens

    # ------------------------------------------------------------------------ drafting
    def _occurrences(self, context: Sequence[int]) -> tuple[list[int], int]:
        """The kept occurrences of the anchor (the positions that followed it), newest first, and
        the anchor's size (0: none)."""
        flat, n = self.flat, len(context)
        for size, table in reversed(list(zip(self.sizes, self.tables))):
            if size > n:
                continue
            tail = tuple(context[n - size:])
            held = table.get(hash(tail))
            if held is None:
                continue
            found = []
            for p in ([held] if type(held) is int else reversed(held)):
                if flat[p] != SEP and tuple(flat[p - size:p]) == tail:
                    found.append(p)
                    if len(found) == self.recent:
                        break
            if found:
                return found, size
        return [], 0

    def find(self, context: Sequence[int], max_tokens: int, settings: SuffixSettings = SuffixSettings(),
             loop: bool = False) -> Found:
        """The draft for what follows `context` (module docstring), up to `max_tokens` tokens."""
        if max_tokens <= 0:
            return Found()
        occurrences, size = self._occurrences(context)
        if not occurrences:
            return Found()
        flat, n = self.flat, len(context)
        most = min(self.max_match, n)
        matched = []
        for p in occurrences:
            m = size
            while m < most and p - m - 1 >= 0 and flat[p - m - 1] == context[n - m - 1]:
                m += 1
            matched.append(m)
        match = max(matched)
        live = [p for p, m in zip(occurrences, matched) if m == match]  # newest first
        cap = min(max_tokens, int(match * settings.factor + settings.offset + 1e-6))
        out = Found(match=match)
        end, prob = len(flat), 1.0
        while len(out.tokens) < cap:
            k = len(out.tokens)
            counts: dict[int, int] = {}  # in order of first appearance: newest occurrence first
            nexts = []
            for p in live:
                q = p + k
                t = flat[q] if q < end else (out.tokens[q - end] if loop else SEP)
                nexts.append(t)
                if t != SEP:
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            best = max(counts, key=counts.__getitem__)  # the first of the most frequent: the newest
            prob *= counts[best] / len(live)
            if prob < settings.min_prob:
                break
            out.tokens.append(best)
            out.probs.append(prob)
            live = [p for p, t in zip(live, nexts) if t == best]
        return out
