"""Hybrid targets (Qwen3.5 / Qwen3-Next: Gated DeltaNet layers between gated attention layers) in
the torch engine, against transformers' own classes, and their recurrent state's rollback."""
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specchat.backends.base import BackendError, Request, Sampling, run_to_summary
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.model import CHUNKED_FROM
from specchat.backends.native.recurrent_state import ROLLBACK_MODES
from tests.native.tiny import HYBRIDS, assert_reply_and_logits_match, hybrid_config, make_hybrid_checkpoint, make_tokenizer

# float32 engine vs transformers' float32 forward: the same math, summed in other orders
ATOL = 1e-4


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {family: make_hybrid_checkpoint(root / family, family, seed=5 + i) for i, family in enumerate(HYBRIDS)}


def engine(path, rollback="snapshot", precision="float32", context=256) -> TorchBackend:
    return TorchBackend(path, "hf_dir", precision=precision, threads=2, context=context, rollback=rollback)


def transformers_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def random_ids(n, seed=0):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", HYBRIDS)
def test_greedy_reply_and_its_logits_equal_transformers(hybrid_dirs, family):
    """A whole greedy reply streamed by the engine is transformers' greedy reply, and every logit
    of it (prefill, then one-token decode) is transformers' within ATOL."""
    path = hybrid_dirs[family]
    ref, e = transformers_model(path), engine(path)
    assert_reply_and_logits_match(e, ref, max_tokens=40, atol=ATOL)


@pytest.mark.parametrize("family", HYBRIDS)
def test_chunked_prefill_equals_one_token_decode(hybrid_dirs, family):
    """A prefill long enough for the chunked form (several 64-token chunks) and the same tokens
    fed one at a time give the same logits."""
    e = engine(hybrid_dirs[family])
    ids = random_ids(150)
    assert len(ids) > CHUNKED_FROM
    chunked, _ = e.forward(ids, 0)
    e.truncate(0)
    stepped = torch.cat([e.forward([t], i)[0] for i, t in enumerate(ids)])
    assert (chunked - stepped).abs().max() < ATOL


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(ROLLBACK_MODES), prefill=st.integers(1, 70),
       blocks=st.lists(st.tuples(st.integers(1, 8), st.data()), min_size=1, max_size=4))
def test_decode_after_rollback_equals_a_fresh_decode(hybrid_dirs, mode, prefill, blocks):
    """Blocks of k rows of which j are kept (the loop's truncate), in either rollback mode: the next
    rows' logits equal a fresh engine's that only ever saw the kept tokens."""
    path = hybrid_dirs["qwen3_5"]
    e, fresh = engine(path, mode), engine(path, mode)
    ids = random_ids(prefill + 8 * len(blocks) + 4, seed=prefill)
    e.forward(ids[:prefill], 0)
    kept = list(ids[:prefill])
    for k, data in blocks:
        j = data.draw(st.integers(1, k))
        block = ids[len(kept):len(kept) + k]
        e.forward(block, len(kept))
        e.truncate(len(kept) + j)
        kept += block[:j]
    after, _ = e.forward([ids[-1], ids[-2]], len(kept))
    want, _ = fresh.forward(kept + [ids[-1], ids[-2]], 0)
    assert (after - want[-2:]).abs().max() < ATOL


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_rolled_back_state_is_bitwise_a_one_token_decode(hybrid_dirs, mode):
    """Given the same input rows, the state a rollback returns to has the bits of feeding the kept
    rows one token at a time: snapshots are those steps, replay repeats them."""
    e = engine(hybrid_dirs["qwen3_5"], mode)
    layer = next(m for m in e.model.layers if hasattr(m, "mixer")).mixer
    s = layer.shape
    torch.manual_seed(0)
    rows = torch.randn(6, layer.state_width)
    conv0, ssm0 = torch.randn(s.conv_kernel - 1, s.conv_dim), torch.randn(s.v_heads, s.k_dim, s.v_dim)
    conv, ssm = conv0, ssm0
    steps = []
    for t in range(6):
        o, conv, ssm, _ = layer.scan(conv, ssm, rows[t:t + 1])
        steps.append((o[0], conv, ssm))
    o, conv_all, ssm_all, kept = layer.scan(conv0, ssm0, rows, keep=True)
    for t in range(6):
        assert torch.equal(o[t], steps[t][0])
        assert torch.equal(kept[t][0], steps[t][1]) and torch.equal(kept[t][1], steps[t][2])
    _, conv3, ssm3, _ = layer.scan(conv0, ssm0, rows[:3], outputs=False)  # what replay computes
    assert torch.equal(conv3, steps[2][1]) and torch.equal(ssm3, steps[2][2])


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_rollback_window_and_restart_points(hybrid_dirs, mode):
    e = engine(hybrid_dirs["qwen3_5"], mode)
    ids = random_ids(60)
    e.forward(ids[:40], 0)  # chunked: only its end can be returned to
    assert e.restart_point(40) == 40 and e.restart_point(39) == 0
    e.forward(ids[40:46], 40)  # a verify block: any of its positions
    assert [e.restart_point(n) for n in (46, 43, 40, 39, 10)] == [46, 43, 40, 0, 0]
    e.truncate(43)
    assert e.cache_len == 43 and e.restart_point(41) == 41
    with pytest.raises(ValueError, match="cannot return to 20"):
        e.truncate(20)
    e.truncate(0)
    assert e.cache_len == 0 and e.cached == []


def test_next_turn_prefills_only_what_is_new(hybrid_dirs):
    """A chat's next turn (the conversation so far, then more) reuses the recurrent state the
    previous reply ended with, and replies as an engine that prefilled it all."""
    e = engine(hybrid_dirs["qwen3_5"])
    first = e.prompt_ids(Request(messages=[{"role": "user", "content": "hello world"}]))
    reply = run_to_summary(e.stream(Request(prompt_ids=first), Sampling(max_tokens=12)))
    held = e.cache_len
    assert held == len(first) + len(reply.token_ids) - 1  # the last token is never fed
    second = first + reply.token_ids + random_ids(9)
    again = run_to_summary(e.stream(Request(prompt_ids=second), Sampling(max_tokens=8)))
    assert again.prefill_start == held
    assert again.token_ids == run_to_summary(engine(hybrid_dirs["qwen3_5"]).stream(
        Request(prompt_ids=second), Sampling(max_tokens=8))).token_ids


def test_reference_on_shared_weights_keeps_both_states(hybrid_dirs):
    """The A/B reference on the same weights has a recurrent state of its own: interleaving its
    passes with the engine's changes neither's reply."""
    from specchat.backends.native.shared_weights import SharedWeights

    path = hybrid_dirs["qwen3_5"]
    e = engine(path)
    ref = SharedWeights(e)
    a, b = Request(messages=[{"role": "user", "content": "hello"}]), Request(messages=[{"role": "user", "content": "dog"}])
    sa, sb = e.stream(a, Sampling(max_tokens=15)), ref.stream(b, Sampling(max_tokens=15))
    mixed_a, mixed_b = [], []
    for x, y in zip(sa, sb):
        mixed_a.append(x)
        mixed_b.append(y)
    mixed_a += list(sa)
    mixed_b += list(sb)
    assert mixed_a[-1].token_ids == run_to_summary(engine(path).stream(a, Sampling(max_tokens=15))).token_ids
    assert mixed_b[-1].token_ids == run_to_summary(engine(path).stream(b, Sampling(max_tokens=15))).token_ids


def test_multimodal_layout_loads_its_text_decoder(hybrid_dirs, tmp_path, capsys):
    """The published Qwen3.5 checkpoints nest the text config and prefix the decoder
    `model.language_model.`; the vision tower is skipped with a note."""
    from safetensors.torch import load_file, save_file

    src = hybrid_dirs["qwen3_5"]
    make_tokenizer(tmp_path)
    text = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "architectures":
                                                      ["Qwen3_5ForConditionalGeneration"], "text_config": text}))
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ids = random_ids(20)
    got, _ = engine(tmp_path).forward(ids, 0)
    want, _ = engine(src).forward(ids, 0)
    assert torch.equal(got, want)
    assert "vision tower (1 tensors) is not loaded" in capsys.readouterr().err


def test_what_the_engine_cannot_run_is_named(tmp_path):
    from transformers import AutoModelForCausalLM

    make_tokenizer(tmp_path)
    moe = hybrid_config("qwen3_next", 320)
    moe.mlp_only_layers = [0, 2]  # layers 1 and 3 get experts
    AutoModelForCausalLM.from_config(moe).save_pretrained(str(tmp_path))
    assert engine(tmp_path).model.cfg.moe.sparse_layers == (1, 3)  # routed experts run (tests/native/test_moe.py)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["layer_types"][0] = "sliding_attention"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BackendError, match="layer type 'sliding_attention', which the torch engine does not run"):
        engine(tmp_path)


def test_settings_that_do_not_apply_say_so(hybrid_dirs):
    with pytest.raises(BackendError, match="unknown rollback 'undo'"):
        engine(hybrid_dirs["qwen3_5"], rollback="undo")
    for precision, rollback in (("bfloat16", "replay"), ("float32", "snapshot")):
        with pytest.raises(BackendError, match="hybrid .* bfloat16 or int4 and roll back with snapshots; set .* "
                                               "compile: false"):
            TorchBackend(hybrid_dirs["qwen3_5"], "hf_dir", precision=precision, threads=2, context=64, compile=True,
                         rollback=rollback)


def test_block_memory_is_stated_for_both_modes(hybrid_dirs):
    state = engine(hybrid_dirs["qwen3_5"]).model.cache.recurrent
    s = state.shape
    one_state = ((s.conv_kernel - 1) * s.conv_dim + s.v_heads * s.k_dim * s.v_dim) * 4
    assert state.block_bytes(8, "snapshot") == 2 * 8 * one_state  # two linear layers
    assert state.block_bytes(8, "replay") == 2 * (one_state + 8 * (s.conv_dim + 2 * s.v_heads) * 4)


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_held_positions_span_consecutive_passes(hybrid_dirs, mode):
    """A draft model's one-token passes: with hold_positions, the next proposal can roll back into
    any of them, and decoding from there equals a fresh decode."""
    path = hybrid_dirs["qwen3_5"]
    e = engine(path, mode)
    e.hold_positions(8)
    ids = random_ids(40)
    e.forward(ids[:20], 0)
    for i in range(20, 26):
        e.forward([ids[i]], i)
    assert [e.restart_point(n) for n in (26, 22, 20, 19)] == [26, 22, 20, 0]  # 20..26: the one-token passes
    e.truncate(22)
    got, _ = e.forward(ids[30:33], 22)
    want, _ = engine(path, mode).forward(ids[:22] + ids[30:33], 0)
    assert (got - want[-3:]).abs().max() < ATOL
    for i in range(25, 40):  # past the span, the window starts again at the latest pass
        e.forward([ids[i]], i)
    assert e.restart_point(39) == 39 and e.restart_point(30) == 0


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_changed_reply_restarts_from_the_turn_boundary(hybrid_dirs, mode):
    """A chat whose template re-renders the last reply (here: another text in its place) restarts
    from the checkpoint where that reply started, not from position 0, and replies as a fresh engine."""
    path = hybrid_dirs["qwen3_5"]
    e = engine(path, mode)
    turn = [{"role": "user", "content": "hello world, how are you today?"}]
    first = e.prompt_ids(Request(messages=turn))
    reply = run_to_summary(e.stream(Request(messages=turn), Sampling(max_tokens=12)))
    assert reply.prefill_start == 0 and e.cache_len > len(first)
    convo = turn + [{"role": "assistant", "content": "something else"}, {"role": "user", "content": "the lazy dog"}]
    second = e.prompt_ids(Request(messages=convo))
    assert second[:len(first)] == first and second[len(first)] != reply.token_ids[0]  # changed after the boundary
    sampling = Sampling(temperature=0.8, seed=4, max_tokens=12)
    again = run_to_summary(e.stream(Request(messages=convo), sampling))
    assert again.prefill_start == len(first)
    assert again.token_ids == run_to_summary(engine(path, mode).stream(Request(messages=convo), sampling)).token_ids


def test_turn_checkpoints_are_bounded_and_dropped_past_a_rollback(hybrid_dirs):
    from specchat.backends.native.recurrent_state import MAX_CHECKPOINTS

    e = engine(hybrid_dirs["qwen3_5"])
    state = e.model.cache.recurrent
    ids = random_ids(120)
    for start in range(0, 100, 10):  # ten prefills of ten rows, each after the last
        e.forward(ids[start:start + 10], start, all_logits=False)
    assert sorted(state.turns) == [70, 80, 90, 100][-MAX_CHECKPOINTS:]
    assert [e.restart_point(n) for n in (95, 85, 69)] == [95, 80, 0]  # 90..100: the last pass's window
    e.truncate(e.restart_point(85))  # the checkpoints after 80 belong to text that is gone
    assert e.cache_len == 80 and sorted(state.turns) == [70, 80]
    got, _ = e.forward(ids[80:84], 80)
    want, _ = engine(hybrid_dirs["qwen3_5"]).forward(ids[:84], 0)
    assert (got - want[-4:]).abs().max() < ATOL
    assert state.checkpoint_bytes() > 0
