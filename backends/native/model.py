"""The decoder-only transformer of the Llama family (SmolLM2, Llama 3.x, Qwen2/2.5, Qwen3, their
mixture-of-experts forms, Gemma 3 with its sliding-window layers), built from layers.py, with its
KV cache.

The cache is preallocated per layer as [1, n_kv, max_len (+ 1: see KVCache), head_dim] and indexed by absolute
position, so rolling back after a rejected draft is setting a shorter length. A pass runs K
tokens at positions start..start+K-1 against cache[:start] in one of three ways:

- dynamic (the default): attention over cache[:start+K], causal within the block;
- row-exact (K == 1 always, or `row_exact=True`): each row as a single-token pass computes it,
  so strict verification keeps target-only decoding's bits (exact_rows.py);
- static (`use_static_shapes`, CUDA): attention over the whole cache under a position mask, so
  shapes depend only on K and the pass can be captured as a CUDA graph (gpt-fast style).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base import Sampling
from . import sampling as sampler
from .config import ModelConfig
from .exact_rows import KERNEL_MODE, CompiledRowGraphs, RowGroup, attend_rows, probe_attention_mode, row_groups
from .q4_kernel import attention_kernel_fits
from .gated_delta import RecurrentDecoderLayer
from .graph_state import HybridRowGraphs
from .graph_store import GraphStore
from .layers import Attend, DecoderLayer, RMSNorm, rope_inv_freq, rope_tables
from .linear import Linear
from .recurrent_state import RecurrentState

FINAL = -1  # hidden_layers key for the final hidden state (after the final norm)
# Passes of more rows than this run a hybrid's linear layers in the chunked form (prefill); shorter
# ones (verify blocks) token by token, keeping the state after each row. Re-measure:
# scripts/bench_recurrent.py
CHUNKED_FROM = 32


class KVCache:
    """Per-layer preallocated keys and values (None for a linear-attention layer, whose state is
    in `recurrent`); `length` is how many positions are valid."""

    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device,
                 rollback: str = "snapshot", span: int = 0):
        # one position more than max_len: a key span (at most max_len) then never covers a whole
        # tensor, which an exported graph would have to special-case (exported_graph.py)
        shape = (1, cfg.n_kv_heads, max_len + 1, cfg.head_dim)
        attention = [not cfg.is_linear(i) for i in range(cfg.n_layers)]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) if a else None for a in attention]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) if a else None for a in attention]
        # the linear layers' state, numbered in layer order (recurrent_state.py)
        self.recurrent = (RecurrentState(cfg.linear, attention.count(False), rollback, device, span)
                          if cfg.hybrid else None)
        self.max_len = max_len
        self.length = 0

    def write(self, layer: int, positions: slice | Tensor, k: Tensor, v: Tensor) -> None:
        """Keys and values [K, n_kv, head_dim] of the rows at `positions`."""
        self.k[layer][0, :, positions] = k.transpose(0, 1)
        self.v[layer][0, :, positions] = v.transpose(0, 1)

    def truncate(self, n: int) -> None:
        """Forget every position from n on (no copies: later writes overwrite them)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        if self.recurrent is not None:
            self.recurrent.rollback(n)
        self.length = n

    def restart_point(self, n: int) -> int:
        """The longest prefix of at most n positions (n <= length) the cache can be truncated to:
        n, unless a recurrent state cannot return there."""
        return n if self.recurrent is None else self.recurrent.restart_point(n)


def cached_attention(cache: KVCache, layer: int, write: slice | Tensor, span: int, mask: Tensor | None) -> Attend:
    """Attention of K rows over cache[:span] (mask None: plain causal within the block), after
    writing their keys and values at `write`."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache.write(layer, write, k, v)
        K, H = q.shape[0], q.shape[1]
        a = F.scaled_dot_product_attention(q.transpose(0, 1).to(k_cache.dtype)[None], k_cache[:, :, :span],
                                           v_cache[:, :, :span], attn_mask=mask, is_causal=mask is None and K > 1,
                                           enable_gqa=H != k_cache.shape[1])
        return a[0].transpose(0, 1).reshape(K, -1)

    return attend


def entries_attention(cache: KVCache, start: int, K: int) -> tuple[Attend, slice]:
    """A drafting head's attention (one layer, cache layer 0): K entries written at start..start+K-1,
    each seeing the entries before it and itself; whatever the cache held from start on is
    dropped (rolling back is starting lower). Returns the attend function and the rows' slice."""
    cache.length = min(cache.length, start)
    end = start + K
    if end > cache.max_len:
        raise ValueError(f"head entries up to {end} do not fit a cache of {cache.max_len}")
    mask = None
    if K > 1:
        device = cache.k[0].device
        mask = torch.arange(end, device=device)[None, :] <= torch.arange(start, end, device=device)[:, None]
    cache.length = end
    return cached_attention(cache, 0, slice(start, end), end, mask), slice(start, end)


def group_attention(cache: KVCache, layer: int, write: slice, groups: list[RowGroup], mode: str,
                    window: int = 0) -> Attend:
    """Attention of K rows each as its single-token pass computes it (exact_rows.attend_rows), one
    call per row group, after writing their keys and values at `write`; `window`: a sliding-window
    layer's."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache.write(layer, write, k, v)
        qh = q.transpose(0, 1).to(k_cache.dtype)  # [H, K, hd]
        parts = [attend_rows(qh[:, g.lo:g.hi], k_cache, v_cache, g.n_keys, g.window_mask if window else g.mask, mode,
                             write.start + g.lo, window) for g in groups]
        a = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return a[0].transpose(0, 1).reshape(q.shape[0], -1)

    return attend


class Transformer(nn.Module):
    """Built from already-prepared weights (see weights.py); owns one KV cache."""

    def __init__(self, cfg: ModelConfig, embed: Tensor, layers: list[DecoderLayer], norm: Tensor, head: Linear,
                 dtype: torch.dtype, max_len: int, rollback: str = "snapshot"):
        """`rollback`: how a hybrid's recurrent state returns to an earlier position
        (recurrent_state.ROLLBACK_MODES)."""
        super().__init__()
        self.cfg, self.dtype, self.rollback = cfg, dtype, rollback
        self.rollback_span = 0  # see hold_positions
        # [vocab, dim]; rows are looked up (a TileEmbedding reads them from the kernels' tiles: kquant.py)
        self.embed = embed if not isinstance(embed, Tensor) else nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(norm, cfg.norm_eps)
        self.device = embed.device
        self.set_head(head)  # also clears `argmax_head` (argmax_head.py), which weights.py may add
        self.static = False  # see use_static_shapes
        self._static_pass = self.run_layers
        self.compiled: CompiledRowGraphs | None = None  # see use_compiled_rows
        # the pass under way is a prefill (several rows, only the last one's output wanted): a hybrid
        # keeps its recurrent state at the pass's start and end as turn checkpoints (recurrent_state.py)
        self.prefilling = False
        self.inv_freq = rope_inv_freq(cfg)
        self.local_inv_freq = rope_inv_freq(cfg, local=True) if cfg.sliding_window else None
        self.setup_cache(max_len)
        # how a row-exact pass shares attention calls between rows (exact_rows.ATTENTION_MODES)
        self.attention_mode = "shared"
        if self.device.type == "cpu" and attention_kernel_fits(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                                               self.cache_dtype):
            self.attention_mode = KERNEL_MODE  # row-invariant by construction: nothing to probe
        elif self.device.type == "cpu" and self.cache_dtype == torch.bfloat16:
            self.attention_mode = probe_attention_mode(cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim,
                                                       torch.bfloat16)

    @property
    def attention_calls_shared(self) -> bool:
        """Whether a row-exact pass computes a row group's attention in one call (padded or not),
        as compiled graphs need: a call per row would specialize a graph on the number of rows."""
        return self.attention_mode != "separate"

    def use_static_shapes(self, compile: bool = False) -> None:
        """Every pass attends over the whole cache with a position mask, so shapes depend only on
        K; with `compile`, the layers go through torch.compile ("reduce-overhead": CUDA graphs on
        CUDA). The eager dynamic path stays the reference."""
        self.static = True
        self._static_pass = torch.compile(self.run_layers, mode="reduce-overhead") if compile else self.run_layers

    @property
    def static_graphs(self) -> bool:
        """Whether static-shape passes run through compiled graphs (CUDA graphs, over a cache at
        fixed addresses) rather than eagerly."""
        return self._static_pass != self.run_layers  # bound methods: equal, never identical

    def use_compiled_rows(self, store: GraphStore | None = None) -> None:
        """CPU: single-token passes and row-exact blocks through compiled graphs (exact_rows.py),
        kept in `store` between runs (graph_store.py); prefill and non-exact verify blocks stay eager."""
        self.compiled = (HybridRowGraphs if self.cache.recurrent is not None else CompiledRowGraphs)(self, store)

    def setup_cache(self, max_len: int) -> None:
        """(Re)allocate the KV cache for `max_len` positions and the RoPE tables to match."""
        self.cache = KVCache(self.cfg, max_len, self.cache_dtype, self.device, self.rollback, self.rollback_span)
        self.rope_cos, self.rope_sin = rope_tables(self.inv_freq, max_len, self.device, self.rope_dtype)
        self.local_rope = (None if self.local_inv_freq is None else  # the sliding-window layers' (layers.py)
                           rope_tables(self.local_inv_freq, max_len, self.device, self.rope_dtype))
        if self.compiled is not None:
            self.compiled.cache_changed()

    def hold_positions(self, n: int) -> None:
        """Let a hybrid's recurrent state return up to n positions back over consecutive passes
        (recurrent_state.py's `span`); a KV cache always can."""
        self.rollback_span = n
        if self.cache.recurrent is not None:
            self.cache.recurrent.span = n

    @property
    def cache_dtype(self) -> torch.dtype:
        """Keys and values are stored in the compute dtype, except float16 on CPU (its attention
        is slow there): float32. A bfloat16 cache halves what attention reads over long contexts."""
        return torch.float32 if self.device.type == "cpu" and self.dtype == torch.float16 else self.dtype

    @property
    def rope_dtype(self) -> torch.dtype:
        """float32 on CPU (rotations are cheap there); the compute dtype on CUDA."""
        return torch.float32 if self.device.type == "cpu" else self.dtype

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def set_head(self, head: Linear) -> None:
        """Swap the LM head (a drafter's int4 copy: its logits only need to rank its guesses)."""
        self.head = head
        self.argmax_head = None

    @property
    def head_dtype(self) -> torch.dtype:
        # a property, not an attribute: see graph_store.py on what a module may hold
        if self.head.pairwise or self.head.kq is not None:  # float32 logits: no near-ties made exact ties
            return torch.float32
        return torch.bfloat16 if self.head.quantized else self.dtype

    @property
    def kernel(self) -> str:
        """Which 4-bit kernel the layers run on: "specchat-<isa>", "torch" or "none"."""
        lin = next((m for m in self.layers.modules() if isinstance(m, Linear) and m.quantized), None)
        if lin is None:
            return "none"
        from .q4_kernel import isa

        return f"specchat-{isa()}" if lin.own_kernel else "torch"

    @property
    def runs_int4(self) -> bool:
        return any(m.quantized for m in self.layers.modules() if isinstance(m, Linear))

    @torch.inference_mode()
    def forward(self, tokens: Tensor, start_pos: int, hidden_layers: tuple[int, ...] = (),
                all_logits: bool = True, row_exact: bool = False, head: bool = True
                ) -> tuple[Tensor, dict[int, Tensor]]:
        """Run tokens[1, K] at positions start_pos..start_pos+K-1 against cache[:start_pos].

        Returns float32 logits [K, vocab] (or [1, vocab] for the last position when
        all_logits is False) and the float32 hidden states [K, dim] of the requested layers:
        key i is the output of decoder layer i, key FINAL (-1) the final hidden state after the norm.
        Afterwards the cache holds start_pos + K positions. With head=False the first result is
        the final hidden state (after the norm) instead of the logits: `logits` turns rows of it
        into logits, and `choose` into tokens, so a caller computes only what it needs.
        row_exact: a row-exact pass (exact_rows.py)."""
        if row_exact and self.static:
            raise ValueError("row_exact needs the dynamic (eager) path")
        K = tokens.shape[-1]
        end = start_pos + K
        if start_pos > self.cache.length or end > self.cache.max_len:
            raise ValueError(f"positions {start_pos}..{end} do not fit a cache of length "
                             f"{self.cache.length} / {self.cache.max_len}")
        x = self.embed[tokens.reshape(-1)].float()
        if self.cfg.embed_scale != 1.0:
            x = x * self.cfg.embed_scale
        layers = tuple(hidden_layers)
        self.prefilling = K > 1 and not all_logits
        if self.static:
            write = torch.arange(start_pos, end, device=self.device)
            mask = torch.arange(self.cache.max_len, device=self.device)[None, :] <= write[:, None]
            # a frozenset, not the tuple: once a tuple's ints have changed between calls, torch.compile
            # treats them as dynamic and its `i in layers` guards no longer see which layers are asked
            # for (a graph compiled for (-1,) answers (0, -1) without layer 0); a set's are kept
            x, hidden = self._static_pass(x, write, self.cache.max_len, mask, frozenset(layers))
        elif K == 1 or row_exact:
            groups = row_groups(start_pos, K, self.cache.max_len, self.device, self.cache_dtype,
                                (self.cfg.n_kv_heads, self.cfg.n_heads // self.cfg.n_kv_heads), self.cfg.sliding_window)
            # compiled graphs give rows their bits only with shared attention calls, padded or not (a
            # call per row would specialize the graph on the number of rows): without, exact blocks run
            # eager; a hybrid's rows go through the one-row graph one by one (graph_state.py)
            if self.compiled is not None and (K == 1 or self.attention_calls_shared or self.compiled.hybrid):
                x, hidden = self.compiled(x, start_pos, groups, [i for i in layers if i != FINAL])
            else:
                x, hidden = self.run_layers(x, slice(start_pos, end), end, None, layers, groups)
        else:
            mask = None  # a prefill from position 0: plain causal attention
            if start_pos > 0:  # an additive mask, made once rather than converted by every layer
                rows = torch.arange(start_pos, end, device=self.device)[:, None]
                hidden_keys = torch.arange(end, device=self.device)[None, :] > rows
                mask = torch.zeros(hidden_keys.shape, dtype=self.cache_dtype, device=self.device)
                mask.masked_fill_(hidden_keys, float("-inf"))
            x, hidden = self.run_layers(x, slice(start_pos, end), end, mask, layers)
        self.cache.length = end
        if FINAL in hidden_layers:
            x = hidden[FINAL] = self.norm(x)
            x = x if all_logits else x[-1:]
        else:
            x = self.norm(x if all_logits else x[-1:])
        return (self.logits(x) if head else x), hidden

    def run_layers(self, x: Tensor, write: slice | Tensor, span: int, mask: Tensor | None,
                   hidden_layers: tuple[int, ...] | frozenset[int], groups: list[RowGroup] | None = None
                   ) -> tuple[Tensor, dict[int, Tensor]]:
        """Every layer over rows x [K, dim] written at `write`; attention over cache[:span] under
        `mask`, or with `groups` each row as its single-token pass computes it. A hybrid's linear
        layers carry their state from the cache's length to `span`."""
        cos, sin = self.rope_cos[write], self.rope_sin[write]
        window = self.cfg.sliding_window
        if window:
            local = self.local_rope[0][write], self.local_rope[1][write]
            local_mask = None if groups is not None else self.window_mask(write, span)
        hidden: dict[int, Tensor] = {}
        recurrent = self.cache.recurrent
        chunked = groups is None and x.shape[0] > CHUNKED_FROM
        if recurrent is not None:
            recurrent.begin(span - x.shape[0], x.shape[0], window=not chunked, turn=self.prefilling)
        linear = 0
        for i, layer in enumerate(self.layers):
            if isinstance(layer, RecurrentDecoderLayer):
                x = layer(x, recurrent, linear, self.dtype, groups is not None, chunked)
                linear += 1
            elif self.cfg.is_sliding(i):
                if groups is None:
                    attend = cached_attention(self.cache, i, write, span, local_mask)
                else:
                    attend = group_attention(self.cache, i, write, groups, self.attention_mode, window)
                x = layer(x, attend, *local, self.dtype, groups is not None)
            else:
                if groups is None:
                    attend = cached_attention(self.cache, i, write, span, mask)
                else:
                    attend = group_attention(self.cache, i, write, groups, self.attention_mode)
                x = layer(x, attend, cos, sin, self.dtype, groups is not None)
            if i in hidden_layers:
                hidden[i] = x
        if recurrent is not None:
            recurrent.end(span)
        return x, hidden

    def window_mask(self, write: slice | Tensor, span: int) -> Tensor:
        """Additive mask of a sliding-window layer's rows at `write` over keys [0, span): each row
        sees its own key and the sliding_window - 1 before it."""
        rows = torch.arange(write.start, write.stop, device=self.device) if isinstance(write, slice) else write
        keys = torch.arange(span, device=self.device)[None, :]
        hidden = (keys > rows[:, None]) | (keys <= rows[:, None] - self.cfg.sliding_window)
        return torch.zeros(hidden.shape, dtype=self.cache_dtype, device=self.device).masked_fill_(hidden, float("-inf"))

    def logits(self, states: Tensor) -> Tensor:
        """float32 logits [K, vocab] for final hidden states [K, dim] (after the norm), soft-capped
        where the model caps them."""
        logits = self.head(states.to(self.head_dtype)).float()
        cap = self.cfg.logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def choose(self, states: Tensor, positions: Sequence[int], s: Sampling, allowed: Tensor | None = None) -> Tensor:
        """The sampler's token for each row of final hidden states: `sample(logits(states))`, through
        the cheaper `ArgmaxHead` where the choice is an argmax over every token (greedy, or
        temperature sampling without top-k / top-p). `allowed`: bool [rows, vocab], a constraint's
        mask: every other token's logit is -inf before any argmax, top-k or top-p."""
        if self.argmax_head is not None and sampler.argmax_over_vocabulary(s):
            return self.argmax_head.choose(states, positions, s, allowed)
        logits = self.logits(states)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        return sampler.sample(logits, positions, s)

    def verify_chunk(self, s: Sampling) -> int | None:
        """How many rows of a verify block `choose` should take per call (None: all at once). The
        argmax head streams its int8 weights once however many rows it scores, so one call; the
        pairwise float32 head costs as much per pair of rows, so a pair at a time lets the loop
        stop at the first rejected draft."""
        if self.argmax_head is not None and sampler.argmax_over_vocabulary(s):
            return None
        return 2 if self.head.pairwise else None
