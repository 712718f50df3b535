"""`Linear`: y = x W^T (+ b), with W dense in the compute dtype, group-wise int4 on specchat's CPU
kernel (q4_kernel.py) or torch's, or float32 multiplied in row pairs (the LM head on CPU, whose
rows must keep their bits however many come: see exact_rows.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cpu import native_bfloat16

# kq_layout's kind for a segment of q4.h tiles (GGUF Q4_0 and Q4_1 alike, as Int4Rows): Q4_1's type id
Q4_TILES = 3

# From this many rows on, a dense matmul beats torch's int4 kernel, whose cost grows with every row
# (re-measure: scripts/bench_engine.py, a long prefill with and without the dense copy).
DENSE_MIN_ROWS = 8


def dense_compute_dtype() -> torch.dtype:
    """What a many-row pass multiplies an int4 Linear's bfloat16 copy in: bfloat16 where the CPU
    multiplies it natively, else float32, the copy widened on the fly (emulated bfloat16 GEMM is
    several times slower than float32). Decided by the CPU's flags, not by timing: the choice
    sets a prefill's arithmetic and so the reply, which must not change between runs."""
    return torch.bfloat16 if native_bfloat16() else torch.float32


class Linear(nn.Module):
    """A dense weight [out, in], or `int4` = (packed, scales_and_zeros, group_size) for torch's CPU
    int4 kernel (bfloat16 in and out). An int4 Linear may also hold `dense`, a bfloat16 copy of the
    same weights, for passes of many rows that need not match single-token arithmetic bit for bit
    (prefill, non-strict verify). `pairwise`: float32 on CPU, computed as GEMMs of two rows."""

    def __init__(self, weight: Tensor | None, bias: Tensor | None = None, int4: tuple | None = None,
                 pairwise: bool = False, dense: Tensor | None = None, q4: Tensor | None = None, out: int = 0,
                 kq: tuple[Tensor, ...] | None = None, kq_layout: tuple[tuple[int, int], ...] = (), kq_in: int = 0):
        """q4: the tiles of specchat's 4-bit kernel (q4_kernel.pack) for `out` output columns,
        instead of `int4`; every row then has the same bits however many rows come.
        kq: the output columns in segments of GGUF weight types, each segment's tiles on specchat's
        kernels (kquant.py), `kq_layout` their (GGUF type id, columns), `kq_in` the inputs: a fused
        q|k|v whose matrices a file stores in different types (Q4_K_M's Q6_K values) is one Linear."""
        super().__init__()
        self.kq, self.kq_layout, self.kq_in = kq, kq_layout, kq_in
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.int4 = int4
        self.q4, self.out = q4, out
        self.pairwise = pairwise
        self.dense = dense

    @property
    def in_features(self) -> int:
        if self.weight is not None:
            return self.weight.shape[1]
        if self.kq is not None:
            return self.kq_in
        if self.q4 is not None:  # tiles [N / 16, K / 32, 320]
            return self.q4.shape[1] * 32
        if self.dense is not None:
            return self.dense.shape[1]
        return self.int4[0].shape[1] * 2  # torch's packing: two 4-bit weights a byte

    @property
    def quantized(self) -> bool:
        """Whether W is quantized (4-bit on either kernel, or a GGUF type on specchat's kernels)."""
        return self.int4 is not None or self.q4 is not None or self.kq is not None

    @property
    def own_kernel(self) -> bool:
        """Whether W runs on specchat's kernels, whose rows keep their bits by construction."""
        return self.q4 is not None or self.kq is not None

    @property
    def dense_dtype(self) -> torch.dtype | None:
        # a property, not an attribute: see graph_store.py on what a module may hold
        return dense_compute_dtype() if self.dense is not None else None

    def forward(self, x: Tensor, exact: bool = False) -> Tensor:
        """exact: each row as a single-token pass computes it (never the dense copy)."""
        if self.pairwise:
            return self._pairs(x)
        if self.kq is not None:
            y = self._segments(x)
        elif self.quantized and (exact or self.dense is None or x.shape[0] < DENSE_MIN_ROWS):
            if self.q4 is not None:
                y = torch.ops.specchat.q4_linear(x, self.q4, self.out)
            else:
                packed, sz, group = self.int4
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)
        elif not self.quantized:
            y = F.linear(x, self.weight)
        else:  # `.to` is a no-op where the copy is multiplied as it is
            y = F.linear(x.to(self.dense_dtype), self.dense.to(self.dense_dtype)).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _segments(self, x: Tensor) -> Tensor:
        ys = [torch.ops.specchat.q4_linear(x, tiles, n) if kind == Q4_TILES
              else torch.ops.specchat.kq_linear(x, tiles, kind, n) for tiles, (kind, n) in zip(self.kq, self.kq_layout)]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)

    def _pairs(self, x: Tensor) -> Tensor:
        """MKL's one-row GEMV and its GEMM round differently, and GEMM's blocking depends on the
        number of rows, so every call is made as GEMMs of exactly two rows (an odd row padded):
        each row gets the same bits however many rows come, at about a GEMV's cost per row."""
        K = x.shape[0]
        if K % 2:
            x = torch.cat([x, x[-1:]])
        return torch.cat([F.linear(pair, self.weight) for pair in x.split(2)])[:K]
