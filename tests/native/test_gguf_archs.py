"""The GGUF architectures beyond the Llama family on the native engine (gguf_loader.py): qwen3moe and
gemma3, each a tiny transformers checkpoint converted by llama.cpp's own converter (F32, Q8_0) and
quantized by its quantizer (Q4_K_M), against transformers on the same weights."""
from __future__ import annotations

import pytest
import torch

from specchat.backends.base import BackendError
from specchat.backends.native import gguf_loader, memory_plan, q4_kernel
from specchat.backends.native.config import ATTENTION, SLIDING_ATTENTION
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.exact_rows import KERNEL_MODE, probe_attention_mode
from specchat.backends.native.gguf_loader import GgufIndex, config_from_gguf, load_gguf
from specchat.backends.native.linear import Linear
from specchat.backends.native.moe import RoutedExperts
from tests.native.tiny import assert_reply_and_logits_match
from tests.native.tiny_archs import GGUF_ARCHS, WINDOW, transformers_on_gguf

# max |logit difference| of the float32 engine against transformers on the same weights (logits O(10))
FP32_TOL = 2e-4
TEXT = ("the quick brown fox jumps over the lazy dog, and then Paris is the capital of France. hello world, "
        "how are you today? speculative decoding is lossless when verified")


def engine(path, **kw) -> TorchBackend:
    return TorchBackend(path, threads=2, context=256, **kw)


def prompt(e: TorchBackend) -> list[int]:
    return e.tokenize_chat([{"role": "user", "content": TEXT + " " + TEXT}])


@pytest.fixture(scope="module")
def references(arch_ggufs) -> dict:
    """(arch, ftype) -> transformers' model on that file's weights (gguf's dequantize), F32: the
    checkpoint itself."""
    from transformers import AutoModelForCausalLM

    out = {}
    for arch in GGUF_ARCHS:
        out[arch, "F32"] = AutoModelForCausalLM.from_pretrained(str(arch_ggufs[arch, "hf"]), dtype=torch.float32).eval()
        for ftype in ("Q8_0", "Q4_K_M"):
            out[arch, ftype] = transformers_on_gguf(arch_ggufs[arch, "hf"], arch_ggufs[arch, ftype])
    return out


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_the_f32_file_replies_and_scores_as_transformers(arch_ggufs, references, arch):
    """Greedy reply streamed and every logit of it (a prefill past gemma3's window, then one-token
    passes) against transformers' generate and forward on the checkpoint the file came from."""
    e = engine(arch_ggufs[arch, "F32"], precision="float32")
    assert e.model.cfg.arch == arch
    assert_reply_and_logits_match(e, references[arch, "F32"], max_tokens=16, atol=FP32_TOL)


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_a_quantized_file_in_float32_is_transformers_on_its_weights(arch_ggufs, references, arch, ftype):
    e = engine(arch_ggufs[arch, ftype], precision="float32")
    ids = prompt(e)
    with torch.inference_mode():
        want = references[arch, ftype](torch.tensor([ids])).logits[0]
    assert (e.forward(ids, 0)[0] - want).abs().max() < FP32_TOL


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_a_quantized_file_runs_on_the_kernels_with_transformers_top1(arch_ggufs, references, arch, ftype):
    """Every matrix (routed experts included) on specchat's kernels in the file's blocks; with its int8
    activations the greedy choice is transformers' (float32, the same weights) on at least 95% of
    positions and wherever transformers' is clear (top-2 margin of a logit or more). Measured on 194
    positions: qwen3moe 99.0% (Q8_0) and 97.4% (Q4_K_M), gemma3 98.5% and 96.4%; the rest near-ties
    and, for qwen3moe, rows whose int8-rounded states choose other experts (largest logit error
    2.1 and 1.4 there, 0.2 for gemma3)."""
    if not q4_kernel.available():
        pytest.skip("specchat's kernels could not be built here")
    e = engine(arch_ggufs[arch, ftype])
    assert e.precision == "int4"
    linears = [m for m in e.model.layers.modules() if isinstance(m, Linear) and m.weight is None]
    assert linears and all(m.kq is not None for m in linears)
    if arch == "qwen3moe":
        assert all(isinstance(layer.mlp, RoutedExperts) for layer in e.model.layers)
        assert all(m.kq is not None for layer in e.model.layers for m in layer.mlp.expert_linears())
    ids = prompt(e)
    got = e.forward(ids, 0)[0]
    with torch.inference_mode():
        want = references[arch, ftype](torch.tensor([ids])).logits[0]
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    top2 = want.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] >= 1.0
    assert agree >= 0.95, agree
    assert clear.sum() >= 20 and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("mode", [KERNEL_MODE, "probed", "separate"])
def test_verify_rows_in_sliding_window_layers_have_their_one_token_bits(arch_ggufs, mode):
    """A row-exact block past the window gives every row the bits of its one-token pass: on
    specchat's attention kernel, and on torch's under the window's masks in the mode this machine's
    probe picks (exact_rows.ATTENTION_MODES) and in a call per row."""
    if mode == KERNEL_MODE and not q4_kernel.attention_kernel_fits(4, 2, 64, torch.bfloat16):
        pytest.skip("the attention kernel runs on AVX512 only")
    e = engine(arch_ggufs["gemma3", "F32"], precision="bfloat16")
    e.model.attention_mode = probe_attention_mode(2, 2, 64, torch.bfloat16) if mode == "probed" else mode
    ids = prompt(e)
    prefix, block = ids[:-6], ids[-6:]
    assert len(prefix) > 2 * WINDOW
    e.forward(prefix, 0)
    rows = e.model.forward(torch.tensor([block]), len(prefix), row_exact=True)[0]
    e.truncate(len(prefix))
    singles = torch.cat([e.model.forward(torch.tensor([[t]]), len(prefix) + i)[0] for i, t in enumerate(block)])
    assert torch.equal(rows, singles)


def test_gemma3_layers_and_scales_are_read_as_llamacpp_reads_them(arch_ggufs):
    cfg = load_gguf(arch_ggufs["gemma3", "F32"]).cfg
    # no sliding_window_pattern in the file: llama.cpp's default, every 6th layer global
    assert cfg.layer_types == (SLIDING_ATTENTION,) * 5 + (ATTENTION, SLIDING_ATTENTION)
    assert (cfg.sliding_window, cfg.rope_local_theta, cfg.rope_theta) == (WINDOW, 10000.0, 1e6)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}  # the global layers' only
    assert cfg.embed_scale == 16.0 and cfg.gelu and cfg.logit_softcap == 30.0 and cfg.query_scale == 64 ** -0.5
    assert cfg.tie_embeddings and cfg.qk_norm and not cfg.compiles


def header(arch: str, **fields) -> GgufIndex:
    base = {"general.architecture": arch, f"{arch}.block_count": 62, f"{arch}.embedding_length": 5376,
            f"{arch}.attention.head_count": 32, f"{arch}.attention.key_length": 128, f"{arch}.feed_forward_length": 64,
            f"{arch}.vocab_size": 8}
    return GgufIndex(base | {f"{arch}.{k.replace('__', '.')}": v for k, v in fields.items()}, {})


def test_gemma3_metadata_variants():
    # the 27B's 62 layers: queries scaled by dim / heads (168) as google's reference code sets it
    assert config_from_gguf(header("gemma3")).query_scale == 168 ** -0.5
    assert config_from_gguf(header("gemma3")).layer_types == ()  # no window: every layer global
    flags = [True, False] * 31
    cfg = config_from_gguf(header("gemma3", attention__sliding_window=512, attention__sliding_window_pattern=flags))
    assert cfg.layer_types == tuple(SLIDING_ATTENTION if f else ATTENTION for f in flags)
    with pytest.raises(BackendError, match="sliding_window_pattern` is 'x'"):
        config_from_gguf(header("gemma3", attention__sliding_window=512, attention__sliding_window_pattern="x"))


def test_qwen3moe_metadata():
    cfg = config_from_gguf(header("qwen3moe", expert_count=128, expert_used_count=8, expert_feed_forward_length=768))
    m = cfg.moe
    assert (m.experts, m.top_k, m.expert_dim, m.renormalise, m.scoring) == (128, 8, 768, True, "softmax")
    assert m.sparse_layers == tuple(range(62)) and not cfg.compiles
    with pytest.raises(BackendError, match="expert_used_count` \\(9\\) is more than its 8 experts"):
        config_from_gguf(header("qwen3moe", expert_count=8, expert_used_count=9, expert_feed_forward_length=768))


@pytest.mark.parametrize("arch, name", [("qwen3moe", "blk.1.ffn_up_exps.weight"),
                                        ("gemma3", "blk.1.post_ffw_norm.weight")])
def test_a_missing_tensor_is_named(arch_ggufs, monkeypatch, arch, name):
    path = arch_ggufs[arch, "Q8_0"]
    index = gguf_loader.read_index(path)
    del index.tensors[name]
    monkeypatch.setattr(gguf_loader, "read_index", lambda *a, **k: index)
    with pytest.raises(BackendError, match=f"tensor {name} missing; the file may be truncated"):
        load_gguf(path)


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_the_engine_holds_about_the_files_bytes_and_the_estimate_says_so(arch_ggufs, monkeypatch, arch):
    """Q4_K_M on the kernels' tiles (the head too, as a big vocabulary's is): within 1.15x the file's
    tensor bytes, and the pre-load estimate (memory_plan.gguf_bytes) within 5% of what is held."""
    import gguf

    monkeypatch.setattr(memory_plan, "HEAD_FLOAT_MAX_BYTES", 0)
    path = arch_ggufs[arch, "Q4_K_M"]
    tensors = gguf.GGUFReader(path).tensors
    parts = memory_plan.held_bytes(engine(path).model)
    held = parts["layers"] + parts["head"] + parts["embed"]
    assert held <= 1.15 * sum(int(t.n_bytes) for t in tensors), held
    estimate = memory_plan.gguf_bytes({t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in tensors})
    assert abs(estimate - held) <= 0.05 * held, (estimate, held)
