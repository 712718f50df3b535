"""specchat's 4-bit CPU kernel (backends/native/q4_kernel.py, kernels/): every row's result has the
bits of a one-row call whatever the number of rows, the thread count and the ISA; it stays close
to the float product of the same weights; the engine falls back to torch's kernel without it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specchat.backends.native import q4_kernel
from specchat.backends.native.int4 import Int4Rows, int4_linear

pytestmark = pytest.mark.skipif(not q4_kernel.available(), reason="the 4-bit kernel could not be built here")


def isas() -> list[str]:
    return list(torch.ops.specchat.q4_isas())


def weights(n: int, k: int, seed: int) -> Int4Rows:
    g = torch.Generator().manual_seed(seed)
    return Int4Rows.quantize(torch.randn(n, k, generator=g) * 0.05)


def rows(m: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    x[:, :32] = 0.0 if m > 2 else x[:, :32]  # an all-zero block (scale 0) in every row of some calls
    return x.to(dtype)


def test_the_chosen_isa_is_the_best_available():
    assert q4_kernel.isa() == isas()[0]
    assert "ref" in isas()


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 16), nb=st.integers(1, 6), kb=st.integers(1, 8), seed=st.integers(0, 2**16),
       threads=st.sampled_from([1, 2]), dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_each_row_has_its_one_row_bits_on_every_isa(m, nb, kb, seed, threads, dtype):
    w = weights(16 * nb, 32 * kb, seed)
    tiles, x = q4_kernel.pack(w), rows(m, 32 * kb, seed, dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        oracle = torch.cat([torch.ops.specchat.q4_linear_on(x[i:i + 1], tiles, 16 * nb, "ref") for i in range(m)])
        for isa in isas():
            block = torch.ops.specchat.q4_linear_on(x, tiles, 16 * nb, isa)
            assert block.dtype == dtype and block.shape == (m, 16 * nb)
            assert torch.equal(block, oracle), isa
    finally:
        torch.set_num_threads(before)


def test_rows_past_sixteen_and_leading_dims():
    w = weights(64, 256, 3)
    tiles, x = q4_kernel.pack(w), rows(37, 256, 3)
    whole = torch.ops.specchat.q4_linear(x, tiles, 64)
    assert torch.equal(whole[20:21], torch.ops.specchat.q4_linear(x[20:21], tiles, 64))
    assert torch.equal(torch.ops.specchat.q4_linear(x.view(1, 37, 256), tiles, 64)[0], whole)


def test_close_to_the_float_product_of_the_same_weights():
    """int8 activations round each block to 1/254 of its largest value: the error against the
    float product stays within a small share of the product's own size."""
    w = weights(256, 1536, 5)
    x = rows(8, 1536, 5, torch.float32)
    y = torch.ops.specchat.q4_linear(x, q4_kernel.pack(w), 256)
    exact = x @ w.dequantize().T
    rel = (y - exact).norm(dim=1) / exact.norm(dim=1)
    assert float(rel.max()) < 0.01


def test_packing_keeps_every_nibble_and_scale():
    """A one-hot row picks out each weight: the kernel reads back every column's 32 values of a
    group (as d q + m, up to the one-hot row's own exact int8 quantization)."""
    w = weights(32, 64, 9)
    tiles = q4_kernel.pack(w)
    for k in (0, 3, 4, 15, 16, 17, 31, 32, 63):
        x = torch.zeros(1, 64)
        x[0, k] = 1.0
        got = torch.ops.specchat.q4_linear_on(x, tiles, 32, "ref")[0]
        assert torch.allclose(got, w.dequantize()[:, k], atol=2e-3, rtol=2e-3), k


def test_a_linear_runs_on_it_and_falls_back_without_it(monkeypatch):
    w = weights(64, 128, 1)
    x = rows(3, 128, 1)
    own = int4_linear(w)
    assert own.q4 is not None and own.int4 is None
    assert torch.equal(own(x), torch.ops.specchat.q4_linear(x, own.q4, 64))
    monkeypatch.setattr(q4_kernel, "available", lambda: False)
    torch_kernel = int4_linear(w)
    assert torch_kernel.q4 is None and torch_kernel.int4 is not None
    assert torch.allclose(torch_kernel(x).float(), own(x).float(), atol=0.05, rtol=0.05)


def test_the_disabling_variable_is_read(monkeypatch):
    monkeypatch.setenv("SPECCHAT_Q4_KERNEL", "0")
    assert q4_kernel.disabled()
    monkeypatch.setenv("SPECCHAT_Q4_KERNEL", "1")
    assert not q4_kernel.disabled()


def test_a_compiled_graph_calls_it():
    w = weights(32, 64, 2)
    lin = int4_linear(w)
    f = torch.compile(lambda x: torch.nn.functional.silu(lin(x)), fullgraph=True, dynamic=True)
    x = rows(5, 64, 2)
    assert torch.equal(f(x), torch.nn.functional.silu(lin(x)))


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 16), vb=st.integers(1, 4), kb=st.integers(1, 6), seed=st.integers(0, 2**16),
       threads=st.sampled_from([1, 2]))
def test_each_head_row_has_its_one_row_bits_on_every_isa(m, vb, kb, seed, threads):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (16 * vb, 32 * kb), generator=g, dtype=torch.int8)
    scale = torch.rand(16 * vb, generator=g) * 0.01
    tiles, x = q4_kernel.pack_head(q), rows(m, 32 * kb, seed, torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        oracle = [torch.ops.specchat.q8_head_on(x[i:i + 1], tiles, scale, "ref") for i in range(m)]
        for isa in isas():
            logits, norms = torch.ops.specchat.q8_head_on(x, tiles, scale, isa)
            assert torch.equal(logits, torch.cat([o[0] for o in oracle])), isa
            assert torch.equal(norms, torch.cat([o[1] for o in oracle])), isa
    finally:
        torch.set_num_threads(before)
    w = q.float() * scale[:, None]
    exact = x.double() @ w.double().T
    # the activations' rounding is what the norms say: a logit moves by at most ||x - x8|| ||w||,
    # plus float32 summation
    bound = norms[:, 1:].double() * w.double().norm(dim=1)[None, :] + 1e-5 * (x.norm(dim=1)[:, None].double() *
                                                                              w.double().norm(dim=1)[None, :])
    assert bool(((logits.double() - exact).abs() <= bound).all())


def head_dot_order(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """kernels/q4.h's head_dot written out: 16 lanes of float32 product-then-sum, folded in halves."""
    s = torch.zeros(w.shape[0], 16)
    for k in range(0, w.shape[1], 16):
        s = s + w[:, k:k + 16] * x[k:k + 16]
    for half in (8, 4, 2, 1):
        s = s[:, :half] + s[:, half:2 * half]
    return s[:, 0]


@settings(max_examples=10, deadline=None)
@given(kb=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_head_dots_sum_in_the_one_documented_order(kb, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(37, 16 * kb, generator=g) * torch.rand(37, 1, generator=g) * 10
    x = torch.randn(3, 16 * kb, generator=g)
    rows = torch.randint(0, 3, (50,), generator=g)
    ids = torch.randint(0, 37, (50,), generator=g)
    got = torch.ops.specchat.head_dots(x, w, rows, ids)
    want = torch.stack([head_dot_order(w[i:i + 1], x[r])[0] for r, i in zip(rows.tolist(), ids.tolist())])
    assert torch.equal(got, want)
    assert not torch.equal(want, (w[ids].double() * x[rows].double()).sum(-1).float()) or kb == 1  # rounding shows


attention = pytest.mark.skipif(not q4_kernel.attention_kernel_fits(9, 3, 64, torch.bfloat16),
                               reason="the attention kernel runs on AVX512 only")


def reference_attention(q, k, v, start, window=0):
    """Row i of q [H, n, hd] over keys [0, start + i] (the last `window` of them where window > 0), in float64."""
    H, n, hd = q.shape
    G = H // k.shape[1]
    out = []
    for i in range(n):
        first = max(0, start + i + 1 - window) if window else 0
        kk = k[0, :, first:start + i + 1].double().repeat_interleave(G, 0)
        vv = v[0, :, first:start + i + 1].double().repeat_interleave(G, 0)
        out.append(((q[:, i:i + 1].double() @ kk.transpose(1, 2)) / hd ** 0.5).softmax(-1) @ vv)
    return torch.cat(out, 1)


@attention
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 16), start=st.integers(0, 300), heads=st.sampled_from([(9, 3), (4, 4), (16, 2), (8, 1)]),
       hd=st.sampled_from([16, 64, 128]), threads=st.sampled_from([1, 2]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16),
       window=st.sampled_from([0, 0, 1, 9, 64, 280]))
def test_each_attention_row_has_its_one_row_bits(n, start, heads, hd, threads, dtype, seed, window):
    """Row i of a block has the bits of a one-row call at its position, whatever else is in the
    cache past that position (stale keys of a rejected draft) or, in a sliding-window layer, before
    its window, and however many threads run."""
    H, Hkv = heads
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, Hkv, start + n + 40, hd, generator=g).to(dtype) for _ in range(2))
    q = (2 * torch.randn(H, n, hd, generator=g)).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        block = torch.ops.specchat.attend_rows(q, k, v, start, window)
        reference = reference_attention(q, k, v, start, window)
        k[:, :, start + n:] = 1e4  # past every row's end: never read
        for i in range(n):
            if window:  # before this row's window: never read by it
                k[:, :, :max(0, start + i + 1 - window)] = 1e4
            one = torch.ops.specchat.attend_rows(q[:, i:i + 1].contiguous(), k, v, start + i, window)
            assert torch.equal(one[0, :, 0], block[0, :, i])
    finally:
        torch.set_num_threads(before)
    assert block.dtype == dtype and block.shape == (1, H, n, hd)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(block[0].double(), reference, atol=tolerance, rtol=tolerance)


@attention
def test_a_model_on_the_kernel_needs_no_attention_probe(monkeypatch, tiny_ggufs):
    import specchat.backends.native.model as model
    from specchat.backends.native.engine import TorchBackend
    from specchat.backends.native.exact_rows import KERNEL_MODE

    def probe(*a):
        raise AssertionError("probed")

    monkeypatch.setattr(model, "probe_attention_mode", probe)
    engine = TorchBackend(tiny_ggufs["Q4_1"], precision="int4", context=64)
    assert engine.model.attention_mode == KERNEL_MODE and engine.row_exact_supported
