"""A second run on a loaded engine's weights: the A/B view's and verify's target-only reference.

`SharedWeights(engine)` is a TorchBackend on the same modules, weights, kernels and tokenizer as
`engine`, with a KV cache (and a hybrid's recurrent state) of its own, so that a reference run costs a cache, not a second copy of
the model, and neither run re-prefills or disturbs what the other has cached. Its passes are the
engine's own code path (TorchBackend.forward and stream), so its target-only decoding is bit for
bit a plain target-only engine's.

How: the model reads its cache from `model.cache`. Around each of the reference's passes, the
tensors' storages (and lengths) of the model's cache and the reference's are exchanged (`.data`,
O(layers), no copy) under a lock both runs take, so two threads (race mode) take turns pass by
pass. CPU compiled row graphs (exact_rows.CompiledRowGraphs) read the cache from the model on
every call, like the eager path, and so do static-shape passes (the CUDA engine) run eagerly: both
are shared. Static-shape passes compiled with CUDA graphs (`compile: true` on CUDA) keep the cache
at fixed addresses inside their graphs, which an exchange would break: for those `SharedWeights`
refuses (`unshareable_reason` says why) and the caller loads a reference of its own.
"""
from __future__ import annotations

import contextlib
from typing import Optional

from .engine import TorchBackend
from .model import KVCache


def unshareable_reason(engine: TorchBackend) -> Optional[str]:
    """Why a reference cannot run on this engine's weights (None: it can)."""
    if engine.model is None:
        return "the engine is closed"
    if engine.model.static and engine.model.static_graphs:
        return "its CUDA graphs hold their KV cache at fixed addresses"
    return None


def _exchange(a: KVCache, b: KVCache) -> None:
    for x, y in zip(a.k + a.v, b.k + b.v):
        if x is not None:  # None: a linear-attention layer, whose state is in `recurrent`
            held = x.data
            x.data = y.data
            y.data = held
    a.length, b.length = b.length, a.length
    a.recurrent, b.recurrent = b.recurrent, a.recurrent


class SharedWeights(TorchBackend):
    name = "torch (shared weights)"

    def __init__(self, engine: TorchBackend):  # noqa: the engine is loaded already: nothing to build
        reason = unshareable_reason(engine)
        if reason is not None:
            raise ValueError(f"cannot share this engine's weights: {reason}")
        self.__dict__.update(engine.__dict__)  # the same model, tokenizer, settings, lock
        self.base = engine
        self.cached = []
        self.pass_spans = []  # our own cache's (engine.py), not the engine's
        m = engine.model
        self.own = KVCache(m.cfg, m.cache.max_len, m.cache_dtype, m.device, m.rollback, m.rollback_span)
        self.inside = False  # whether our keys and values are in model.cache right now
        engine.sharers.add(self)  # its switch to compiled graphs starts our cache again too

    @contextlib.contextmanager
    def _own_cache(self):
        with self.turn:
            if self.inside:  # a pass within a pass (forward calls truncate): already ours
                yield
                return
            _exchange(self.model.cache, self.own)
            self.inside = True
            try:
                yield
            finally:
                self.inside = False
                _exchange(self.model.cache, self.own)

    @property
    def cache_len(self) -> int:
        return self.model.cache.length if self.inside else self.own.length

    def forward(self, *args, **kwargs):
        with self._own_cache():
            return super().forward(*args, **kwargs)

    def truncate(self, n: int) -> None:
        with self._own_cache():
            super().truncate(n)

    def restart_point(self, n: int) -> int:
        with self._own_cache():
            return super().restart_point(n)

    def warm_up(self, hidden: bool = False) -> None:
        """Nothing to compile: the weights are the engine's."""

    def background_status(self) -> Optional[str]:
        return None  # the engine's to say

    def switch_if_ready(self) -> Optional[str]:
        return None  # the engine switches, and starts this cache again

    @property
    def shares_weights(self) -> bool:
        return True

    def close(self) -> None:
        """Frees this run's cache only; the weights belong to the engine."""
        self.own = None
        self.cached = []
