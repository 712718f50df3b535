"""The int8 head for argmax choices: the sampler's choice from float32 logits, recomputing only
the tokens that could win."""
from __future__ import annotations

import pytest
import torch

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native import q4_kernel
from specchat.backends.native.argmax_head import ArgmaxHead, for_head
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.sampling import sample
from specchat.paths import cache_dir

CHOICES = [Sampling(), Sampling(temperature=0.7, seed=3), Sampling(temperature=1.0, seed=8),
           Sampling(temperature=0.2, seed=1)]


OWN = pytest.param(True, marks=pytest.mark.skipif(not q4_kernel.available(), reason="specchat's kernel not built"),
                   id="own-kernel")
KERNELS = [pytest.param(False, id="torch-int8"), OWN]


def exact_logits(head: ArgmaxHead, states: torch.Tensor) -> torch.Tensor:
    """Every logit, computed as the head computes its candidates' (one fixed order a token)."""
    vocab = head.weight.shape[0]
    rows = torch.arange(len(states)).repeat_interleave(vocab)
    return head.exact(states.float(), rows, torch.arange(vocab).repeat(len(states))).view(len(states), vocab)


def skewed_head(seed: int, vocab: int = 3008, dim: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, dim, generator=g) * 0.05
    w[::7, ::5] *= 20  # outlier weights make the int8 rows coarse
    return w


def states_with_near_ties(w: torch.Tensor, seed: int, rows: int = 48) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    states = torch.randn(rows, w.shape[1], generator=g) * 8
    for r in range(0, rows, 2):  # half the rows: two tokens within a hair of each other at the top
        a, b = torch.randint(0, w.shape[0], (2,), generator=g).tolist()
        states[r] = 40 * (w[a] / w[a].norm() + w[b] / w[b].norm()) / 2
    return states


@pytest.mark.parametrize("own", KERNELS)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("s", CHOICES, ids=["greedy", "t0.7", "t1.0", "t0.2"])
def test_the_choice_is_the_samplers_on_float32_logits(seed, s, own):
    w = skewed_head(seed)
    states = states_with_near_ties(w, seed)
    positions = list(range(40, 40 + len(states)))
    head = ArgmaxHead(w, own)
    want = sample(exact_logits(head, states), positions, s)
    assert torch.equal(head.choose(states, positions, s), want)
    # the logits are float32 sums in one order; a GEMM's order gives other bits
    assert not torch.equal(exact_logits(head, states), states @ w.T)


@pytest.mark.parametrize("own", KERNELS)
def test_exact_ties_go_to_the_first_token(own):
    w = skewed_head(9, dim=128)
    w[17] = w[2000] = 2.0  # a duplicate row, far ahead of the rest: equal logits, token 17 first
    states = torch.ones(3, w.shape[1])
    assert ArgmaxHead(w, own).choose(states, [5, 6, 7], Sampling()).tolist() == [17, 17, 17]


def test_the_bound_holds_and_the_int8_scores_alone_would_choose_differently():
    w = skewed_head(4)
    states = states_with_near_ties(w, 4)
    head = ArgmaxHead(w)
    assert head.within_bound(states)
    approx = torch.ops.aten._weight_int8pack_mm(states.bfloat16(), head.q, head.scale).float()
    assert not torch.equal(approx.argmax(-1), exact_logits(head, states).argmax(-1))  # recomputing is needed


def test_a_kernel_outside_the_bound_means_no_argmax_head(monkeypatch):
    w = skewed_head(5)
    assert isinstance(for_head(w, torch.ones(w.shape[1])), ArgmaxHead)
    sloppy = ArgmaxHead._approx
    monkeypatch.setattr(ArgmaxHead, "_approx", lambda self, x: (sloppy(self, x)[0] + 0.01, sloppy(self, x)[1] * 0))
    assert for_head(w, torch.ones(w.shape[1])) is None  # the engine keeps the float32 head


@pytest.mark.parametrize("own", KERNELS)
@pytest.mark.parametrize("s", CHOICES[:2], ids=["greedy", "t0.7"])
def test_rows_choose_the_same_however_many_come_together(s, own):
    w = skewed_head(7, dim=128)
    states = states_with_near_ties(w, 7, rows=12)
    head, positions = ArgmaxHead(w, own), list(range(12))
    together = head.choose(states, positions, s)
    for size in (1, 2, 5):
        parts = torch.cat([head.choose(states[i:i + size], positions[i:i + size], s) for i in range(0, 12, size)])
        assert torch.equal(parts, together)


@pytest.mark.slow
@pytest.mark.parametrize("s", CHOICES[:2], ids=["greedy", "t0.7"])
def test_decoding_on_the_real_model_is_unchanged(real_gguf, s):
    """Through the int8 head the engine decodes what it decodes through the float32 head."""
    engine = TorchBackend(real_gguf, context=512, cache_dir=cache_dir())
    head = engine.model.argmax_head
    assert head is not None
    ids = engine.tokenize_chat([{"role": "user", "content": "Write a haiku about rain, then explain it."}])
    states, _ = engine.forward(ids, 0, head=False)
    assert head.within_bound(states)  # the bound holds on the model's own states
    positions = list(range(1, len(ids) + 1))
    assert torch.equal(engine.choose(states, positions, s), sample(engine.head_logits(states), positions, s))
    request = Request(messages=[{"role": "user", "content": "Name three rivers in Europe."}])
    engine.truncate(0)  # both replies prefill the whole prompt: a prefill from a cached prefix computes otherwise
    fast = run_to_summary(engine.stream(request, Sampling(s.temperature, seed=s.seed, max_tokens=48)))
    engine.model.argmax_head = None
    engine.truncate(0)
    slow = run_to_summary(engine.stream(request, Sampling(s.temperature, seed=s.seed, max_tokens=48)))
    assert fast.token_ids == slow.token_ids and len(fast.token_ids) > 20
