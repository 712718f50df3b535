"""The greedy LM head: an int8 head plus exact recomputation of every token that could win."""
from __future__ import annotations

import pytest
import torch

from backends.base import Request, Sampling, run_to_summary
from backends.native.argmax_head import ArgmaxHead, for_head
from backends.native.engine import TorchBackend


def exact_logits(weight: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """Every logit computed as the head recomputes its candidates (float32, product then sum)."""
    return (weight[None] * states[:, None]).sum(-1)


def skewed_head(seed: int, vocab: int = 3000, dim: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, dim, generator=g) * 0.05
    w[::7, ::5] *= 20  # outlier weights make the int8 rows coarse
    return w


@pytest.mark.parametrize("seed", range(4))
def test_argmax_is_the_float32_heads_including_near_ties(seed):
    w = skewed_head(seed)
    g = torch.Generator().manual_seed(100 + seed)
    states = torch.randn(64, w.shape[1], generator=g) * 8
    # half the rows get a planted near-tie: two tokens within 1e-4 of each other at the top
    for r in range(0, 64, 2):
        a, b = torch.randint(0, w.shape[0], (2,), generator=g).tolist()
        states[r] = 40 * (w[a] / w[a].norm() + w[b] / w[b].norm()) / 2
    head = ArgmaxHead(w)
    got = head(states)
    want = exact_logits(w, states)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(got.gather(1, want.argmax(-1, keepdim=True)), want.max(-1, keepdim=True).values)
    # elsewhere the int8 approximation: not the float32 logits, and never above the maximum
    assert not torch.equal(got, want)
    assert (got <= want.max(-1, keepdim=True).values).all()


def test_a_kernel_outside_the_bound_means_no_argmax_head(monkeypatch):
    w = skewed_head(5)
    assert isinstance(for_head(w, torch.ones(w.shape[1])), ArgmaxHead)
    sloppy = ArgmaxHead._approx
    monkeypatch.setattr(ArgmaxHead, "_approx", lambda self, x: (sloppy(self, x)[0] + 0.01, sloppy(self, x)[1] * 0))
    assert for_head(w, torch.ones(w.shape[1])) is None  # the engine keeps the float32 head


def test_rows_get_the_same_bits_however_many_come_together():
    w = skewed_head(7)
    states = torch.randn(12, w.shape[1], generator=torch.Generator().manual_seed(3)) * 8
    head = ArgmaxHead(w)
    together = head(states)
    for size in (1, 2, 5):
        parts = torch.cat([head(states[i:i + size]) for i in range(0, 12, size)])
        assert torch.equal(parts, together)


@pytest.mark.slow
def test_greedy_decoding_on_the_real_model_is_unchanged(real_gguf):
    """The int8 head with recomputation decodes exactly what the float32 head decodes."""
    engine = TorchBackend(real_gguf, context=512)
    assert engine.model.argmax_head is not None
    ids = engine.tokenize_chat([{"role": "user", "content": "Write a haiku about rain, then explain it."}])
    states, _ = engine.forward(ids, 0, head=False)
    assert engine.model.argmax_head.within_bound(states)  # the bound holds on the model's own states
    assert torch.equal(engine.head_logits(states, argmax_only=True).argmax(-1), engine.head_logits(states).argmax(-1))
    request = Request(messages=[{"role": "user", "content": "Name three rivers in Europe."}])
    sampling = Sampling(max_tokens=48)
    fast = run_to_summary(engine.stream(request, sampling))
    engine.model.argmax_head, kept = None, engine.model.argmax_head
    engine.truncate(0)
    slow = run_to_summary(engine.stream(request, sampling))
    engine.model.argmax_head = kept
    assert fast.token_ids == slow.token_ids and len(fast.token_ids) > 20
