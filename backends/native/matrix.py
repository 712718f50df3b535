"""A checkpoint's matrices as one `Linear` on the kernel that runs them here: float32 tensors,
`Int4Rows` (torch's or specchat's 4-bit kernel) and a GGUF's blocks (`QuantRows`: Q4 as Int4Rows,
the other types on specchat's kernels), stacked by rows. The dense layers (weights.py) and a GGUF's
routed experts (moe_weights.py) are built with it alike."""
from __future__ import annotations

import logging

import torch
from torch import Tensor

from .int4 import Int4Rows, Matrix, int4_linear
from .kquant import QuantRows, as_int4, kquant_linear
from .linear import Linear

log = logging.getLogger(__name__)


def as_linear(parts: list[Matrix], biases: list[Tensor | None], dtype: torch.dtype, int4: bool,
              device: torch.device, dense_copy: bool = False) -> Linear:
    """`int4`: 4-bit and block matrices stay on the 4-bit / block kernels (else they run as floats
    of `dtype`); `dense_copy`: an int4 matrix keeps a bfloat16 copy for prefill (int4.int4_linear)."""
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(rows(p)) for b, p in zip(biases, parts)])
        bias = bias.to(device, dtype)
    parts = [as_int4(p) for p in parts]  # a GGUF's Q4 blocks, decoded as their layer is built
    if int4 and all(isinstance(p, Int4Rows) for p in parts):
        return int4_linear(Int4Rows.cat(parts) if len(parts) > 1 else parts[0], bias, dense_copy)
    if int4 and all(isinstance(p, (Int4Rows, QuantRows)) for p in parts):
        own = kquant_linear(parts, bias)  # GGUF's Q8_0 / K-quant blocks, a type a segment
        if own is not None:
            return own
        log.warning("a %s matrix does not fit specchat's kernels here; it runs as floats",
                    "/".join(sorted({p.type for p in parts if isinstance(p, QuantRows)})))
    mats = [p.dequantize() if isinstance(p, (Int4Rows, QuantRows)) else p for p in parts]
    dense = mats[0] if len(mats) == 1 else torch.cat(mats)  # a tied float32 head shares the embedding
    return Linear(dense.to(device, dtype).contiguous(), bias)


def rows(m: Matrix) -> int:
    return m.q.shape[0] if isinstance(m, Int4Rows) else m.rows if isinstance(m, QuantRows) else m.shape[0]
