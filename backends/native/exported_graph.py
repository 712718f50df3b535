"""A compiled decode graph as an ahead-of-time package: exported once, loaded by later starts in
milliseconds, with neither tracing nor a C++ compiler.

torch.export captures `exact_rows.all_layers` for rows of one key span, and AOTInductor compiles
it to a shared library packaged in a `.pt2` file (the same Inductor kernels torch.compile
generates: the rows get the same bits). Loading is a `dlopen`; it needs no `torch._dynamo`
(whose import alone takes seconds) and runs no compiler, where torch's precompiled graphs
(`load_compiled_function`) did both on every start. Re-measure: `time specchat run -p smollm2-fast
"Say hello."` on a warm store (docs/results.md).

Every tensor the graph reads is an input, never a constant: the weights and tables (`graph_tensors`,
in a fixed order) and the KV cache, which the graph writes in place. So a package holds no weights
(a few MB), serves any model of the same shapes, and reads the engine's own tensors at every call.
On a hybrid model (graph_state.py) the linear-attention layers' recurrent state is an input too,
and the state after the row an output (never written in place: the rollback keeps earlier ones).

Sizes are the only inputs an exported graph can take as symbols, so the position is passed as the
length of an empty tensor (`position_input`); offset by 2 so that it is never 0 or 1, sizes torch
specializes. A call outside the ranges the graph was exported for (`fits`) is the caller's to
run another way.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, NamedTuple

import torch
from torch import Tensor, nn

POSITION_OFFSET = 2  # see the module's docstring
MAX_ROWS = 256  # rows of one call of the K-row graph: verify blocks are far shorter


class Slot(NamedTuple):
    """Where a tensor the layers read lives: `module.name`, or item `index` of that tuple."""
    module: object
    name: str
    index: int | None

    def get(self) -> Tensor:
        value = getattr(self.module, self.name)
        return value if self.index is None else value[self.index]

    def put(self, tensor: Tensor) -> None:
        if self.index is not None:
            items = list(getattr(self.module, self.name))
            items[self.index] = tensor
            tensor = tuple(items)
        if isinstance(self.module, nn.Module) and self.name in self.module._parameters:
            self.module._parameters[self.name] = tensor
        else:
            self.module.__dict__[self.name] = tensor


def graph_tensors(model) -> list[Slot]:
    """Every tensor `all_layers` reads but the cache, in an order fixed by the model's structure:
    the RoPE tables, then each module's parameters and tensor attributes (a Linear's int4 tuple,
    its dense copy) by name."""
    slots = [Slot(model, "rope_cos", None), Slot(model, "rope_sin", None)]
    for module in model.layers.modules():
        names = set(module._parameters) | {k for k, v in vars(module).items()
                                           if not k.startswith("_") and isinstance(v, (Tensor, tuple))}
        for name in sorted(names):
            value = getattr(module, name)
            if isinstance(value, Tensor):
                slots.append(Slot(module, name, None))
            elif isinstance(value, tuple):
                slots += [Slot(module, name, i) for i, t in enumerate(value) if isinstance(t, Tensor)]
    return slots


def attention_caches(model) -> tuple[list[Tensor], list[Tensor]]:
    """The keys and values of the attention layers (a hybrid's linear layers have none)."""
    return [t for t in model.cache.k if t is not None], [t for t in model.cache.v if t is not None]


def with_gaps(model, tensors: list[Tensor]) -> list[Tensor | None]:
    """`tensors` (attention layers only) laid out as the cache's per-layer lists, None where a linear layer is."""
    items = iter(tensors)
    return [None if t is None else next(items) for t in model.cache.k]


@contextlib.contextmanager
def tensors_in(model, slots: list[Slot], tensors: list[Tensor], k: list[Tensor], v: list[Tensor]) -> Iterator[None]:
    """The model reading `tensors` in `slots` and the cache `k`, `v` (attention layers only), while tracing."""
    saved, cache = [s.get() for s in slots], (model.cache.k, model.cache.v)
    try:
        for slot, t in zip(slots, tensors):
            slot.put(t)
        model.cache.k, model.cache.v = with_gaps(model, k), with_gaps(model, v)
        yield
    finally:
        for slot, t in zip(slots, saved):
            slot.put(t)
        model.cache.k, model.cache.v = cache


def position_input(pos: int) -> Tensor:
    return torch.empty(1).expand(pos + POSITION_OFFSET)


def export_graph(all_layers: Callable, model, one_row: bool, keep_hidden: bool, example: tuple, path: str,
                 states: tuple | None = None) -> None:
    """Export `all_layers` (exact_rows.all_layers, or graph_state.hybrid_layers with `states`: a
    hybrid's (conv, ssm) lists) for `model` (rows of one key span; `example`: rows, position, key
    count, mask as `CompiledRowGraphs.example` makes them) and compile it to an AOTInductor package
    at `path`. Minutes on a small model (a single-token graph ~1 min for SmolLM2-135M on 2 cores)."""
    import torch._inductor
    from torch.export import Dim

    slots = graph_tensors(model)
    n_layers = len(model.layers)

    class AllLayers(nn.Module):
        def forward(self, x, pos, mask, tensors, k, v, conv=(), ssm=()):
            with tensors_in(model, slots, tensors, k, v):
                args = (model, x, pos.shape[0] - POSITION_OFFSET, mask.shape[-1], mask, keep_hidden)
                out, every, *state = all_layers(*args, conv, ssm) if states is not None else all_layers(*args)
            return (out, *(every[i] for i in range(n_layers) if keep_hidden), *(t for part in state for t in part))

    rows, pos, n_keys, mask = example
    kv, group = model.cfg.n_kv_heads, model.cfg.n_heads // model.cfg.n_kv_heads
    max_len = model.max_len
    keys = Dim("keys", min=2, max=max_len)
    if one_row:
        mask_dims = {3: keys}
        row_dims = None
        positions = Dim("pos", min=POSITION_OFFSET, max=max_len - 1 + POSITION_OFFSET)
    else:
        R = Dim("rows", min=2, max=min(MAX_ROWS, max_len))
        mask_dims = {2: group * R, 3: keys} if group > 1 else {1: kv * R, 3: keys}
        row_dims = {0: R}
        positions = Dim("pos", min=POSITION_OFFSET, max=max_len - 2 + POSITION_OFFSET)
    tensors = [s.get() for s in slots]
    # copies of the cache: an input that is also the model's attribute would be taken for a constant
    k, v = ([t.clone() for t in ts] for ts in attention_caches(model))
    dynamic = {"x": row_dims, "pos": {0: positions}, "mask": mask_dims,
               "tensors": [None] * len(tensors), "k": [None] * len(k), "v": [None] * len(v)}
    inputs = (rows, position_input(pos), mask, tensors, k, v)
    if states is not None:
        inputs += tuple(list(part) for part in states)
        dynamic.update(conv=[None] * len(states[0]), ssm=[None] * len(states[1]))
    with torch.no_grad():
        program = torch.export.export(AllLayers(), inputs, dynamic_shapes=dynamic, strict=False)
    torch._inductor.aoti_compile_and_package(program, package_path=os.fspath(path))


class ExportedGraph:
    """A package made by `export_graph`, loaded and called as `CompiledRowGraphs` calls a graph."""

    def __init__(self, path: str, model, one_row: bool):
        self.runner = torch._C._aoti.AOTIModelPackageLoader(os.fspath(path), "model", False, 1, -1)
        self.one_row = one_row
        self.read_from(model)

    def read_from(self, model) -> None:
        """Take the model's tensors (again: after it got a new cache and RoPE tables)."""
        self.max_len = model.max_len
        self.tensors = [s.get() for s in graph_tensors(model)]

    def fits(self, rows: int, pos: int) -> bool:
        """Whether a call of `rows` rows at `pos` is within the ranges the graph was exported for."""
        if self.one_row:
            return rows == 1 and 0 <= pos < self.max_len
        return 2 <= rows <= min(MAX_ROWS, self.max_len) and 0 <= pos <= self.max_len - rows

    def __call__(self, model, x: Tensor, pos: int, n_keys: int, mask: Tensor, keep_hidden: bool,
                 states: tuple | None = None) -> tuple:
        """(last layer's output, {layer: output} if keep_hidden) and, with `states` (a hybrid's
        (conv, ssm) lists before the row), (conv, ssm, input rows) lists after it."""
        k, v = attention_caches(model)
        extra = [t for part in states for t in part] if states is not None else []
        outputs = self.runner.run([x, position_input(pos), mask, *self.tensors, *k, *v, *extra])
        n = len(model.layers) if keep_hidden else 0
        every = dict(enumerate(outputs[1:1 + n]))
        if states is None:
            return outputs[0], every
        L = len(states[0])
        rest = outputs[1 + n:]
        return outputs[0], every, rest[:L], rest[L:2 * L], rest[2 * L:3 * L]
