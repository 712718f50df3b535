"""The central invariant: speculative output == target-only output, for every drafter, depth and
sampling mode (exact acceptance, same seed)."""
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.verify import fresh
from tests.speculative.conftest import PROMPTS, SAMPLINGS, Counting, compare


@pytest.mark.parametrize("method", ["ngram", "ngram-copy", "draft", "self", "mtp", "mtp-prenorm", "dflash", "dspark", "eagle3"])
@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8", "t1.2-topk-topp"])
def test_speculative_equals_target_only(target, drafters, method, depth, sampling):
    ref, out, verdict = compare(target, drafters[method]("exact"), depth, sampling)
    assert verdict.kind == "identical", verdict.line()
    assert out.tokens == ref.tokens and out.stop_reason == ref.stop_reason
    assert out.passes <= ref.passes


@pytest.mark.parametrize("method", ["mtp+lookup", "dflash+lookup", "dspark+lookup", "draft+lookup", "eagle3+lookup"])
@pytest.mark.parametrize("depth", [1, 2, 5])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8", "t1.2-topk-topp"])
def test_lookup_first_keeps_parity_and_uses_both_drafters(target, drafters, method, depth, sampling):
    drafter = drafters[method]("exact")
    lookup, model = Counting(drafter.index), Counting(drafter.model)
    ref, out, verdict = compare(target, drafter, depth, sampling)
    assert verdict.kind == "identical", verdict.line()
    assert out.tokens == ref.tokens and out.stop_reason == ref.stop_reason
    assert lookup.passes > 0 and model.passes > 0  # both kinds of pass happened, the model stayed in step
    assert model.longest <= depth  # `depth` is the model drafter's; lookup has its own
    assert lookup.longest <= drafter.lookup_depth  # (test_gate: lookup drafts past the model's depth)


def test_self_drafting_accepts_every_draft_under_greedy(target, drafters):
    depth = 4
    ref, out, verdict = compare(target, drafters["self"]("exact"), depth, Sampling(max_tokens=41))
    assert verdict.kind == "identical"
    # 1 token from the prefill, then full passes of depth + 1 tokens.
    assert out.accepted_tokens == out.draft_tokens
    assert out.passes == 1 + (41 - 1) // (depth + 1)
    assert out.mean_accepted == depth + 1
    assert out.acceptance_by_position == [1.0] * depth


def test_self_drafting_at_temperature_shares_the_noise(target, drafters):
    # The draft model samples with the target's position-keyed noise, so drafting with the
    # target itself is always right, at any temperature.
    ref, out, verdict = compare(target, drafters["self"]("exact"), 3, Sampling(temperature=1.0, seed=9, max_tokens=30))
    assert verdict.kind == "identical" and out.acceptance_rate == 1.0


def test_multi_turn_prefix_reuse_keeps_parity(target, drafters):
    convo = PROMPTS[1] + [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "the lazy dog"}]
    for messages in (PROMPTS[1], convo):
        _, _, verdict = compare(target, drafters["draft"]("exact"), 3, Sampling(max_tokens=30), messages)
        assert verdict.kind == "identical", verdict.line()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["ngram", "ngram-copy", "draft", "mtp", "dflash", "dspark", "mtp+lookup",
                                 "mtp+lookup-copy", "dflash+lookup", "dspark+lookup", "eagle3"]),
       depth=st.integers(1, 16),  # long blocks too: copy runs verify up to 65 rows
       temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]), top_k=st.sampled_from([0, 1, 5, 50]),
       top_p=st.sampled_from([1.0, 0.95, 0.5]), seed=st.integers(0, 2**31 - 1),
       prompt=st.sampled_from(PROMPTS), max_tokens=st.integers(1, 30))
def test_property_speculative_equals_target_only(target, drafters, method, depth, temperature, top_k, top_p,
                                                 seed, prompt, max_tokens):
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=max_tokens)
    ref, out, verdict = compare(target, drafters[method]("exact"), depth, sampling, prompt)
    assert verdict.kind == "identical", verdict.line()
    assert out.stop_reason == ref.stop_reason


@pytest.fixture(scope="module")
def bf16_pair(tiny_pair):
    from tests.speculative.conftest import engine

    return engine(tiny_pair[0], "bfloat16"), engine(tiny_pair[1], "bfloat16")


@pytest.mark.parametrize("depth", [1, 3, 6])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t0.8", "t1.2-topk-topp"])
def test_strict_verification_is_bitwise_target_only(bf16_pair, depth, sampling):
    """bfloat16 verify blocks computed row by row reproduce single-token decoding exactly, so
    the replies are identical with no tolerance at all."""
    from specchat.backends.speculative.drafters import DraftModelDrafter

    target, draft = bf16_pair
    assert target.model.argmax_head is not None  # greedy blocks go through the int8 head (argmax_head.py)
    spec = SpeculativeBackend(target, DraftModelDrafter(draft), depth, strict=True)
    for messages in PROMPTS:
        ref = run_to_summary(fresh(target).stream(Request(messages=messages), sampling))
        out = run_to_summary(fresh(spec).stream(Request(messages=messages), sampling))
        assert out.token_ids == ref.token_ids


@pytest.mark.parametrize("rows", ["padded", "separate"])
@pytest.mark.parametrize("depth", [2, 6])
def test_strict_verification_without_shared_attention_rows_is_bitwise_target_only(tiny_pair, depth, rows):
    """Where the CPU's attention kernel changes a row's bits with the rows sharing its call (the
    probe finds this on AMD EPYC), the attention calls are padded so that no query block is small,
    or each verify row gets a call of its own: strict replies stay identical to target-only
    decoding (padded: on every machine where the probe says it keeps a row's bits)."""
    from specchat.backends.native.exact_rows import mode_keeps_row_bits
    from specchat.backends.speculative.drafters import DraftModelDrafter
    from tests.speculative.conftest import engine

    target, draft = engine(tiny_pair[0], "bfloat16"), engine(tiny_pair[1], "bfloat16")
    cfg = target.model.cfg
    if rows == "padded" and not mode_keeps_row_bits(cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim,
                                                       torch.bfloat16, rows):
        pytest.skip("padded attention calls do not keep a row's bits on this CPU (a call per row is tested)")
    target.model.attention_mode = rows
    assert target.row_exact_supported and target.model.attention_calls_shared == (rows == "padded")
    spec = SpeculativeBackend(target, DraftModelDrafter(draft), depth, strict=True)
    for sampling in (Sampling(max_tokens=40), Sampling(temperature=0.8, seed=3, max_tokens=40)):
        for messages in PROMPTS:
            ref = run_to_summary(fresh(target).stream(Request(messages=messages), sampling))
            out = run_to_summary(fresh(spec).stream(Request(messages=messages), sampling))
            assert out.token_ids == ref.token_ids


def test_strict_refuses_compiled_graphs_where_rows_cannot_share_attention(tiny_pair, drafters):
    """Compiled graphs cannot give each row a call of its own (the graph would specialize on the
    number of rows): there strict verification is refused with the way out, not run inexactly."""
    from specchat.backends.base import BackendError
    from tests.speculative.conftest import engine

    target = engine(tiny_pair[0], "bfloat16")
    target.model.attention_mode = "separate"
    target.compile_planned = True  # as compile: true plans it, without compiling
    assert not target.row_exact_supported
    with pytest.raises(BackendError, match="compile: true needs an attention kernel"):
        SpeculativeBackend(target, drafters["ngram"]("exact"), 3, strict=True)
    assert SpeculativeBackend(target, drafters["ngram"]("exact"), 3, strict=None).strict is False


def test_verify_rows_reach_the_argmax_head_in_one_call(bf16_pair):
    """The int8 head streams its weights once for any number of rows; the float32 head (top-k /
    top-p) costs per pair of rows, so the loop gives it pairs and stops at a rejected draft."""
    target = bf16_pair[0]
    assert target.verify_chunk(Sampling()) is None
    assert target.verify_chunk(Sampling(temperature=0.8, seed=1)) is None
    assert target.verify_chunk(Sampling(temperature=1.2, top_k=20, seed=1)) == 2


def test_strict_refuses_kernels_that_are_not_row_invariant(target, drafters):
    from specchat.backends.base import BackendError

    with pytest.raises(BackendError, match="strict verification needs row-invariant kernels"):
        SpeculativeBackend(target, drafters["ngram"]("exact"), 3, strict=True)  # float32 target


def test_strict_needs_matmuls_that_keep_a_rows_bits_on_this_cpu(tiny_pair, drafters, monkeypatch):
    """bfloat16 is row-invariant on CPUs with native bfloat16 (as here), but not on every CPU: the
    engine probes its own layers, and a kernel that rounds a row by its neighbours turns strict
    verification off (auto) or refuses it (strict: true) with one line."""
    from specchat.backends.base import BackendError
    from specchat.backends.native.exact_rows import model_matmuls_keep_row_bits
    from specchat.backends.native.linear import Linear
    from tests.speculative.conftest import engine

    assert model_matmuls_keep_row_bits(engine(tiny_pair[0], "bfloat16").model)  # this machine's kernels
    real = Linear.forward

    def rounds_by_neighbours(self, x, exact=False):  # a CPU whose several-row path rounds otherwise
        y = real(self, x, exact)
        return y if x.shape[0] == 1 else (y.float() * (1 + 2 ** -6)).to(y.dtype)

    monkeypatch.setattr(Linear, "forward", rounds_by_neighbours)
    target = engine(tiny_pair[0], "bfloat16")
    assert not model_matmuls_keep_row_bits(target.model) and not target.row_exact_supported
    with pytest.raises(BackendError, match="gives a row other bits beside other rows"):
        SpeculativeBackend(target, drafters["ngram"]("exact"), 3, strict=True)
    assert not SpeculativeBackend(target, drafters["ngram"]("exact"), 3, strict=None).strict


def test_draft_model_on_an_int4_target_guesses_with_an_int4_head(tmp_path):
    """Loaded from a profile: a draft model beside an int4 target gets an int4 copy of its
    full-vocabulary head (most of a small drafter's cost); the reply stays the target's."""
    from specchat.loading import load_speculative
    from specchat.profiles import load_profile_file
    from tests.native.tiny import make_gguf, make_hf_checkpoint

    gguf = make_gguf(tmp_path / "t.gguf", make_hf_checkpoint(tmp_path / "t", "llama", seed=51), "Q4_1")
    draft = make_gguf(tmp_path / "d.gguf", make_hf_checkpoint(tmp_path / "d", "llama", seed=52), "F32")
    (tmp_path / "p.yaml").write_text(f"backend: torch\nmodel: {gguf}\nthreads: 2\ncontext: 256\n"
                                     f"speculative: {{method: draft, drafter: {draft}, depth: 3}}\n")
    spec = load_speculative(load_profile_file(tmp_path / "p.yaml"))
    assert spec.target.model.runs_int4 and spec.drafter.engine.model.head.quantized
    request, sampling = Request(messages=[{"role": "user", "content": "hello there"}]), Sampling(max_tokens=30)
    ref = run_to_summary(fresh(spec.target).stream(request, sampling))
    assert run_to_summary(fresh(spec).stream(request, sampling)).token_ids == ref.token_ids


@pytest.mark.parametrize("method", ["ngram", "self", "mtp", "dflash", "dspark", "eagle3"])
def test_a_full_context_ends_where_target_only_ends(target, drafters, method):
    # no token at position context_length or beyond, however many drafts the last pass could take
    ref, out, verdict = compare(target, drafters[method]("exact"), 4, Sampling(max_tokens=1000))
    assert ref.stop_reason == "context_full" and ref.prompt_tokens + ref.tokens == target.context_length
    assert verdict.kind == "identical", verdict.line()
    assert out.tokens == ref.tokens and out.stop_reason == "context_full"


def test_a_reply_cancelled_before_it_starts_runs_nothing(target, drafters):
    cancel = threading.Event()
    cancel.set()
    request, sampling = Request(messages=PROMPTS[0]), Sampling(max_tokens=10)
    ref = run_to_summary(fresh(target).stream(request, sampling, cancel))
    out = run_to_summary(SpeculativeBackend(target, drafters["ngram"]("exact"), 3).stream(request, sampling, cancel))
    assert (ref.stop_reason, ref.tokens) == (out.stop_reason, out.tokens) == ("cancelled", 0)


@pytest.mark.timeout(60)  # a loop that does not stop on cancel runs until this
def test_a_reply_cancelled_midway_stops_after_the_current_pass(target, drafters):
    cancel = threading.Event()
    spec = SpeculativeBackend(target, drafters["ngram"]("exact"), 3)
    events = []
    for event in fresh(spec).stream(Request(messages=PROMPTS[0]), Sampling(max_tokens=40), cancel):
        events.append(event)
        if len(events) == 2:
            cancel.set()
    out = events[-1]
    assert out.stop_reason == "cancelled" and len(events) == 3 and 1 < out.tokens < 40
