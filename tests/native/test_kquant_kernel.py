"""specchat's kernels for GGUF's Q8_0 and K-quant weights (backends/native/kquant.py,
kernels/kquant*.cpp): the blocks decode as gguf's own dequantize does, bit for bit; every row of
a call has the bits of its one-row call whatever the number of rows, the thread count and the ISA;
and the product stays close to the float product of the dequantized weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specchat.backends.native import kquant, q4_kernel
from specchat.backends.native.int4 import Int4Rows

pytestmark = pytest.mark.skipif(not q4_kernel.available(), reason="specchat's kernels could not be built here")

TYPES = tuple(t for t in kquant.TYPES if t not in kquant.FLOAT16_TYPES)  # test_f16_kernel.py has those
# where each block type keeps its float16 factors: (first byte, scale range)
FACTORS = {"Q8_0": [(0, 0.02)], "Q4_K": [(0, 0.004), (2, 0.004)], "Q5_K": [(0, 0.002), (2, 0.002)],
           "Q6_K": [(208, 0.002)], "Q5_0": [(0, 0.02)], "Q5_1": [(0, 0.02), (2, 0.2)], "IQ4_NL": [(0, 0.005)],
           "IQ4_XS": [(0, 0.0002)]}


def random_blocks(qtype: str, n: int, k: int, seed: int) -> kquant.QuantRows:
    """Blocks of random bytes (every bit pattern is a valid block) with finite float16 factors of a
    realistic size, negative too (signed scales, Q5_1's min), but K-quant mins, which are not."""
    rng = np.random.default_rng(seed)
    _, size, per = kquant.TYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    for at, top in FACTORS[qtype]:
        low = 0.0 if qtype in ("Q4_K", "Q5_K") else -top
        raw[..., at:at + 2] = rng.uniform(low, top, size=raw.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
    return kquant.QuantRows(qtype, torch.from_numpy(raw.reshape(n, -1)), k)


def rows(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    if m > 2:
        x[:, :32] = 0.0  # an all-zero block (scale 0)
    return x.to(dtype)


def isas() -> list[str]:
    return list(torch.ops.specchat.q4_isas())


def product(x: torch.Tensor, w: kquant.QuantRows, isa: str | None = None) -> torch.Tensor:
    tiles, kind = kquant.pack(w), kquant.type_id(w.type)
    if isa is None:
        return torch.ops.specchat.kq_linear(x, tiles, kind, w.rows)
    return torch.ops.specchat.kq_linear_on(x, tiles, kind, w.rows, isa)


@pytest.mark.parametrize("qtype", TYPES)
def test_blocks_decode_as_gguf_dequantizes_them(qtype):
    import gguf
    from gguf.quants import dequantize

    w = random_blocks(qtype, 32, 512, 1)
    theirs = dequantize(w.raw.numpy(), gguf.GGMLQuantizationType[qtype]).reshape(32, 512)
    assert torch.equal(w.dequantize(), torch.from_numpy(np.ascontiguousarray(theirs, dtype=np.float32)))


@pytest.mark.parametrize("qtype", TYPES)
def test_close_to_the_float_product_of_the_same_weights(qtype):
    """int8 activations round each block of 32 to 1/254 of its largest value: the error against
    the float product stays within a small share of the product's own size."""
    w, x = random_blocks(qtype, 64, 1024, 2), rows(8, 1024, 2)
    exact = x @ w.dequantize().T
    rel = (product(x, w) - exact).norm(dim=1) / exact.norm(dim=1)
    assert float(rel.max()) < 0.012, qtype


@settings(max_examples=30, deadline=None)
@given(qtype=st.sampled_from(TYPES), m=st.integers(1, 16), nb=st.integers(1, 4), sb=st.integers(1, 3),
       seed=st.integers(0, 2**16), threads=st.sampled_from([1, 2]), dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_each_row_has_its_one_row_bits_on_every_isa(qtype, m, nb, sb, seed, threads, dtype):
    w, x = random_blocks(qtype, 16 * nb, 256 * sb, seed), rows(m, 256 * sb, seed, dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        oracle = torch.cat([product(x[i:i + 1], w, "ref") for i in range(m)])
        for isa in isas():
            block = product(x, w, isa)
            assert block.dtype == dtype and block.shape == (m, 16 * nb)
            assert torch.equal(block, oracle), isa
    finally:
        torch.set_num_threads(before)


def test_rows_past_sixteen_and_leading_dims():
    w, x = random_blocks("Q4_K", 48, 512, 4), rows(37, 512, 4)
    whole = product(x, w)
    assert torch.equal(whole[20:21], product(x[20:21], w))
    assert torch.equal(product(x.view(1, 37, 512), w)[0], whole)


def test_a_mismatched_tile_count_or_unknown_type_is_refused():
    w = random_blocks("Q6_K", 32, 512, 5)
    tiles = kquant.pack(w)
    with pytest.raises(RuntimeError, match="tiles do not match"):
        torch.ops.specchat.kq_linear(rows(1, 512, 0), tiles[:1], kquant.type_id("Q6_K"), 32)
    with pytest.raises(RuntimeError, match="no kernel"):
        torch.ops.specchat.kq_linear(rows(1, 512, 0), tiles, 99, 32)


def test_a_fused_linear_of_mixed_types_is_its_parts_side_by_side():
    """Q4_K_M files store some attn_v as Q6_K beside Q4_K q and k: one Linear runs a segment per type,
    each as the part alone computes it; the Q4 tiles of Q4_0 / Q4_1 files join in the same way."""
    q, k, v = random_blocks("Q4_K", 64, 256, 6), random_blocks("Q4_K", 32, 256, 7), random_blocks("Q6_K", 32, 256, 8)
    int4 = Int4Rows.quantize(torch.randn(16, 256) * 0.05)
    lin = kquant.kquant_linear([q, k, v, int4])
    assert [kind for kind, _ in lin.kq_layout] == [12, 14, kquant.Q4_TILES] and lin.in_features == 256
    x = rows(5, 256, 9)
    parts = [product(x, kquant.QuantRows.cat([q, k])), product(x, v),
             torch.ops.specchat.q4_linear(x, q4_kernel.pack(int4), 16)]
    assert torch.equal(lin(x), torch.cat(parts, dim=-1))


def test_tiles_hold_about_the_file_bytes():
    for qtype in TYPES:
        w = random_blocks(qtype, 64, 1024, 10)
        assert kquant.pack(w).numel() == (64 // 16) * (1024 // 32) * kquant.TILE_BYTES[qtype]
        assert kquant.pack(w).numel() <= 1.03 * w.raw.numel(), qtype
