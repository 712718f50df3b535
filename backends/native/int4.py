"""Group-wise 4-bit weights on torch's CPU int4 kernel: GGUF Q4_0/Q4_1 blocks kept as they are,
or float matrices quantized for drafters that run beside an int4 target."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .linear import Linear

INT4_GROUP = 32


@dataclass
class Int4Rows:
    """Group-wise 4-bit weights, groups of 32 along the input: w = (q - 8) * scale + zero.

    GGUF Q4_1 (w = d*q + m) is scale d, zero m + 8d; Q4_0 (w = d*(q - 8)) is scale d, zero 0.
    """

    q: Tensor  # uint8 [out, in], values 0..15
    scale: Tensor  # float32 [out, in / 32]
    zero: Tensor  # float32 [out, in / 32]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> Tensor:
        def expand(t: Tensor) -> Tensor:
            return t.repeat_interleave(INT4_GROUP, dim=1)
        return (self.q.float() - 8) * expand(self.scale) + expand(self.zero)

    @staticmethod
    def quantize(w: Tensor) -> "Int4Rows":
        """Round-to-nearest group-wise 4-bit weights for a float matrix [out, in] (in % 32 == 0):
        each group's range [min, max] in 16 steps."""
        g = w.float().reshape(w.shape[0], -1, INT4_GROUP)
        low, high = g.amin(-1), g.amax(-1)
        scale = ((high - low) / 15).clamp_min(1e-12)
        q = ((g - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
        return Int4Rows(q.reshape(w.shape), scale, low + 8 * scale)

    @staticmethod
    def fits(w: Tensor) -> bool:
        """Whether torch's CPU int4 kernel takes this matrix shape."""
        return w.dim() == 2 and w.shape[1] % INT4_GROUP == 0 and w.shape[0] % 8 == 0

    @staticmethod
    def cat(parts: list["Int4Rows"]) -> "Int4Rows":
        return Int4Rows(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                        torch.cat([p.zero for p in parts]))


Matrix = Tensor | Int4Rows


def int4_linear(w: Matrix, bias: Tensor | None = None, dense_copy: bool = False) -> Linear:
    """A Linear on specchat's 4-bit CPU kernel where it is built and the shape fits (q4_kernel.py),
    else on torch's CPU int4 kernel (bfloat16 in and out); float weights are quantized.
    dense_copy: also keep the weights as bfloat16 for many-row passes (see `Linear`)."""
    from . import q4_kernel

    w = w if isinstance(w, Int4Rows) else Int4Rows.quantize(w)
    own = q4_kernel.fits(w) and q4_kernel.available()
    dense = None
    if dense_copy:  # from the scales and offsets the kernel itself uses
        if own:
            scale = w.scale.to(torch.float16).float()
            offset = (w.zero.float() - 8 * w.scale.float()).to(torch.float16).float()
            dense = w.q.float() * scale.repeat_interleave(INT4_GROUP, 1) + offset.repeat_interleave(INT4_GROUP, 1)
        else:
            scale, zero = (t.to(torch.bfloat16).float().repeat_interleave(INT4_GROUP, dim=1) for t in (w.scale, w.zero))
            dense = (w.q.float() - 8) * scale + zero
        dense = dense.to(torch.bfloat16)
    if own:
        return Linear(None, bias, q4=q4_kernel.pack(w), out=w.q.shape[0], dense=dense)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1)
    sz = torch.stack([w.scale.t(), w.zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return Linear(None, bias, int4=(packed, sz, INT4_GROUP), dense=dense)


def int4_if_fits(w: Tensor, dtype: torch.dtype, device: torch.device | str = "cpu") -> Linear:
    """A drafter's matrix beside an int4 target: on the int4 kernel where its shape fits (about 3x
    faster than dense on CPU; a drafter's arithmetic changes how often it guesses right, never
    what is emitted), else dense in `dtype`."""
    return int4_linear(w) if Int4Rows.fits(w) else Linear(w.to(device, dtype).contiguous())


# a layer's matrices under short names (weights.py, moe_weights.py): attention, dense MLP, shared
# expert, linear attention; never a router, whose choices want its float32 scores
MATRIX_KEYS = ("q", "k", "v", "o", "gate", "up", "down", "shared_gate", "shared_up", "shared_down",
               "qkv", "z", "b", "a", "out")


def quantize_layer(layer: dict[str, Matrix]) -> dict[str, Matrix]:
    """The layer with every float matrix the int4 kernel takes quantized to Int4Rows."""
    return {k: Int4Rows.quantize(v) if k in MATRIX_KEYS and isinstance(v, Tensor) and Int4Rows.fits(v) else v
            for k, v in layer.items()}
