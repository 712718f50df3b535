"""GGUF files as llama.cpp's quantizer writes them (Q4_K_M, Q5_K_M, Q6_K, Q8_0) on the native engine:
their matrices run on specchat's kernels from their own blocks (no float copy), the engine holds
about the file's bytes, its greedy choices are llama.cpp's, and speculation changes no token."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native import kquant, memory_plan, q4_kernel
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.kquant import TileEmbedding
from specchat.backends.native.linear import Linear
from specchat.backends.native.memory_plan import held_bytes
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.drafters import DraftModelDrafter, NgramDrafter
from specchat.verify import fresh
from tests.conftest import KQUANT_FTYPES
from tests.speculative.conftest import PROMPTS

pytestmark = pytest.mark.skipif(not q4_kernel.available(), reason="specchat's kernels could not be built here")

TEXT = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog, and then Paris is the capital"}]


def engine(path, **kw) -> TorchBackend:
    return TorchBackend(path, threads=2, context=256, **kw)


@pytest.fixture
def heads_on_tiles(monkeypatch):
    """The tiny model's head (and embedding) on the kernels' tiles, as a big vocabulary's are."""
    monkeypatch.setattr(memory_plan, "HEAD_FLOAT_MAX_BYTES", 0)


def file_types(path) -> set[str]:
    return {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("ftype", KQUANT_FTYPES)
def test_every_matrix_runs_on_the_kernels_in_its_file_type(kquant_ggufs, ftype):
    path = kquant_ggufs[ftype]
    e = engine(path)
    assert e.precision == "int4" and e.model.kernel.startswith("specchat-")
    linears = [m for m in e.model.layers.modules() if isinstance(m, Linear)]
    assert linears and all(m.kq is not None and m.weight is None and m.dense is None for m in linears)
    kinds = {kind for m in linears for kind, _ in m.kq_layout}
    names = {type_id: name for name, (type_id, _, _) in kquant.TYPES.items()}
    assert {names[k] for k in kinds} <= file_types(path)
    if ftype == "Q4_K_M":  # llama.cpp's mix: Q4_K, with Q6_K for some attn_v and ffn_down
        assert kinds == {12, 14}


@pytest.mark.parametrize("ftype", KQUANT_FTYPES)
def test_greedy_choices_are_llamacpps(kquant_ggufs, ftype, heads_on_tiles):
    """Both engines multiply the file's blocks with int8 activations (llama.cpp's in blocks of 256
    for K-quants, specchat's of 32): against the float32 product of the same dequantized weights
    specchat's logits are as close as llama.cpp's (closer for K-quants), and wherever that float32 model's choice
    is clear (top-2 margin of a logit or more) both engines make it. (On every position the random
    tiny model's near-ties leave 80-95% agreement, between llama.cpp and the float32 model too.)"""
    from llama_cpp import Llama

    path = kquant_ggufs[ftype]
    e = engine(path)
    assert isinstance(e.model.embed, TileEmbedding)
    ids = e.tokenize_chat([{"role": "user", "content": TEXT[0]["content"] + ". " + TEXT[0]["content"]}])
    ours, floats = e.forward(ids, 0)[0], engine(path, precision="float32").forward(ids, 0)[0]
    llm = Llama(str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids)
    theirs = torch.from_numpy(np.asarray(llm.scores[:len(ids)]))
    assert (ours - floats).abs().mean() <= 1.25 * (theirs - floats).abs().mean()
    top2 = floats.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] >= 1.0
    assert clear.sum() >= 20
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])


@pytest.mark.parametrize("ftype", KQUANT_FTYPES)
def test_the_engine_holds_about_the_files_bytes(kquant_ggufs, ftype, heads_on_tiles):
    path = kquant_ggufs[ftype]
    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    parts = held_bytes(engine(path).model)
    held = parts["layers"] + parts["head"] + parts["embed"]
    assert held <= 1.15 * tensor_bytes, (held, tensor_bytes)


def test_the_embedding_is_the_files_rows(kquant_ggufs, heads_on_tiles):
    """Rows looked up in the head's tiles are gguf's dequantized rows, bit for bit."""
    from gguf.quants import dequantize

    path = kquant_ggufs["Q4_K_M"]
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    rows = torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
    ids = torch.tensor([0, 1, 17, rows.shape[0] - 1])
    assert torch.equal(engine(path).model.embed[ids], rows[ids])


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q6_K", "Q8_0", "F16"])
@pytest.mark.parametrize("sampling", [Sampling(max_tokens=40), Sampling(temperature=0.8, seed=3, max_tokens=40)],
                         ids=["greedy", "t0.8"])
@pytest.mark.parametrize("depth", [1, 3, 6])
def test_speculative_equals_target_only(kquant_ggufs, ftype, sampling, depth, heads_on_tiles):
    """As a profile runs it (strict: auto, which the kernels allow): every token target-only's, for
    prompt lookup and for a draft model (the same file: long accepted drafts)."""
    target = engine(kquant_ggufs[ftype])
    assert target.row_exact_supported
    for drafter in (NgramDrafter(1, 3), DraftModelDrafter(engine(kquant_ggufs[ftype]))):
        spec = SpeculativeBackend(target, drafter, depth, strict=None)
        for messages in PROMPTS:
            ref = run_to_summary(fresh(target).stream(Request(messages=messages), sampling))
            out = run_to_summary(fresh(spec).stream(Request(messages=messages), sampling))
            assert out.token_ids == ref.token_ids
            if isinstance(drafter, DraftModelDrafter) and depth > 1:
                assert out.passes < ref.passes
