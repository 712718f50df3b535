"""specchat's kernels for GGUF's F16 and BF16 matrices (kernels/f16*.cpp, kquant.py): the tiles hold
the file's own 16-bit values, every row of a call has the bits of its one-row call whatever the
number of rows, the thread count and the ISA, the product is the float product of the file's
weights up to float32 rounding, and the embedding rows read back from the tiles are the file's."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specchat.backends.native import kquant, q4_kernel

pytestmark = pytest.mark.skipif(not q4_kernel.available(), reason="specchat's kernels could not be built here")

TYPES = tuple(kquant.FLOAT16_TYPES)


def random_matrix(qtype: str, n: int, k: int, seed: int) -> kquant.QuantRows:
    """A matrix of the type as a GGUF stores it (its values' bytes, row-major), with values of a
    trained model's sizes and some float16 subnormals, which widen exactly too."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :8] = 3e-6  # below float16's smallest normal
    raw = w.to(kquant.FLOAT16_TYPES[qtype]).view(torch.uint8).reshape(n, 2 * k)
    return kquant.QuantRows(qtype, raw, k)


def rows(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(dtype)


def product(x: torch.Tensor, w: kquant.QuantRows, isa: str | None = None) -> torch.Tensor:
    tiles, kind = kquant.pack(w), kquant.type_id(w.type)
    if isa is None:
        return torch.ops.specchat.kq_linear(x, tiles, kind, w.rows)
    return torch.ops.specchat.kq_linear_on(x, tiles, kind, w.rows, isa)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """f16.h's arithmetic in numpy: four float32 partial sums over k = j (mod 4), in order. A float32
    product is exact in float64, so each step is the float64 sum rounded to float32: a fused
    multiply-add's one rounding, wherever float64's own rounding does not land on a float32 midpoint
    (these seeded inputs do not)."""
    x64, w64 = x.double().numpy(), w.double().numpy()
    p = np.zeros((4, x.shape[0], w.shape[0]), dtype=np.float32)
    for k in range(x.shape[1]):
        j = k % 4
        p[j] = (p[j].astype(np.float64) + np.outer(x64[:, k], w64[:, k])).astype(np.float32)
    return torch.from_numpy((p[0] + p[1]) + (p[2] + p[3]))


@pytest.mark.parametrize("qtype", TYPES)
def test_the_tiles_hold_the_files_values_and_rows_read_back_exactly(qtype):
    import gguf
    from gguf.quants import dequantize

    w = random_matrix(qtype, 32, 256, 1)
    tiles = kquant.pack(w)
    assert tiles.numel() == w.raw.numel()  # two bytes a weight, as in the file
    theirs = np.asarray(dequantize(w.raw.numpy(), gguf.GGMLQuantizationType[qtype]), dtype=np.float32).reshape(32, 256)
    assert torch.equal(w.dequantize(), torch.from_numpy(theirs))
    ids = torch.tensor([0, 5, 17, 31])
    assert torch.equal(torch.ops.specchat.kq_rows(tiles, kquant.type_id(qtype), 256, ids), w.dequantize()[ids])


@pytest.mark.parametrize("qtype", TYPES)
def test_the_product_is_the_float_product_of_the_files_weights(qtype):
    w, x = random_matrix(qtype, 48, 512, 2), rows(5, 512, 2)
    exact = x.double() @ w.dequantize().double().T
    y = product(x, w)
    assert torch.equal(y, reference(x, w.dequantize()))  # f16.h's order, bit for bit
    assert float(((y.double() - exact).abs() / exact.abs().clamp_min(1e-3)).max()) < 1e-4


@settings(max_examples=30, deadline=None)
@given(qtype=st.sampled_from(TYPES), m=st.integers(1, 20), nb=st.integers(1, 4), kb=st.integers(1, 6),
       seed=st.integers(0, 2**16), threads=st.sampled_from([1, 2]), dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_each_row_has_its_one_row_bits_on_every_isa(qtype, m, nb, kb, seed, threads, dtype):
    w, x = random_matrix(qtype, 16 * nb, 32 * kb, seed), rows(m, 32 * kb, seed, dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        oracle = torch.cat([product(x[i:i + 1], w, "ref") for i in range(m)])
        for isa in torch.ops.specchat.q4_isas():
            block = product(x, w, isa)
            assert block.dtype == dtype and block.shape == (m, 16 * nb)
            assert torch.equal(block, oracle), isa
    finally:
        torch.set_num_threads(before)


def test_a_16_bit_matrix_joins_a_fused_linear_and_a_wrong_tile_count_is_refused():
    q, v = random_matrix("F16", 32, 256, 3), random_matrix("BF16", 16, 256, 4)
    lin = kquant.kquant_linear([q, v])
    assert [kind for kind, _ in lin.kq_layout] == [1, 30] and lin.in_features == 256
    x = rows(3, 256, 5)
    assert torch.equal(lin(x), torch.cat([product(x, q), product(x, v)], dim=-1))
    with pytest.raises(RuntimeError, match="tiles do not match"):
        torch.ops.specchat.kq_linear(x, kquant.pack(q)[:1], 1, 32)
