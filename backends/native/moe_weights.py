"""A mixture-of-experts MLP's tensors, from safetensors to `moe.RoutedExperts`.

Tensor names under a layer's prefix (../shared/reference/hybrid-moe-eagle3.md, 1.7 and 3):
- router `mlp.gate.weight` [experts, dim]; GLM-4.5's `mlp.gate.e_score_correction_bias` [experts];
- experts, either per expert, `mlp.experts.{e}.{gate,up,down}_proj.weight` (as the published
  Qwen3-MoE / GLM-4.5 / Qwen3-Next checkpoints and transformers' save_pretrained write them), or
  fused, `mlp.experts.gate_up_proj` [experts, 2 x expert_dim, dim] (gate rows first) and
  `mlp.experts.down_proj` [experts, dim, expert_dim] (transformers' in-memory layout, which some
  checkpoints ship); any other is named in one line;
- shared expert `mlp.shared_expert.*` (Qwen, with `mlp.shared_expert_gate.weight` [1, dim]) or
  `mlp.shared_experts.*` (GLM-4.5).

Experts are read one at a time while the model is built (`ExpertWeights.matrices`) and turned into
their compute form at once (the profile's dtype, or int4 on CPU): a 30B-A3B model's experts never
sit in memory as float32 all together.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from ..base import BackendError
from ..weight_files import open_safetensors
from .config import COMPLETE, MoeShape
from .int4 import Int4Rows, Matrix, int4_linear
from .kquant import QuantRows
from .layers import GatedMLP
from .linear import Linear
from .matrix import as_linear
from .moe import Router, RoutedExperts

EXPERTS = "mlp.experts."
PER_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
FUSED = {"gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj"}
ROUTER, ROUTER_BIAS = "mlp.gate.weight", "mlp.gate.e_score_correction_bias"
SHARED_GATE = "mlp.shared_expert_gate.weight"
SHARED_PREFIXES = ("mlp.shared_expert.", "mlp.shared_experts.")
# a layer's tensors that say it is a mixture of experts, whatever layout the rest has
MOE_MARKERS = ("mlp.experts.", "mlp.gate.weight", "mlp.shared_expert", "mlp.router.", "block_sparse_moe.")
KNOWN_LAYOUTS = ("experts.{e}.{gate,up,down}_proj.weight, or fused experts.gate_up_proj and experts.down_proj")


class TensorReader:
    """Tensors of a checkpoint read on demand (float32), files opened once."""

    def __init__(self, where: dict[str, Path]):
        self.where = where
        self.files: dict[Path, object] = {}

    def _file(self, name: str):
        f = self.where[name]
        if f not in self.files:
            self.files[f] = open_safetensors(f)
        return self.files[f]

    def get(self, name: str) -> Tensor:
        return self._file(name).get_tensor(name).float()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def row(self, name: str, i: int) -> Tensor:
        """t[i] of a stacked tensor, without reading the rest."""
        return self._file(name).get_slice(name)[i].float()


@dataclass
class ExpertWeights:
    """A sparse layer's experts in the checkpoint, read when built."""
    reader: TensorReader
    prefix: str  # the layer's
    fused: bool
    count: int

    def matrices(self, e: int) -> tuple[Tensor, Tensor, Tensor]:
        """Expert e's gate [I, dim], up [I, dim] and down [dim, I], float32."""
        if self.fused:
            gate, up = self.reader.row(self.prefix + FUSED["gate_up"], e).chunk(2, dim=0)
            return gate, up, self.reader.row(self.prefix + FUSED["down"], e)
        return tuple(self.reader.get(f"{self.prefix}mlp.experts.{e}.{part}_proj.weight") for part in ("gate", "up", "down"))

    def file_blocks(self) -> list:
        """Nothing mapped from the file to hand back (a GGUF's experts have: gguf_loader.GgufExperts)."""
        return []


def is_expert_tensor(name: str) -> bool:
    return f".{EXPERTS}" in name


def moe_layer_names(names, prefix: str) -> list[str]:
    """The tensors under `prefix` that belong to a mixture-of-experts MLP."""
    return sorted(n for n in names if n.startswith(prefix) and any(n[len(prefix):].startswith(m) for m in MOE_MARKERS))


def read_moe_layer(take: Callable[[str], Tensor], names, reader: TensorReader, prefix: str, shape: MoeShape,
                   dim: int, source: str, what: str) -> dict:
    """A sparse layer's MLP: router (and bias), shared expert(s) and their gate read with `take`,
    experts left in the checkpoint (`ExpertWeights`). `names`: every tensor name in the checkpoint;
    `what`: the layer, as errors name it. A layout it does not know is a BackendError naming it."""
    mine = moe_layer_names(names, prefix)
    experts = {n for n in mine if n[len(prefix):].startswith(EXPERTS)}
    fused = prefix + FUSED["gate_up"] in names
    known = {prefix + FUSED["gate_up"], prefix + FUSED["down"]} if fused else {
        n for n in experts if (m := PER_EXPERT.fullmatch(n[len(prefix):])) and int(m.group(1)) < shape.experts}
    unknown = [n for n in mine if (n in experts and n not in known) or n[len(prefix):].startswith(
        ("block_sparse_moe.", "mlp.router."))]
    if unknown or prefix + ROUTER not in names:
        example = (unknown or sorted(experts) or mine or [f"{prefix}{ROUTER} (absent)"])[0]
        raise BackendError(f"{source}: {what} has its experts in a layout the torch engine does not know ({example}); "
                           f"it reads {KNOWN_LAYOUTS} with the router mlp.gate.weight; use backend: llamacpp "
                           "or a server (backend: openai)")
    out = {"router": take(prefix + ROUTER)}
    _check(out["router"], (shape.experts, dim), prefix + ROUTER, source)
    if prefix + ROUTER_BIAS in names:
        out["router_bias"] = take(prefix + ROUTER_BIAS)
        _check(out["router_bias"], (shape.experts,), prefix + ROUTER_BIAS, source)
    I = shape.expert_dim
    if fused:
        want = {FUSED["gate_up"]: (shape.experts, 2 * I, dim), FUSED["down"]: (shape.experts, dim, I)}
        for name, dims in want.items():
            if prefix + name not in names:
                raise BackendError(f"{source}: tensor {prefix + name} missing (fused experts); {COMPLETE}")
            _check(reader.shape(prefix + name), dims, prefix + name, source)
    else:
        for e in range(shape.experts):
            for part, dims in (("gate", (I, dim)), ("up", (I, dim)), ("down", (dim, I))):
                name = f"{prefix}mlp.experts.{e}.{part}_proj.weight"
                if name not in names:
                    raise BackendError(f"{source}: tensor {name} missing (config.json gives {shape.experts} experts); "
                                       f"{COMPLETE}")
                if e == 0:
                    _check(reader.shape(name), dims, name, source)
    out["experts"] = ExpertWeights(reader, prefix, fused, shape.experts)
    shared = next((p for p in SHARED_PREFIXES if prefix + p + "gate_proj.weight" in names), None)
    if shape.shared_dim and shared is None:
        raise BackendError(f"{source}: {what} has no shared expert ({prefix}mlp.shared_expert(s).*), which "
                           f"config.json gives ({shape.shared_dim} wide); {COMPLETE}")
    if shared is not None:
        for part in ("gate", "up", "down"):
            out[f"shared_{part}"] = take(f"{prefix}{shared}{part}_proj.weight")
        S = out["shared_gate"].shape[0]
        for part, dims in (("gate", (S, dim)), ("up", (S, dim)), ("down", (dim, S))):
            _check(out[f"shared_{part}"], dims, f"{prefix}{shared}{part}_proj.weight", source)
    if shape.shared_gate and shared is not None:
        if prefix + SHARED_GATE not in names:
            raise BackendError(f"{source}: tensor {prefix + SHARED_GATE} missing; {COMPLETE}")
        out["shared_expert_gate"] = take(prefix + SHARED_GATE)
        _check(out["shared_expert_gate"], (1, dim), prefix + SHARED_GATE, source)
    return out


def _check(t, want: tuple[int, ...], name: str, source: str) -> None:
    got = tuple(t.shape) if isinstance(t, Tensor) else tuple(t)
    if got != want:
        raise BackendError(f"{source}: {name} has shape {got}, config.json's expert keys give {want}; {COMPLETE}")


def _matrix(parts: list[Matrix], dtype: torch.dtype, int4: bool, device: torch.device) -> Linear:
    if any(isinstance(p, QuantRows) for p in parts):  # a GGUF's experts: on its dense matrices' kernels
        return as_linear(parts, [None] * len(parts), dtype, int4, device)
    if int4 and all(isinstance(p, Int4Rows) for p in parts):  # a shared expert quantized when read
        return int4_linear(parts[0] if len(parts) == 1 else Int4Rows.cat(parts))
    parts = [p.dequantize() if isinstance(p, Int4Rows) else p for p in parts]
    # a new tensor, not a view of the file's bytes: a matmul's rounding may depend on where its weights lie
    w = parts[0].clone() if len(parts) == 1 else torch.cat(parts)
    if int4 and Int4Rows.fits(w):  # the experts are most of a MoE model's bytes: 4-bit on CPU
        return int4_linear(w)
    return Linear(w.to(device, dtype).contiguous())


def build_moe(layer: dict, shape: MoeShape, dtype: torch.dtype, int4: bool, device: torch.device) -> RoutedExperts:
    """The MLP `read_moe_layer` read, its experts now read one at a time and put in compute form."""
    source: ExpertWeights = layer["experts"]  # or a GGUF's (gguf_loader.GgufExperts): the same methods
    experts = []
    for e in range(source.count):
        gate, up, down = source.matrices(e)
        experts.append(GatedMLP(_matrix([gate, up], dtype, int4, device), _matrix([down], dtype, int4, device)))
    shared = None
    if "shared_gate" in layer:
        shared = GatedMLP(_matrix([layer["shared_gate"], layer["shared_up"]], dtype, int4, device),
                          _matrix([layer["shared_down"]], dtype, int4, device))
    def dev(key: str) -> Tensor | None:
        return None if key not in layer else layer[key].float().to(device)

    router = Router(shape, dev("router"), dev("router_bias"), dev("shared_expert_gate"))
    return RoutedExperts(router, experts, shared)


def moe_bytes(shape: MoeShape, dim: int, bytes_per_weight: float) -> dict[str, float]:
    """Bytes of one sparse layer's MLP: all of it, and what one token reads (its top-k experts,
    the shared expert and the router)."""
    expert = 3 * shape.expert_dim * dim * bytes_per_weight
    shared = 3 * shape.shared_dim * dim * bytes_per_weight
    router = (shape.experts + shape.shared_gate) * dim * 4
    return {"all": shape.experts * expert + shared + router, "token": shape.top_k * expert + shared + router}
