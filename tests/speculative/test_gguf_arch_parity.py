"""The central invariant on the GGUF architectures beyond the Llama family, as llama.cpp's tools write
them (tiny_archs.py: qwen3moe's routed experts, gemma3's sliding windows): speculative == target-only
on a Q4_K_M target on specchat's kernels (strict verification), for prompt lookup and for a draft
model holding the same weights as Q8_0 (accepted often, rejected sometimes), at depths 1 and 4,
greedy and seeded sampling."""
import pytest

from specchat.backends.base import Request, Sampling, run_to_summary
from specchat.backends.native import q4_kernel
from specchat.backends.native.engine import TorchBackend
from specchat.backends.speculative.backend import SpeculativeBackend
from specchat.backends.speculative.drafters import DraftModelDrafter, NgramDrafter
from specchat.verify import fresh
from tests.native.tiny_archs import GGUF_ARCHS
from tests.speculative.conftest import PROMPTS

pytestmark = pytest.mark.skipif(not q4_kernel.available(), reason="specchat's kernels could not be built here")


def engine(path) -> TorchBackend:
    return TorchBackend(path, threads=2, context=256)


@pytest.fixture(scope="module")
def pairs(arch_ggufs) -> dict:
    """arch -> (the Q4_K_M target, the Q8_0 draft engine)."""
    return {arch: (engine(arch_ggufs[arch, "Q4_K_M"]), engine(arch_ggufs[arch, "Q8_0"])) for arch in GGUF_ARCHS}


@pytest.fixture(scope="module")
def prompt_ids(pairs) -> list[int]:
    """One prompt for both (they share the tiny vocabulary), tokenized as the qwen3moe file says:
    transformers builds gemma3's tokenizer for SentencePiece vocabularies, not this byte-level one."""
    return pairs["qwen3moe"][0].tokenize_chat(PROMPTS[1])


@pytest.mark.parametrize("arch", GGUF_ARCHS)
@pytest.mark.parametrize("method", ["ngram", "near"])
@pytest.mark.parametrize("depth", [1, 4])
@pytest.mark.parametrize("sampling", [Sampling(max_tokens=24), Sampling(temperature=0.8, seed=3, max_tokens=24)],
                         ids=["greedy", "t0.8"])
def test_speculative_equals_target_only(pairs, prompt_ids, arch, method, depth, sampling):
    target, near = pairs[arch]
    assert target.row_exact_supported
    drafter = NgramDrafter(1, 3) if method == "ngram" else DraftModelDrafter(near)
    spec = SpeculativeBackend(target, drafter, depth, strict=None)
    request = Request(prompt_ids=prompt_ids)
    ref = run_to_summary(fresh(target).stream(request, sampling))
    out = run_to_summary(fresh(spec).stream(request, sampling))
    assert out.token_ids == ref.token_ids and out.stop_reason == ref.stop_reason
    if method == "near" and depth > 1:
        assert 0 < out.accepted_tokens < out.draft_tokens  # blocks kept in part: rollback exercised
