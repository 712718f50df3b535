"""Row-exact passes on CPU: a verify block whose every row has the bits a single-token pass gives it.

Strict verification (speculative/loop.py) checks K drafted tokens in one pass, and promises that
the tokens it keeps are bit for bit the tokens target-only decoding would choose. That holds
only if each row of the K-row pass is computed exactly as the single-token pass at its position
computes it. This module is what makes that true on CPU. Its terms, used everywhere:

- **single-token pass**: `forward` of one token at position p, as target-only decoding runs it.
- **row-exact pass**: `forward(..., row_exact=True)` over K tokens: row i has exactly the bits of
  the single-token pass at position start + i. `TorchBackend.row_exact_supported` says where the
  engine can promise that.
- **row-invariant kernel**: a matmul whose result for a row does not depend on the other rows of
  the call. torch's int4 kernel and its bfloat16 GEMM on CPU are (`ROW_INVARIANT_PRECISIONS` in
  engine.py); float32 MKL is not (the LM head then multiplies in row pairs: `Linear(pairwise=True)`).
- **key span** (`key_span`): how many cache positions a single-token pass at position p attends
  over: p + 1 rounded up to a multiple of ATTENTION_PAD, the rest masked. CPU attention's
  reductions depend on the number of keys, so a row can only match its single-token pass if it
  sees the same span.
- **row group** (`row_groups`): consecutive rows of a block that share a key span; each group is
  one attention call.
- **attention mode** (`ATTENTION_MODES`): how a group's rows share that call so that no row's bits
  depend on its neighbours in it; this machine's kernel is probed once per shape
  (`probe_attention_mode`) and the first mode that keeps every row's bits is used.
- **compiled row graphs** (`CompiledRowGraphs`): single-token passes and row-exact groups through
  one compiled graph of all layers (exported ahead of time, exported_graph.py), dynamic in the
  number of rows; every row then gets the graph's bits (not the eager path's) in both.
"""
from __future__ import annotations

import functools
import logging
import re
import weakref
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .exported_graph import ExportedGraph, export_graph
from .graph_store import GraphStore, Variant

log = logging.getLogger(__name__)

# A single-token pass attends over the cache rounded up to a multiple of this: a verify block
# whose rows straddle a multiple is computed in two groups (in compiled graphs, two calls that
# each stream the weights), so large enough that few do; the masked keys cost little
# (re-measure: scripts/bench_engine.py with other values).
ATTENTION_PAD = 64


def key_span(end: int, max_len: int) -> int:
    """The key span of a single-token pass at position end - 1."""
    return min(-(-end // ATTENTION_PAD) * ATTENTION_PAD, max_len)


def key_mask(ends: Tensor, n_keys: int, dtype: torch.dtype, heads: tuple[int, int] = (1, 1),
             window: int = 0) -> Tensor:
    """Additive mask for rows over n_keys keys, row i seeing keys [0, ends[i]) (its last `window` of
    them where window > 0: a sliding-window layer), laid out for `attend_rows` over heads = (Hkv, G):
    kv heads, query heads per kv head. One row: [1, 1, 1, n_keys]; n rows: [1, 1, n * G, n_keys] when
    G > 1, [1, Hkv * n, 1, n_keys] when G == 1."""
    keys = torch.arange(n_keys, device=ends.device)[None, :]
    visible = (keys < ends[:, None]) & (keys >= ends[:, None] - window if window else True)
    mask = torch.zeros(visible.shape, dtype=dtype, device=ends.device).masked_fill_(~visible, float("-inf"))
    n = len(ends)
    if n == 1:
        return mask[:, None, None, :]
    Hkv, G = heads
    if G > 1:
        return mask[:, None, :].expand(n, G, n_keys).reshape(1, 1, n * G, n_keys)
    return mask[None, :, None, :].expand(Hkv, n, 1, n_keys).reshape(1, Hkv * n, 1, n_keys)


class RowGroup(NamedTuple):
    lo: int  # rows lo..hi-1 of the block
    hi: int
    n_keys: int  # their key span
    mask: Tensor  # from key_mask
    window_mask: Tensor | None = None  # the same for a sliding-window layer's rows


def row_groups(start: int, K: int, max_len: int, device: torch.device, dtype: torch.dtype,
               heads: tuple[int, int] = (1, 1), window: int = 0) -> list[RowGroup]:
    """Rows start..start+K-1 grouped by key span, masks laid out for `attend_rows` over
    heads = (n_kv_heads, query heads per kv head), and for `window` where the model has
    sliding-window layers."""
    ends = list(range(start + 1, start + K + 1))
    groups, lo = [], 0
    while lo < K:
        n_keys = key_span(ends[lo], max_len)
        hi = lo
        while hi < K and key_span(ends[hi], max_len) == n_keys:
            hi += 1
        rows = torch.tensor(ends[lo:hi], device=device)
        groups.append(RowGroup(lo, hi, n_keys, key_mask(rows, n_keys, dtype, heads),
                               key_mask(rows, n_keys, dtype, heads, window) if window else None))
        lo = hi
    return groups


# How `attend_rows` computes the rows of one call, in the order they are tried (see there). "padded"
# first: a query block of 1-3 rows rounds differently from larger ones on some CPUs, in ways random
# probes can miss and real attention does not (tests/native/test_real_model.py checks the real
# model), and the padding costs no measurable time (re-measure: scripts/bench_engine.py).
ATTENTION_MODES = ("padded", "shared", "separate")
# specchat's own attention kernel (q4_kernel.py): each row over exactly its own keys, invariant by
# construction; where it runs, no probe is needed and the modes above are not used
KERNEL_MODE = "kernel"
_MIN_QUERY_ROWS = 4  # "padded": no query block of CPU flash attention with fewer rows


def _query_block(rows: int) -> int:
    """CPU flash attention's query block for a call of `rows` query rows (per kv head)."""
    return 256 if rows >= 768 else 64 if rows >= 192 else 32


def _rows_to_pad(rows: int) -> int:
    """Zero query rows to add so that no query block of the call has fewer than _MIN_QUERY_ROWS:
    with a multiple of 4 rows every block (32, 64 or 256 rows) and so the last has 0 or 4+.
    2 to 5, never 0 or 1: a compiled graph would guard on a size that may be 0 or 1 (and an
    exported graph, which cannot guard, would not be exported)."""
    return (-rows - 2) % _MIN_QUERY_ROWS + 2


def attend_rows(q: Tensor, cache_k: Tensor, cache_v: Tensor, n_keys: int, mask: Tensor,
                mode: str = "shared", start: int = 0, window: int = 0) -> Tensor:
    """q [H, n, hd] as n rows over cache[:n_keys] (mask from `key_mask`), each as its single-token
    pass computes it, reading the cache in place; returns [1, H, n, hd]. Row i is at position
    start + i.

    With mode KERNEL_MODE, specchat's attention kernel takes each row over keys [0, start + i]
    alone, the last `window` of them where window > 0 (the mask and key count are not needed).

    With G = H / Hkv > 1 query heads per kv head a single-token pass is already a G-row query per
    kv head, and a block's rows join it as more query rows ([1, Hkv, n * G, hd]); with G == 1 each
    row is a one-row query in the head dimension. CPU flash attention takes query rows in blocks
    (`_query_block`) and multiplies each block by the keys in one GEMM, so `mode` says how rows
    share a call on this machine's kernel (`probe_attention_mode`):
    - "padded": zero query rows are added (`_rows_to_pad`, single-token passes included) so that no
      query block has fewer than 4 rows, where a GEMM of 1-3 rows rounds differently.
    - "shared": one call; a last query block of a single row goes another kernel path, so it gets
      a call of its own.
    - "separate": each row the call a single-token pass makes (a row costs a call)."""
    if mode == KERNEL_MODE:
        return torch.ops.specchat.attend_rows(q, cache_k, cache_v, start, window)
    H, n, hd = q.shape
    Hkv = cache_k.shape[1]
    G = H // Hkv
    if n > 1 and mode == "separate":
        row_masks = [mask[:, :, i * G:i * G + 1] if G > 1 else mask[:, i:i + 1] for i in range(n)]
        return torch.cat([attend_rows(q[:, i:i + 1], cache_k, cache_v, n_keys, m) for i, m in enumerate(row_masks)],
                         dim=2)
    k, v = cache_k[:, :, :n_keys], cache_v[:, :, :n_keys]
    if G == 1:
        out = F.scaled_dot_product_attention(q.reshape(1, H * n, 1, hd), k, v, attn_mask=mask, enable_gqa=n > 1)
        return out.view(1, H, n, hd)
    R = n * G
    x = q.view(Hkv, G, n, hd).transpose(1, 2).reshape(1, Hkv, R, hd)
    if mode == "padded":
        pad = _rows_to_pad(R)
        x = torch.cat([x, x.new_zeros(1, Hkv, pad, hd)], dim=2)
        mask = torch.cat([mask.expand(1, 1, R, n_keys), mask.new_zeros(1, 1, pad, n_keys)], dim=2)
        # a copy, not a view: whether the first R rows of R + pad are contiguous depends on pad,
        # which a compiled graph would guard on
        out = F.scaled_dot_product_attention(x, k, v, attn_mask=mask)[:, :, :R]
        out = out.clone(memory_format=torch.contiguous_format)
    elif n > 1 and R % _query_block(R) == 1:
        cut = (n - 1) * G
        out = torch.cat([F.scaled_dot_product_attention(x[:, :, :cut], k, v, attn_mask=mask[:, :, :cut]),
                         F.scaled_dot_product_attention(x[:, :, cut:], k, v, attn_mask=mask[:, :, cut:])], dim=2)
    else:
        out = F.scaled_dot_product_attention(x, k, v, attn_mask=mask)
    return out.view(Hkv, n, G, hd).transpose(1, 2).reshape(1, H, n, hd)


@functools.cache
def probe_attention_mode(kv_heads: int, group: int, head_dim: int, dtype: torch.dtype) -> str:
    """The first of ATTENTION_MODES under which this machine's CPU attention kernel gives each row
    of a multi-row `attend_rows` call the bits of a one-row call, checked on random blocks of
    2..33 rows over 64..1088 keys (0.04-0.2 s a mode, once per shape). A probe can only find a
    difference, not prove there is none, hence so many rows."""
    for mode in ATTENTION_MODES[:-1]:
        if mode_keeps_row_bits(kv_heads, group, head_dim, dtype, mode):
            return mode
    return "separate"


def mode_keeps_row_bits(kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, mode: str) -> bool:
    g = torch.Generator().manual_seed(0)
    for n_keys in (64, 128, 256, 384, 512, 832, 1088):
        cache = [torch.randn(1, kv_heads, n_keys, head_dim, generator=g).to(dtype) for _ in range(2)]
        for n in (2, 3, 4, 5, 8, 11, 16, 33):
            q = (3 * torch.randn(kv_heads * group, n, head_dim, generator=g)).to(dtype)
            ends = torch.full((n,), n_keys)
            block = attend_rows(q, *cache, n_keys, key_mask(ends, n_keys, dtype, (kv_heads, group)), mode)
            for i in range(n):
                one = attend_rows(q[:, i:i + 1], *cache, n_keys, key_mask(ends[i:i + 1], n_keys, dtype), mode)
                if not torch.equal(block[0, :, i], one[0, :, 0]):
                    return False
    return True


def matmuls_keep_row_bits(linears: tuple, dtype: torch.dtype) -> bool:
    """Whether each of these layers (linear.Linear, as a verify row calls them) gives every row of
    a call of 2..8 rows the bits of that row's one-row call, on random rows. torch's bfloat16 GEMM
    and its int4 kernel do on CPUs with native bfloat16 (`ROW_INVARIANT_PRECISIONS` assumes so), but
    a CPU that emulates bfloat16 may take another path for one row than for several; specchat's own
    kernel does by construction, and is not probed. A few small multiplies."""
    g = torch.Generator().manual_seed(0)
    for lin in linears:
        if lin.own_kernel:
            continue
        x = torch.randn(8, lin.in_features, generator=g).to(dtype)
        alone = torch.cat([lin(x[i:i + 1], exact=True) for i in range(8)])
        for n in (2, 3, 4, 5, 8):
            if not torch.equal(lin(x[:n], exact=True), alone[:n]):
                return False
    return True


_ROWS_PROBED: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def model_matmuls_keep_row_bits(model) -> bool:
    """matmuls_keep_row_bits on the first attention layer's matrices of `model` (a Transformer) and,
    on a mixture-of-experts model, one expert's and the shared expert's, probed once per model."""
    from .linear import Linear

    if model not in _ROWS_PROBED:
        layer = next((m for m in model.layers if hasattr(m, "attention")), None)
        linears = (tuple(m for m in layer.attention.modules() if isinstance(m, Linear)) if layer is not None else ())
        mlp = next((m.mlp for m in model.layers if hasattr(m.mlp, "expert_linears")), None)
        linears += mlp.expert_linears() if mlp is not None else ()
        dense = next((m.mlp for m in model.layers if not hasattr(m.mlp, "expert_linears")), None)
        linears += tuple(m for m in dense.modules() if isinstance(m, Linear)) if dense is not None else ()
        _ROWS_PROBED[model] = matmuls_keep_row_bits(linears, model.dtype)
    return _ROWS_PROBED[model]


# ---- compiled row graphs ----

_LATER_LAYER = re.compile(r"\._modules\['layers'\]\._modules\['([1-9]\d*)'\]|\.cache\.[kv]\[([1-9]\d*)\]")


def first_layer_guards(entries) -> list[bool]:
    """Which of a compiled graph's guards to check on each call: all but those on the second and
    later layers' modules, weights and caches (most of them; each costs time on every call). The
    layers are built alike and never change after load (a new cache replaces every layer's
    tensors together), so the first layer's guards stand for all of them."""
    return [_LATER_LAYER.search(e.name) is None for e in entries]


def all_layers(model, x: Tensor, pos: int, n_keys: int, mask: Tensor, keep_hidden: bool
               ) -> tuple[Tensor, dict[int, Tensor]]:
    """The compiled function: every layer of `model` (a Transformer) for rows sharing one key span;
    with keep_hidden, also every layer's output (one graph serves any choice of layers)."""
    every = tuple(range(len(model.layers))) if keep_hidden else ()
    group = RowGroup(0, x.shape[0], n_keys, mask)
    return model.run_layers(x, slice(pos, pos + x.shape[0]), n_keys, None, every, [group])


# cpp_wrapper: the graph's few hundred kernel calls are made from C++, not Python (a large share of
# a small model's single-token pass; its first compile takes minutes)
COMPILE_OPTIONS = {"cpp_wrapper": True}


class CompiledRowGraphs:
    """Single-token passes and row-exact groups of `model` (a Transformer) through one compiled
    graph of all its layers, dynamic in the number of rows, the position and the key count: one
    call per row group. Each row gets the same bits from the K-row graph as from the one-row graph
    (fused kernels reduce within a row).

    `prepare` makes a graph ready before its first call: loaded from `store` (graph_store.py),
    else exported ahead of time and saved there (exported_graph.py). Without a store, where
    exporting fails, or for a call outside an exported graph's ranges, torch.compile compiles the
    same function in process at its first call (the same kernels, so the same bits)."""

    function = staticmethod(all_layers)  # what the graphs compute (graph_state.HybridRowGraphs: more)
    hybrid = False

    def __init__(self, model, store: GraphStore | None = None):
        self.model = model
        self.store = store
        self.ready: dict[Variant, ExportedGraph] = {}  # exported graphs, by variant
        self._graph = None  # the in-process graph, made when first needed (importing dynamo takes seconds)

    @property
    def graph(self) -> Callable:
        if self._graph is None:
            self._graph = torch.compile(self.function, dynamic=True, fullgraph=True,
                                        options=COMPILE_OPTIONS | {"guard_filter_fn": first_layer_guards})
            self.mark_static()
        return self._graph

    def cache_changed(self) -> None:
        """The model has a new cache (and RoPE tables): the graphs must read those."""
        for graph in self.ready.values():
            graph.read_from(self.model)
        if self._graph is not None:
            self.mark_static()

    def mark_static(self) -> None:
        """Weights, tables and caches never change shape: tell dynamo, so that only the number of
        rows, the position and the key count are symbols in the compiled graphs (and so guarded).
        Called again whenever the model gets a new cache."""
        from .linear import Linear

        m = self.model
        tensors = [getattr(m.embed, "tiles", m.embed), m.rope_cos, m.rope_sin, *m.cache.k, *m.cache.v, *m.parameters()]
        for lin in (x for x in m.layers.modules() if isinstance(x, Linear)):
            tensors += [lin.dense, lin.q4, *(lin.int4 or ())[:2], *(lin.kq or ())]
        for t in tensors:
            while isinstance(t, Tensor):  # and what it is a view of: dynamo traces views from their base
                torch._dynamo.mark_static(t)
                t = t._base

    def __call__(self, x: Tensor, start_pos: int, groups: list[RowGroup], layers: list[int]
                 ) -> tuple[Tensor, dict[int, Tensor]]:
        """x [K, dim] embedded rows at start_pos..; returns the last layer's output and the outputs
        of `layers`."""
        xs, hiddens = [], []
        for lo, hi, n_keys, mask, _ in groups:  # no window: sliding-window models have no graphs (config.py)
            # whole inputs, not views: a view's storage offset would become one more guarded symbol
            rows = x if len(groups) == 1 else x[lo:hi].clone()
            out, every = self._run(rows, start_pos + lo, n_keys, mask, bool(layers))  # every: {layer: output}
            xs.append(out)
            hiddens.append(every)
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        if len(hiddens) == 1:
            return x, {i: hiddens[0][i] for i in layers}
        return x, {i: torch.cat([h[i] for h in hiddens]) for i in layers}

    def _run(self, rows: Tensor, pos: int, n_keys: int, mask: Tensor, keep_hidden: bool, states: tuple | None = None):
        """One call of a graph; `states`: a hybrid's (conv, ssm) lists (graph_state.py)."""
        graph = self.ready.get(Variant(rows.shape[0] == 1, keep_hidden))
        if graph is not None and graph.fits(rows.shape[0], pos):
            return graph(self.model, rows, pos, n_keys, mask, keep_hidden, states)
        # the model width is no symbol: dynamo would tie it to an equal key count and specialize both
        torch._dynamo.mark_static(rows, 1)
        # floats as constants, as exported graphs have them; it also spares a second trace
        with torch._dynamo.config.patch(specialize_float=True):
            return self.graph(self.model, rows, pos, n_keys, mask, keep_hidden, *(states or ()))

    # ---- making a graph ready before its first call ----

    def example(self, variant: Variant) -> tuple[Tensor, int, int, Tensor, bool, tuple | None]:
        """Inputs for one call of `variant` at fixed positions (unequal row count, position and key
        count, so that dynamo ties no symbols together): rows of token ids 1.. embedded, and the
        recurrent state where the graph takes one (None here; graph_state.py). Zeroes the cache's first keys and values, which the rows see
        (so that the output, a stored graph's fingerprint, is the same in every process whatever
        ran before), and writes the cache at the rows' positions."""
        m = self.model
        K, pos = (1, 5) if variant.one_row else (3, 6)
        lo, hi, n_keys, mask, _ = row_groups(pos, K, m.max_len, m.device, m.cache_dtype,
                                             (m.cfg.n_kv_heads, m.cfg.n_heads // m.cfg.n_kv_heads))[0]
        for cache in m.cache.k + m.cache.v:
            if cache is not None:
                cache[:, :, :n_keys].zero_()
        rows = m.embed[torch.arange(1, K + 1, device=m.device)].float()
        return rows, pos, n_keys, mask, variant.keep_hidden, self.example_states()

    def example_states(self) -> tuple | None:
        return None

    @torch.inference_mode()
    def prepare(self, variant: Variant) -> None:
        """Make `variant` ready: loaded from the store, else exported and saved there, else
        (without a store, or where torch cannot export it) compiled in process. Leaves the cache's
        entries at the example's positions overwritten."""
        if variant in self.ready:
            return
        if self.store is None:
            self._run(*self.example(variant))
            return
        check = lambda graph: graph(self.model, *self.example(variant))[0]  # noqa: E731
        load = lambda path: ExportedGraph(path, self.model, variant.one_row)  # noqa: E731
        graph = self.store.load(variant, load, check)
        if graph is None:
            try:
                example = self.example(variant)
                write = lambda path: export_graph(self.function, self.model, variant.one_row,  # noqa: E731
                                                  variant.keep_hidden, example[:4], path, example[5])
                graph = self.store.save(variant, write, load, check)
            except Exception:  # noqa: BLE001 - torch's exporting is young: compile as usual instead
                log.info("decode graph %s could not be exported and stored; compiling it in process", variant,
                         exc_info=True)
                self._run(*self.example(variant))
                return
        self.ready[variant] = graph
