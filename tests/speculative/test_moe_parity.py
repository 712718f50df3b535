"""The central invariant on mixture-of-experts targets: speculative == target-only for the drafters,
depths and sampling modes of the other grids; MTP heads whose own layer has routed experts
(GLM-4.5's `model.layers.{N}` and Qwen3.5-MoE's `mtp.*`) verify clean; a verify block that routes
a row with another row's experts is caught as a mismatch."""
import pytest

from specchat.backends.base import Request, Sampling
from specchat.backends.native import moe as moe_module
from specchat.backends.native.engine import TorchBackend
from specchat.backends.native.moe import RoutedExperts
from specchat.backends.speculative import backend as backend_module
from specchat.backends.speculative.drafters import DraftModelDrafter, NgramDrafter
from specchat.compare import MISMATCH
from specchat.verify import check_prompt
from tests.native.tiny import perturbed_copy
from tests.native.tiny_moe import add_moe_mtp_head, make_moe_checkpoint
from tests.speculative.conftest import PROMPTS, compare, eagle3_drafter, mtp_drafter
from tests.speculative.test_planted_bugs import mutate


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """A GLM-4.5-style target with a built-in (random) MTP layer whose MLP is routed experts, a
    noisy copy of it as a draft model, and a Qwen3.5-MoE hybrid target with an `mtp.*` MoE head."""
    root = tmp_path_factory.mktemp("moe-spec")
    glm = make_moe_checkpoint(root / "glm", "glm4_moe", seed=41)
    near = perturbed_copy(glm, root / "near", scale=0.02, seed=42)
    add_moe_mtp_head(glm, "deepseek", seed=43)
    qwen = make_moe_checkpoint(root / "qwen", "qwen3_5_moe", seed=44)
    add_moe_mtp_head(qwen, "qwen3_next", seed=45)
    return glm, near, qwen


def engine(path, precision="float32") -> TorchBackend:
    return TorchBackend(path, "hf_dir", precision=precision, threads=2, context=256)


@pytest.fixture(scope="module")
def moe_target(moe_pair, tmp_path_factory):
    from specchat.backends.speculative.dflash import DFlashDrafter, load_dflash
    from tests.speculative.tiny_dflash import make_dflash_checkpoint
    from tests.speculative.tiny_eagle3 import make_eagle3_checkpoint

    glm, near, _ = moe_pair
    target, draft = engine(glm), engine(near)
    root = tmp_path_factory.mktemp("moe-heads")
    dflash = load_dflash(make_dflash_checkpoint(root / "dflash", glm, block_size=7, target_layer_ids=(0, 2)),
                         target.model.cfg)
    eagle3 = make_eagle3_checkpoint(root / "eagle3", glm, seed=46)
    return target, {
        "ngram": lambda: NgramDrafter(1, 3),
        "near": lambda: DraftModelDrafter(draft),
        "mtp": lambda: mtp_drafter(target, glm),
        "eagle3": lambda: eagle3_drafter(target, eagle3),
        "dflash": lambda: DFlashDrafter(dflash, target),
    }


@pytest.mark.parametrize("method", ["ngram", "near", "mtp", "eagle3", "dflash"])
@pytest.mark.parametrize("depth", [1, 4])
@pytest.mark.parametrize("sampling", [Sampling(max_tokens=24), Sampling(temperature=0.8, seed=3, max_tokens=24)],
                         ids=["greedy", "t0.8"])
def test_speculative_equals_target_only_on_a_moe_target(moe_target, method, depth, sampling):
    target, drafters = moe_target
    ref, out, verdict = compare(target, drafters[method](), depth, sampling, PROMPTS[1])
    assert verdict.kind == "identical", verdict.line()
    assert out.tokens == ref.tokens and out.stop_reason == ref.stop_reason


def test_the_near_drafter_is_accepted_and_rejected(moe_target):
    """So that the grid exercises blocks whose rows choose different experts and rollback."""
    target, drafters = moe_target
    _, out, _ = compare(target, drafters["near"](), 4, Sampling(max_tokens=24), PROMPTS[1])
    assert 0 < out.accepted_tokens < out.draft_tokens


@pytest.mark.parametrize("which", ["glm", "qwen"])
def test_moe_mtp_heads_verify_clean_strict(moe_pair, which):
    """GLM-4.5's MTP layer (`model.layers.{N}`: eh_proj, enorm, hnorm, shared_head) and Qwen3.5-MoE's
    `mtp.*` head, each with routed experts in its layer, three tokens deep (its one layer run again
    for the second and third) on a strict bfloat16 target: every reply is target-only's."""
    path = moe_pair[0] if which == "glm" else moe_pair[2]
    target = engine(path, "bfloat16")
    assert target.row_exact_supported
    drafter = mtp_drafter(target, path)
    assert isinstance(drafter.head.layers[0]["layer"].mlp, RoutedExperts)
    spec = backend_module.SpeculativeBackend(target, drafter, 3, strict=True)
    for sampling in (Sampling(max_tokens=24), Sampling(temperature=0.8, seed=3, max_tokens=24)):
        _, out, verdict = check_prompt(spec, target, Request(messages=PROMPTS[1]), sampling)
        assert verdict.kind == "identical", verdict.line()
        assert out.draft_tokens > 0


# the planted bug: in a verify block, every row after the first is routed with the row before it's
# experts (a one-token pass, with one row, is unchanged)
ROUTING_BUG = [("    for row, chosen in enumerate(experts.tolist()):\n",
                "    for row, chosen in enumerate(experts[:1].tolist() + experts[:-1].tolist()):\n")]


def test_a_block_routed_with_another_rows_experts_is_a_mismatch(moe_pair, monkeypatch):
    """Under strict verification (bfloat16 rows exact) any difference is a mismatch, never a near-tie."""
    mutant = mutate(moe_module, ROUTING_BUG)
    monkeypatch.setattr(moe_module, "group_rows", mutant.group_rows)
    glm, near, _ = moe_pair
    target = engine(glm, "bfloat16")
    kinds = set()
    for drafter in (DraftModelDrafter(engine(near, "bfloat16")), NgramDrafter(1, 3)):
        spec = backend_module.SpeculativeBackend(target, drafter, 4, strict=True)
        kinds.add(check_prompt(spec, target, Request(messages=PROMPTS[1]), Sampling(max_tokens=24))[2].kind)
    assert MISMATCH in kinds, "a block routed with another row's experts went unnoticed"


def test_the_unmutated_routing_passes_the_same_check(moe_pair):
    glm, near, _ = moe_pair
    target = engine(glm, "bfloat16")
    for drafter in (DraftModelDrafter(engine(near, "bfloat16")), NgramDrafter(1, 3)):
        spec = backend_module.SpeculativeBackend(target, drafter, 4, strict=True)
        assert check_prompt(spec, target, Request(messages=PROMPTS[1]), Sampling(max_tokens=24))[2].kind == "identical"
