"""GGUF's quantized matrices kept in their own blocks (`QuantRows`, views of the file) and repacked
once into the tiles of specchat's kernels (kernels/kquant.h; Q4_0 / Q4_1 through Int4Rows into
q4.h's), as ggml's CPU "repack" buffers do: Q8_0, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, Q6_K and IQ4_XS,
and F16 / BF16 matrices as their own 16-bit values (kernels/f16.h).
The engine holds about the file's bytes (4.625 bits a weight for Q4_K's 4.5, 5.625 for Q5_K's
5.5, the file's own for the others), never a float copy, and every row of a verify block has its
one-row bits (tests/native/test_kquant_kernel.py). A big head runs on the same tiles and the
embedding is read from them (`head_on_tiles`, `TileEmbedding`).

The block layouts are ggml's (ggml-common.h; ../shared/reference/gguf-kquants-trees-dspark.md §1);
`decode` returns the blocks' integers and factors, from which `dequantize` rebuilds the weights
exactly as gguf's own `dequantize` does (tested), and `pack` the tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import memory_plan
from .int4 import Int4Rows
from .linear import Q4_TILES, Linear

# GGUF type id (ggml.h's ggml_type) and the bytes and weights of one block in the file (for F16 and
# BF16, whose file holds plain 16-bit values, 32 of them: what their tiles take at a time)
TYPES = {name: (type_id, size, memory_plan.BLOCK_INPUTS[name]) for name, type_id, size in (
    ("Q8_0", 8, 34), ("Q4_K", 12, 144), ("Q5_K", 13, 176), ("Q6_K", 14, 210), ("Q5_0", 6, 22), ("Q5_1", 7, 24),
    ("IQ4_NL", 20, 18), ("IQ4_XS", 23, 136), ("F16", 1, 64), ("BF16", 30, 64))}
# the 16-bit float types (kernels/f16.h: tiles of the file's own values, float activations)
FLOAT16_TYPES = {"F16": torch.float16, "BF16": torch.bfloat16}
# tile bytes per 16 columns x 32 inputs (kquant.h's structs, a super-block's share for K-quants)
TILE_BYTES = {t: int(memory_plan.TILE_BYTES[t] * 512) for t in TYPES}
COLS = 16
# Q4_0 / Q4_1: kept as the file's blocks until their layer is built, then the 4-bit kernel's Int4Rows
Q4_TYPES = {"Q4_0": (2, 18, 32), "Q4_1": (3, 20, 32)}  # (memory_plan.Q4_TYPES)
# ggml's kvalues_iq4nl: the weight an IQ4 index stands for, before the block's scale
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass
class QuantRows:
    """A matrix [rows, cols] as the file's blocks: `raw`, uint8 [rows, bytes a row]."""

    type: str  # a key of TYPES
    raw: Tensor
    cols: int

    @property
    def rows(self) -> int:
        return self.raw.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def take(self, index: Tensor) -> "QuantRows":
        """These rows, in this order (llama.cpp's Q/K row permutation undone: gguf_loader.py)."""
        return QuantRows(self.type, self.raw[index], self.cols)

    def dequantize(self) -> Tensor:
        """float32 [rows, cols], from the blocks' integers and factors (bit for bit gguf's dequantize;
        Q4 as Int4Rows dequantizes)."""
        return self.as_int4().dequantize() if self.type in Q4_TYPES else dequantize(self)

    def as_int4(self) -> Int4Rows:
        """Q4_0 / Q4_1 blocks -> Int4Rows. A block holds 32 weights: fp16 d, (fp16 m,) 16 bytes of
        nibbles where the low nibbles are weights 0..15 and the high nibbles weights 16..31."""
        has_min = self.type == "Q4_1"
        blocks = self.raw.view(self.rows, -1, 20 if has_min else 18)
        d = _half(blocks[..., 0:2])
        qs = blocks[..., 4:20] if has_min else blocks[..., 2:18]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(self.rows, -1)
        if has_min:
            return Int4Rows(q, d, _half(blocks[..., 2:4]) + 8 * d)
        return Int4Rows(q, d, torch.zeros_like(d))

    @staticmethod
    def cat(parts: list["QuantRows"]) -> "QuantRows":
        return QuantRows(parts[0].type, torch.cat([p.raw for p in parts]), parts[0].cols)

    @staticmethod
    def from_blocks(type_name: str, data, rows: int, cols: int) -> "QuantRows":
        """A tensor's bytes as gguf's reader gives them (a read-only numpy view of the file) ->
        QuantRows over the same bytes, not a copy: only the tiles packed from them are held once a
        model is built, and while it is built the file's pages are the page cache's."""
        import warnings

        import numpy as np

        with warnings.catch_warnings():  # read-only: nothing here writes to the blocks
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.asarray(data).view(np.uint8))
        return QuantRows(type_name, raw.view(rows, -1), cols)


def is_q4(m) -> bool:
    return isinstance(m, QuantRows) and m.type in Q4_TYPES


def as_int4(m):
    """A Q4 QuantRows as Int4Rows (decoded now, its layer being built); anything else as it is."""
    return m.as_int4() if is_q4(m) else m


def has_blocks(layers: list[dict]) -> bool:
    """Whether a checkpoint's layers hold blocks for specchat's kernels (Q4_0/Q4_1, Q8_0, K-quants)."""
    return any(isinstance(m, (Int4Rows, QuantRows)) for layer in layers for m in layer.values())


def activation_dtype(layers: list[dict]) -> torch.dtype:
    """What a model on the kernels computes its activations in: float32 where every kernel matrix is
    F16 / BF16 (their product is then the float product of the file's weights, as a person who keeps
    a 16-bit file expects; llama.cpp rounds activations to float16 there), else bfloat16 (torch's
    int4 kernel takes nothing else, and int8-quantized activations lose more than bfloat16 does)."""
    kinds = {m.type if isinstance(m, QuantRows) else "Q4" for layer in layers for m in layer.values()
             if isinstance(m, (Int4Rows, QuantRows))}
    return torch.float32 if kinds and kinds <= set(FLOAT16_TYPES) else torch.bfloat16


def fits(m: QuantRows) -> bool:
    """Whether the kernel takes this shape: 16 output columns a tile, whole super-blocks along K."""
    return m.rows % COLS == 0 and m.cols % TYPES[m.type][2] == 0


def _half(b: Tensor) -> Tensor:
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _blocks(m: QuantRows) -> Tensor:
    _, size, n = TYPES[m.type] if m.type in TYPES else Q4_TYPES[m.type]
    return m.raw.view(m.rows, m.cols // n, size)


def _scale_min_k4(s: Tensor) -> tuple[Tensor, Tensor]:
    """The 8 six-bit scales and mins of a Q4_K / Q5_K super-block from its 12 bytes [..., 12]
    (ggml's get_scale_min_k4) -> two uint8 [..., 8]."""
    lo = (s[..., 0:4] & 63, s[..., 4:8] & 63)
    hi = ((s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4), (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4))
    return torch.cat([lo[0], hi[0]], -1), torch.cat([lo[1], hi[1]], -1)


def decode(m: QuantRows) -> dict[str, Tensor]:
    """The blocks' parts, per row: `u` uint8 [rows, cols] (the unsigned integers the kernel
    multiplies), `d` float32 [rows, blocks], and per type `sc` / `m` (6-bit, per 32), `dmin`
    (Q4_K, Q5_K) or `sc` int8 per 16 (Q6_K); Q8_0's u is q + 128 and Q6_K's is q + 32."""
    b, N = _blocks(m), m.rows
    if m.type in ("Q5_0", "Q5_1", "IQ4_NL"):  # blocks of 32: byte j holds weights j (low) and j + 16 (high)
        qs = b[..., -16:]
        low = torch.cat([qs & 15, qs >> 4], dim=-1)  # [N, blocks, 32]
        parts = {"d": _half(b[..., 0:2])}
        if m.type == "IQ4_NL":
            parts["i"] = low.reshape(N, -1)
            parts["u"] = (torch.tensor(IQ4_VALUES) + 128).to(torch.uint8)[low.long()].reshape(N, -1)
            return parts
        at = 2 if m.type == "Q5_0" else 4  # Q5_1: d, m, then the high bits
        qh = b[..., at:at + 4].contiguous().view(torch.int32)  # bit j: the fifth bit of weight j
        high = ((qh >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)
        parts["u"] = (low | (high << 4)).reshape(N, -1)
        if m.type == "Q5_1":
            parts["m"] = _half(b[..., 2:4])
        return parts
    if m.type == "IQ4_XS":  # d, scales_h (2 bits a block), scales_l (4 bits a block), 16 bytes a block
        qs = b[..., 8:136].reshape(N, -1, 8, 16)
        idx = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(N, -1)
        j = torch.arange(8, dtype=torch.int32)
        high = (b[..., 2:4].contiguous().view(torch.int16).to(torch.int32) >> (2 * j)) & 3
        low = (b[..., 4:8].to(torch.int32).repeat_interleave(2, dim=-1) >> (4 * (j % 2))) & 15
        return {"i": idx, "u": (torch.tensor(IQ4_VALUES) + 128).to(torch.uint8)[idx.long()],
                "d": _half(b[..., 0:2]), "sc": ((low | (high << 4)) - 32).to(torch.int8).reshape(N, -1)}
    if m.type == "Q8_0":
        return {"u": (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8).reshape(N, -1),
                "d": _half(b[..., 0:2])}
    if m.type in ("Q4_K", "Q5_K"):
        sc, mn = _scale_min_k4(b[..., 4:16])
        qs = b[..., -128:].reshape(N, -1, 4, 32)  # chunk c: low nibbles block 2c, high ones 2c + 1
        u = torch.stack([qs & 15, qs >> 4], dim=3).reshape(N, -1, 256)
        if m.type == "Q5_K":  # bit j of qh[l]: the fifth bit of weight l of block j
            qh = b[..., 16:48]
            u = u | (((qh[:, :, None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1) << 4).reshape(N, -1, 256)
        return {"u": u.reshape(N, -1), "d": _half(b[..., 0:2]), "dmin": _half(b[..., 2:4]),
                "sc": sc.reshape(N, -1), "m": mn.reshape(N, -1)}
    # Q6_K: each 128-half, quarter q, weight l: ql[64 n + 32 (q % 2) + l] nibble q // 2, qh[32 n + l] bits 2q
    ql = b[..., 0:128].reshape(N, -1, 2, 1, 2, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(N, -1, 2, 4, 32)
    qh = b[..., 128:192].reshape(N, -1, 2, 1, 32)
    high = (qh >> (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)) & 3
    return {"u": (low | (high << 4)).reshape(N, -1), "d": _half(b[..., 208:210]),
            "sc": b[..., 192:208].contiguous().view(torch.int8).reshape(N, -1)}


def dequantize(m: QuantRows) -> Tensor:
    if m.type in FLOAT16_TYPES:
        return m.raw.contiguous().view(FLOAT16_TYPES[m.type]).float()
    p, N = decode(m), m.rows

    def per(t: Tensor, span: int) -> Tensor:  # [N, groups] -> [N, cols]
        return t.float().repeat_interleave(span, dim=1)

    if m.type in ("Q8_0", "IQ4_NL"):
        return (p["u"].float() - 128) * per(p["d"], 32)
    if m.type == "IQ4_XS":
        return (per(p["d"], 256) * per(p["sc"], 32)) * (p["u"].float() - 128)
    if m.type == "Q5_0":
        return (p["u"].float() - 16) * per(p["d"], 32)
    if m.type == "Q5_1":
        return per(p["d"], 32) * p["u"].float() + per(p["m"], 32)
    if m.type == "Q6_K":
        return per(p["d"], 256) * (per(p["sc"], 16) * (p["u"].float() - 32))
    d, dmin = per(p["d"], 256), per(p["dmin"], 256)
    return (d * per(p["sc"], 32)) * p["u"].float() - dmin * per(p["m"], 32)


def _operands(u: Tensor, N: int, K: int) -> Tensor:
    """[N, K] -> [N / 16, K / 32, 8, 16, 4]: per tile, 8 VNNI operands of 4 consecutive k of 16 columns."""
    return u.view(N // COLS, COLS, K // 32, 8, 4).permute(0, 2, 3, 1, 4)


def _nibbles(u: Tensor, N: int, K: int) -> Tensor:
    """The low 4 bits in q4_tile's order (q4.h) -> [N / 16, K / 32, 256]."""
    v = (u & 15).view(N // COLS, COLS, K // 32, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # [nb, kb, h, g, c, t]
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(N // COLS, K // 32, 256)


def _columns(t: Tensor, N: int) -> Tensor:
    """A per-row factor [N, groups] -> [N / 16, groups, 16]: the 16 columns of a tile side by side."""
    return t.view(N // COLS, COLS, -1).transpose(1, 2)


def _bytes(t: Tensor) -> Tensor:
    return t.contiguous().view(torch.uint8)


def _bit_planes(bits: Tensor, width: int, dim: int) -> Tensor:
    """OR together the values along `dim` (small integers), the j-th shifted left by width * j: a byte
    of bit fields, in uint8 throughout (no wider temporaries beside a big matrix)."""
    out = bits.select(dim, 0).clone()
    for j in range(1, bits.shape[dim]):
        out |= bits.select(dim, j) << (width * j)
    return out


PACK_ROWS = 2048  # rows packed at a time: a big head's temporaries stay tens of MB


def pack(m: QuantRows) -> Tensor:
    """The kernel's tiles, uint8 [rows / 16, bytes a column block] (kernels/kquant.h), packed a
    slice of rows at a time."""
    tiles = torch.empty(m.rows // COLS, m.cols // 32 * TILE_BYTES[m.type], dtype=torch.uint8)
    for lo in range(0, m.rows, PACK_ROWS):
        part = QuantRows(m.type, m.raw[lo:lo + PACK_ROWS], m.cols)
        tiles[lo // COLS:(lo + part.rows) // COLS] = _pack(part)
    return tiles


def _pack(m: QuantRows) -> Tensor:
    N, K = m.shape
    if m.type in FLOAT16_TYPES:  # f16.h: k-major, the 16 columns' values of each input side by side
        return m.raw.contiguous().view(N // COLS, COLS, K, 2).transpose(1, 2).reshape(N // COLS, -1)
    p, nb, kb, ns = decode(m), N // COLS, K // 32, K // 256

    def half_bytes(t: Tensor, groups: int) -> Tensor:  # float16 factors [N, groups] -> [nb, groups, 32]
        return _bytes(_columns(t, N).to(torch.float16)).view(nb, groups, 32)

    if m.type in ("Q5_0", "Q5_1", "IQ4_NL"):
        parts = [_nibbles(p["i"] if m.type == "IQ4_NL" else p["u"], N, K)]
        if m.type != "IQ4_NL":  # bit 4 of operand i at bit i of its byte
            parts.append(_bit_planes(_operands(p["u"], N, K) >> 4, 1, 2).reshape(nb, kb, 64))
        parts.append(half_bytes(p["d"], kb))
        if m.type == "Q5_1":
            parts.append(half_bytes(p["m"], kb))
        return torch.cat(parts, -1).reshape(nb, -1)
    if m.type == "IQ4_XS":
        nibbles = _nibbles(p["i"], N, K).view(nb, ns, 8 * 256)
        sc = _bytes(_columns(p["sc"], N)).view(nb, ns, 8 * COLS)
        return torch.cat([nibbles, sc, half_bytes(p["d"], ns)], -1).reshape(nb, -1)
    if m.type == "Q8_0":
        u = _operands(p["u"], N, K).reshape(nb, kb, 512)
        d = _bytes(_columns(p["d"], N).to(torch.float16)).view(nb, kb, 32)
        return torch.cat([u, d], -1).reshape(nb, -1)
    nibbles = _nibbles(p["u"], N, K).view(nb, ns, 8 * 256)
    d = _bytes(_columns(p["d"], N).to(torch.float16)).view(nb, ns, 32)
    if m.type == "Q6_K":  # bits 4..5 of operand i at bits 2 (i % 4) of half i // 4's byte
        high = _bit_planes((_operands(p["u"], N, K) >> 4).reshape(nb, kb, 2, 4, COLS, 4), 2, 3).reshape(nb, ns, 8 * 2 * 64)
        sc = _bytes(_columns(p["sc"], N)).view(nb, ns, 16 * COLS)
        return torch.cat([nibbles, high, sc, d], -1).reshape(nb, -1)
    parts = [nibbles, _columns(p["sc"], N).reshape(nb, ns, 8 * COLS), _columns(p["m"], N).reshape(nb, ns, 8 * COLS), d,
             _bytes(_columns(p["dmin"], N).to(torch.float16)).view(nb, ns, 32)]
    if m.type == "Q5_K":  # bit 4 of operand i at bit i of its byte
        parts.append(_bit_planes(_operands(p["u"], N, K) >> 4, 1, 2).reshape(nb, ns, 8 * 64))
    return torch.cat(parts, -1).reshape(nb, -1)


def type_id(name: str) -> int:
    return TYPES[name][0]


def kquant_linear(parts: list, bias: Tensor | None = None):
    """A Linear over `parts` (QuantRows and Int4Rows, stacked by rows, all of one input width) on
    specchat's kernels: neighbouring parts of one type run as one segment. None where a part's
    shape does not fit the tiles or the kernels cannot be built here (the caller then runs floats)."""
    from . import q4_kernel

    if not q4_kernel.available():
        return None
    groups: list[list] = []
    for p in parts:
        kind = Q4_TILES if isinstance(p, Int4Rows) else type_id(p.type)
        if groups and groups[-1][0] == kind:
            groups[-1][1].append(p)
        else:
            groups.append([kind, [p]])
    tiles, layout = [], []
    for kind, members in groups:
        if kind == Q4_TILES:
            w = Int4Rows.cat(members) if len(members) > 1 else members[0]
            if not q4_kernel.fits(w):
                return None
            tiles.append(q4_kernel.pack(w).reshape(w.q.shape[0] // COLS, -1))
            layout.append((kind, w.q.shape[0]))
        else:
            m = QuantRows.cat(members) if len(members) > 1 else members[0]
            if not fits(m):
                return None
            tiles.append(pack(m))
            layout.append((kind, m.rows))
    width = parts[0].q.shape[1] if isinstance(parts[0], Int4Rows) else parts[0].cols
    return Linear(None, bias, kq=tuple(tiles), kq_layout=tuple(layout), kq_in=width)


class TileEmbedding:
    """An embedding looked up in the kernel's tiles of the same matrix (the head's, where the
    model ties them): each row as the file's blocks define it, so a big vocabulary is held once,
    in the file's type, instead of as float32 (4 bytes a weight). Indexed as a tensor is."""

    def __init__(self, tiles: Tensor, kind: int, vocab: int, dim: int):
        self.tiles, self.kind, self.vocab, self.dim = tiles, kind, vocab, dim

    def __getitem__(self, ids: Tensor) -> Tensor:
        rows = torch.ops.specchat.kq_rows(self.tiles, self.kind, self.dim, ids.reshape(-1))
        return rows.view(*ids.shape, self.dim)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.vocab, self.dim))

    @property
    def device(self) -> torch.device:
        return self.tiles.device

    dtype = torch.float32

    def float(self) -> Tensor:
        """The whole table as float32 (a drafter's trainer, a tied float head): a copy, on request."""
        return self[torch.arange(self.vocab)]


def on_tiles(m, bias: Tensor | None = None):
    """A single quantized matrix (QuantRows or Int4Rows) as a Linear on the kernels and its rows as a
    TileEmbedding over the same tiles; None where it does not fit them."""
    lin = kquant_linear([m], bias)
    if lin is None:
        return None
    (kind, rows), = lin.kq_layout
    return lin, TileEmbedding(lin.kq[0], kind, rows, lin.kq_in)


def float_embedding(embed) -> Tensor:
    """An embedding's rows as float32 (bfloat16 kept as it is: its rows are widened when looked up)."""
    if isinstance(embed, (Int4Rows, QuantRows)):
        return embed.dequantize()
    return embed if embed.dtype == torch.bfloat16 else embed.float()


def head_on_tiles(ck) -> tuple[object, Linear | None]:
    """A Checkpoint's (weights.py) (embedding, head) on specchat's kernels in the file's types, where
    the head is big (memory_plan.HEAD_FLOAT_MAX_BYTES) or F16 / BF16 and its blocks fit the tiles; else (None,
    None). An untied embedding gets tiles of its own where its type has them, else it is float32."""
    source = ck.head if ck.head is not None else ck.embed
    if not isinstance(source, QuantRows) or is_q4(source) or (  # a 16-bit head's tiles are its float32 logits
            4 * source.rows * source.cols <= memory_plan.HEAD_FLOAT_MAX_BYTES and source.type not in FLOAT16_TYPES):
        return None, None
    tied = on_tiles(source)
    if tied is None:
        return None, None
    head, embed = tied
    if ck.head is not None:
        own = on_tiles(ck.embed) if isinstance(ck.embed, QuantRows) else None
        embed = own[1] if own is not None else float_embedding(ck.embed)
    memory_plan.page_out([m.raw for m in (ck.head, ck.embed) if isinstance(m, QuantRows)])  # packed now
    return embed, head
