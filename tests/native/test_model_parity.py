"""The native model against transformers' own model for the same weights, every layout."""
from __future__ import annotations

import pytest
import torch

from specchat.backends.base import Sampling
from specchat.backends.hf_reference import load_hf_model
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.exact_rows import ATTENTION_PAD
from specchat.backends.native.model import FINAL
from tests.native.tiny import LAYOUTS

FP32_TOL = 1e-4  # max abs logit difference, float32 vs transformers float32 (logits are O(10))
MESSAGES = [{"role": "user", "content": "hello world, how are you today?"}]

# Mean |logit difference| allowed between the 4-bit kernel's passes and the bfloat16 copy's on the
# tiny checkpoint: 0.05 for torch's kernel (bfloat16 activations), ~0.06 seen with specchat's
# (int8 activations in blocks of 32, as llama.cpp multiplies Q4 weights)
INT8_ACTIVATIONS_MEAN = 0.08


@pytest.fixture(scope="module")
def pairs(tiny_dirs):
    return {layout: (TorchBackend(d, precision="float32", context=96), load_hf_model(d))
            for layout, d in tiny_dirs.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_hidden_states_match_transformers(pairs, layout):
    engine, hf = pairs[layout]
    ids = engine.tokenize_chat(MESSAGES)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    logits, hidden = engine.forward(ids, 0, hidden_layers=(0, 1, FINAL))
    assert logits.shape == (len(ids), hf.config.vocab_size)
    assert (logits - ref.logits[0]).abs().max().item() < FP32_TOL
    # transformers' hidden_states[i + 1] is the output of layer i; the last one is after the final norm
    assert torch.allclose(hidden[0], ref.hidden_states[1][0], atol=1e-5)
    assert torch.allclose(hidden[1], ref.hidden_states[2][0], atol=1e-5)
    assert torch.allclose(hidden[FINAL], ref.hidden_states[-1][0], atol=1e-5)
    engine.truncate(0)
    last_logits, last_hidden = engine.forward(ids, 0, hidden_layers=(FINAL,), all_logits=False)
    assert torch.allclose(last_logits, logits[-1:], atol=1e-5) and last_hidden[FINAL].shape == (len(ids), hf.config.hidden_size)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_reply_matches_transformers_generate(pairs, layout):
    engine, hf = pairs[layout]
    ids = engine.tokenize_chat(MESSAGES)
    n = 24
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    expected = out[0, len(ids):].tolist()
    logits = engine.prefill(ids)
    got, pos = [], len(ids)
    for _ in range(n):
        token = int(engine.sample(logits, [pos], Sampling())[0])
        got.append(token)
        logits, _ = engine.forward([token], pos)
        pos += 1
    assert got == expected


@pytest.mark.parametrize("layout", ["llama", "qwen3"])
def test_block_forward_equals_single_token_forwards(pairs, layout):
    engine, _ = pairs[layout]
    ids = engine.tokenize_chat(MESSAGES)
    prefix, block = ids[:-6], ids[-6:]
    engine.forward(prefix, 0)
    block_logits, block_hidden = engine.forward(block, len(prefix), hidden_layers=(FINAL,))
    engine.truncate(len(prefix))
    singles = [engine.forward([t], len(prefix) + i, hidden_layers=(FINAL,)) for i, t in enumerate(block)]
    assert torch.allclose(block_logits, torch.cat([s[0] for s in singles]), atol=1e-5)
    assert torch.allclose(block_hidden[FINAL], torch.cat([s[1][FINAL] for s in singles]), atol=1e-5)


def test_decode_after_rollback_equals_fresh_decode(pairs):
    engine, _ = pairs["qwen2"]
    ids = engine.tokenize_chat(MESSAGES)
    engine.forward(ids, 0)
    engine.forward([5, 6, 7, 8], len(ids))  # a rejected draft
    engine.truncate(len(ids) - 2)
    assert engine.cache_len == len(ids) - 2 and engine.cached == ids[:-2]
    after_rollback, _ = engine.forward(ids[-2:] + [9], len(ids) - 2)
    engine.truncate(0)
    fresh, _ = engine.forward(ids + [9], 0)
    assert torch.allclose(after_rollback, fresh[-3:], atol=1e-5)


def test_forward_beyond_the_cache_is_refused(pairs):
    engine, _ = pairs["llama"]
    engine.truncate(0)
    with pytest.raises(ValueError):
        engine.forward([1, 2], 3)  # a gap: positions 0..2 were never computed
    with pytest.raises(ValueError):
        engine.forward(list(range(97)), 0)  # longer than the cache


def test_static_shapes_path_equals_dynamic_path(tiny_dirs):
    """The static-shape path (for torch.compile / CUDA graphs) computes what the eager path does."""
    dynamic = TorchBackend(tiny_dirs["qwen3"], precision="float32", context=48)
    static = TorchBackend(tiny_dirs["qwen3"], precision="float32", context=48)
    static.model.use_static_shapes(compile=False)
    ids = dynamic.tokenize_chat(MESSAGES)
    for engine in (dynamic, static):
        engine.forward([9] * 40, 0)  # stale entries beyond the rollback point must be masked out
        engine.truncate(0)
    a, _ = dynamic.forward(ids, 0)
    b, _ = static.forward(ids, 0)
    assert torch.allclose(a, b, atol=1e-5)
    a, _ = dynamic.forward([7], len(ids))
    b, _ = static.forward([7], len(ids))
    assert torch.allclose(a, b, atol=1e-5)


def test_compiled_static_path_returns_the_layers_each_call_asks_for(tiny_dirs):
    """The hidden layers a pass returns change with its caller (target-only, an MTP head's final
    state, DFlash's taps); a graph compiled for one set must not answer another."""
    engine = TorchBackend(tiny_dirs["llama"], precision="float32", threads=2, context=48, compile=True)
    assert engine.model.static
    ids = list(range(3, 15))
    for layers in [(), (FINAL,), (0, FINAL), (0, 2), (1,)]:
        engine.truncate(0)
        _, hidden = engine.forward(ids, 0, hidden_layers=layers)
        assert sorted(hidden) == sorted(layers), layers


@pytest.mark.parametrize("context", [256, ATTENTION_PAD + 6])
def test_exact_rows_across_an_attention_pad_boundary(tiny_ggufs, context):
    """Single-token passes attend over the cache rounded up to ATTENTION_PAD keys; a verify block
    whose rows fall on both sides of a boundary (or of a context capped below it) is computed in
    groups and must still give each row the bits of a single-token pass."""
    engine = TorchBackend(tiny_ggufs["Q4_1"], precision="int4", context=context)
    prefix = [(7 * i) % 50 + 3 for i in range(ATTENTION_PAD - 4)]
    block = [11, 12, 13, 14, 15, 16, 17, 18, 19]  # key counts PAD and 2 PAD (or the context, PAD + 6)
    engine.forward(prefix, 0)
    engine.forward([5] * 8, len(prefix))  # stale keys past the rollback point must stay masked out
    engine.truncate(len(prefix))
    block_logits, _ = engine.forward(block, len(prefix), row_exact=True)
    engine.truncate(len(prefix))
    singles = torch.cat([engine.forward([t], len(prefix) + i)[0] for i, t in enumerate(block)])
    assert torch.equal(block_logits, singles)
    unpadded = TorchBackend(tiny_ggufs["Q4_1"], precision="int4", context=context)
    prefill, _ = unpadded.forward(prefix + block, 0)  # one causal pass: bfloat16 activations, other rounding
    assert (block_logits - prefill[-len(block):]).abs().mean() < INT8_ACTIVATIONS_MEAN


@pytest.mark.parametrize("precision", ["bfloat16", "int4"])
def test_exact_rows_block_is_bitwise_equal_to_single_token_passes(tiny_ggufs, precision):
    """What makes greedy speculative output identical to target-only: the verify pass over K
    tokens gives each position the very bits a single-token decode pass gives."""
    engine = TorchBackend(tiny_ggufs["Q4_1"], precision=precision, context=64)
    assert engine.row_exact_supported
    ids = engine.tokenize_chat(MESSAGES)
    prefix, block = ids[:-7], ids[-7:]
    engine.forward(prefix, 0)
    block_logits, block_hidden = engine.forward(block, len(prefix), hidden_layers=(1, FINAL), row_exact=True)
    engine.truncate(len(prefix))
    singles = [engine.forward([t], len(prefix) + i, hidden_layers=(1, FINAL)) for i, t in enumerate(block)]
    assert torch.equal(block_logits, torch.cat([s[0] for s in singles]))
    assert torch.equal(block_hidden[FINAL], torch.cat([s[1][FINAL] for s in singles]))
    assert torch.equal(block_hidden[1], torch.cat([s[1][1] for s in singles]))


def test_the_dense_copy_is_multiplied_in_bfloat16_only_on_cpus_with_bfloat16_instructions(monkeypatch):
    """Chosen by the CPU's flags, never by a timing that a shared machine could flip: the choice
    sets a prefill's arithmetic and so the reply."""
    from specchat.backends.native.linear import dense_compute_dtype

    for avx512_bf16, amx, expected in ((False, False, torch.float32), (True, False, torch.bfloat16),
                                       (False, True, torch.bfloat16)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        assert dense_compute_dtype() == expected


def test_int4_prefill_runs_on_a_dense_copy_and_verify_rows_never_do(tiny_ggufs, monkeypatch):
    """Passes of DENSE_MIN_ROWS rows or more (prefill) use a bfloat16 copy of the int4 weights;
    exact rows (strict verification) stay on the int4 kernel, bit for bit single-token passes."""
    import specchat.backends.native.weights as weights
    from specchat.backends.native.linear import DENSE_MIN_ROWS

    engine = TorchBackend(tiny_ggufs["Q4_1"], precision="int4", context=96)
    assert all(b.attention.qkv.dense is not None and b.mlp.down.dense is not None for b in engine.model.layers)
    monkeypatch.setattr(weights, "DENSE_COPY_MAX_BYTES", 0)
    int4_only = TorchBackend(tiny_ggufs["Q4_1"], precision="int4", context=96)
    assert all(b.attention.qkv.dense is None for b in int4_only.model.layers)

    ids = engine.tokenize_chat(MESSAGES)
    assert len(ids) >= DENSE_MIN_ROWS
    int4_prefill, _ = int4_only.forward(ids, 0)
    import specchat.backends.native.linear as linear

    for dtype in (torch.float32, torch.bfloat16):  # the copy multiplied as is, or widened (dense_compute_dtype)
        monkeypatch.setattr(linear, "dense_compute_dtype", lambda d=dtype: d)
        engine.truncate(0)
        dense_prefill, _ = engine.forward(ids, 0)
        assert not torch.equal(dense_prefill, int4_prefill)  # really another kernel...
        # ...for the same weights: bfloat16 rounding apart, and specchat's kernel's int8 activations
        # (llama.cpp's own rounding of them: docs/results.md, the kernel's accuracy)
        diff = (dense_prefill - int4_prefill).abs()
        assert diff.max() < 0.6 and diff.mean() < INT8_ACTIVATIONS_MEAN

    block = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    assert len(block) >= DENSE_MIN_ROWS
    for e in (engine, int4_only):
        e.truncate(len(ids))
    block_logits, _ = engine.forward(block, len(ids), row_exact=True)
    reference, _ = int4_only.forward(block, len(ids), row_exact=True)
    engine.truncate(len(ids))
    singles = torch.cat([engine.forward([t], len(ids) + i)[0] for i, t in enumerate(block)])
    assert torch.equal(block_logits, singles)
    # the caches differ only by the prefill's kernel, so the rows are close, not equal
    assert (block_logits - reference).abs().mean() < INT8_ACTIVATIONS_MEAN


def test_prefill_from_zero_equals_a_prefill_in_two_parts(tiny_ggufs):
    """A prefill from position 0 uses plain causal attention; one that continues a cache uses an
    additive mask. Both must see the same keys."""
    engine = TorchBackend(tiny_ggufs["Q4_1"], precision="float32", context=96)
    ids = engine.tokenize_chat(MESSAGES) * 2
    whole, _ = engine.forward(ids, 0)
    engine.truncate(0)
    first, _ = engine.forward(ids[:9], 0)
    rest, _ = engine.forward(ids[9:], 9)
    assert (torch.cat([first, rest]) - whole).abs().max() < FP32_TOL


def _row_modes(kv_heads: int, group: int, head_dim: int) -> list[str]:
    """The ways `attend_rows` may compute a block's rows on this machine: those under which the
    probe found this CPU's kernel keeps a row's bits, and always one call per row."""
    from specchat.backends.native.exact_rows import ATTENTION_MODES, mode_keeps_row_bits

    return [rows for rows in ATTENTION_MODES
            if rows == "separate" or mode_keeps_row_bits(kv_heads, group, head_dim, torch.bfloat16, rows)]


@pytest.mark.parametrize("kv_heads,group,head_dim", [(3, 3, 64), (2, 1, 32), (1, 4, 64), (2, 7, 16), (4, 2, 128)])
def test_attention_rows_are_each_a_single_token_pass(kv_heads, group, head_dim):
    """`attend_rows` computes a verify block's rows in one attention call (or, where this CPU's
    kernel would change a row's bits with the rows around it, in padded calls or a call per row);
    each row must come out bit for bit as the attention a single-token pass computes at that
    position (blocks of the sizes `key_span` groups, and longer ones over several of the
    kernel's key blocks)."""
    for rows in _row_modes(kv_heads, group, head_dim):
        _check_attention_rows(kv_heads, group, head_dim, rows)


def _check_attention_rows(kv_heads: int, group: int, head_dim: int, rows: str) -> None:
    from specchat.backends.native.exact_rows import attend_rows, key_mask, key_span

    g = torch.Generator().manual_seed(kv_heads * 100 + group)
    cache = [torch.randn(1, kv_heads, 1100, head_dim, generator=g).bfloat16() for _ in range(2)]
    blocks = []
    for start in (0, 37, 250, 480):
        n_keys = key_span(start + 1, 1100)
        blocks.append((start, n_keys, sum(key_span(e, 1100) == n_keys for e in range(start + 1, start + 9))))
    for start, n_keys, n in blocks + [(560, 576, 16), (1076, 1088, 12)]:
        q = (3 * torch.randn(kv_heads * group, n, head_dim, generator=g)).bfloat16()
        ends = torch.arange(start + 1, start + n + 1)
        block = attend_rows(q, *cache, n_keys, key_mask(ends, n_keys, torch.bfloat16, (kv_heads, group)), rows)
        for i in range(n):
            one = attend_rows(q[:, i:i + 1], *cache, n_keys, key_mask(ends[i:i + 1], n_keys, torch.bfloat16), rows)
            assert torch.equal(block[0, :, i], one[0, :, 0]), (n_keys, n, i, rows)


def test_padded_attention_calls_have_no_small_query_block():
    """"padded" adds 2-5 zero query rows (never 0 or 1: a compiled graph would guard on it, an
    exported one could not be exported) so that every query block of CPU flash attention (32, 64
    or 256 rows by the call's size) has 4 or more."""
    from specchat.backends.native.exact_rows import _query_block, _rows_to_pad

    for rows in range(1, 1200):
        pad = _rows_to_pad(rows)
        total = rows + pad
        assert 2 <= pad <= 5 and total % _query_block(total) in (0, *range(4, 256)), (rows, pad)


@pytest.mark.parametrize("group", [3, 5])
def test_attention_rows_of_long_blocks_are_each_a_single_token_pass(group):
    """A copying run verifies up to 65 rows at once. CPU flash attention takes query rows in blocks
    of 32 (64 from 192 rows on), and a last block of a single row (11 rows of 3 query heads each: 33)
    comes out with other bits now and then (2 draws in 200 here); padded calls avoid every small last
    block: each row count up to 65, over 200 draws in the machine's fastest mode."""
    from specchat.backends.native.exact_rows import attend_rows, key_mask

    kv_heads, head_dim, n_keys = 3, 64, 192
    rows = _row_modes(kv_heads, group, head_dim)[0]
    counts = (range(2, 66) if rows == "padded"
              else {n + d for n in range(2, 66) if n * group % 32 == 1 for d in (-1, 0, 1)})
    for seed in range(200 if rows != "separate" else 20):
        g = torch.Generator().manual_seed(seed)
        scale = (0.5, 1.0, 3.0, 8.0)[seed % 4]
        cache = [(scale * torch.randn(1, kv_heads, n_keys, head_dim, generator=g)).bfloat16() for _ in range(2)]
        for n in sorted(counts):
            q = (scale * torch.randn(kv_heads * group, n, head_dim, generator=g)).bfloat16()
            ends = torch.full((n,), n_keys)
            block = attend_rows(q, *cache, n_keys, key_mask(ends, n_keys, torch.bfloat16, (kv_heads, group)), rows)
            one = attend_rows(q[:, -1:], *cache, n_keys, key_mask(ends[-1:], n_keys, torch.bfloat16), rows)
            assert torch.equal(block[0, :, -1], one[0, :, 0]), (seed, n, rows)


def test_compiled_graphs_check_the_first_layers_guards_only():
    """Guards are checked on every call (~2,500 for SmolLM2-135M, ~0.9 ms): those on the second and
    later layers go, those on the inputs, the first layer and everything else stay."""
    from types import SimpleNamespace

    from specchat.backends.native.exact_rows import first_layer_guards

    layers = "self.model._modules['layers']._modules"
    names = {"x": True, "mask": True, "n_keys": True, "self.model.rope_cos": True, "self.model.cache.k[0]": True,
             "self.model.cache.v[12]": False, "self.model._modules['layers']": True,
             f"{layers}['0']._modules['attention']._modules['qkv'].int4[0]": True,
             f"{layers}['1']._modules['attention']._modules['qkv'].int4[0]": False,
             f"{layers}['10']._modules['attn_norm']._parameters['weight']": False,
             f"{layers}['29']._modules['attention']._modules['o']._forward_hooks": False}
    assert first_layer_guards([SimpleNamespace(name=n) for n in names]) == list(names.values())
